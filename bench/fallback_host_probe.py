"""Where does the host block, call by call, in the ``overlap: false`` fallback's loops? (2 GPUs)

    python3 bench/fallback_host_probe.py --out DIR [--shape MxNxK ...] [--collective C] [--calls N]

Run 67 (``docs/perf-notes.md``): replayed from the runtime's own graphs the fallback issued 200
calls in ~3 ms each (``bench/host_probe.py``), the time of the spin kernel holding the GPU, so the
host waited for the GPU somewhere; eagerly, its loop ran up to 1.6x slower than cuBLAS then NCCL.
Per variant, on every rank:

- ``issue``: the host time of each of ``--calls`` calls queued behind a spin kernel (3 ms a call),
  so none needs the GPU: the first call's, the median, the largest, and how many calls ran before
  the first that took over 1 ms (the launch queue's depth, if one blocks);
- ``gpu_us``: GPU time per call, with the host out of the way (CUDA events around the queued calls);
- ``loop_us``: wall time per call of a plain loop synchronized at its end (median of 3).

Variants: ``seq`` (the bench's: cuBLAS into a preallocated buffer, then torch.distributed's
collective), ``inline`` (``fo_kernels.fallback.sequential``: fresh buffers, the process group's
collective directly), ``fo_eager`` (the op with an ``overlap: false`` row, its graphs off),
``fo_graph`` (the same, graphs on), ``nccl_graph`` (only the collective, replayed from a graph:
cuBLAS left out), ``gemm_graph`` (only cuBLAS, replayed from a graph). Results are checked first.
Writes DIR/fallback_host.csv; prints a line per variant and a summary last. NCCL reads
``NCCL_GRAPH_MIXING_SUPPORT`` when a communicator is made: run it again with 0 to see its effect.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_common import Progress, append_rows, case_options, cases, operands_and_reference, sequential_call

from fo_kernels import gemm_all_reduce, gemm_reduce_scatter
from fo_kernels.collectives import all_reduce_now, reduce_scatter_now
from fo_kernels.fallback import sequential
from fo_kernels.graphs import GRAPH_AFTER_CALLS
from fo_kernels.runtime import runtime_for
from fo_kernels.schedule import Problem, Schedule
from fo_tune.harness import open_pool
from fo_tune.launch import RankContext
from fo_tune.measure import rel_err

TOLERANCE = 2e-2
WARM_CALLS = 8  # past the graph's capture (the GRAPH_AFTER_CALLS-th call of a key)
HOLD_MS_PER_CALL = 3.0  # the spin holding the GPU while the host queues: longer than any call here
BLOCKED_US = 1000.0  # a call whose issue took longer waited for the GPU
LOOP_ROUNDS = 3


def _issue(fn: Callable[[], object], calls: int, device: torch.device) -> tuple[list[float], float]:
    """(host us of each call queued behind a spin kernel, GPU us per call)."""
    torch.cuda.synchronize(device)
    cycles_per_ms = torch.cuda.get_device_properties(device).clock_rate  # kHz
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(HOLD_MS_PER_CALL * calls * cycles_per_ms))
    start.record()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    end.record()
    torch.cuda.synchronize(device)
    return times, start.elapsed_time(end) / calls * 1e3


def _loop(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    rounds = []
    for _ in range(LOOP_ROUNDS):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds)


def _graph_of(fn: Callable[[], object]) -> Callable[[], object]:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


class FallbackHostTask:
    def __init__(self, m: int, n: int, k: int, collective: str, calls: int) -> None:
        self.m, self.n, self.k, self.collective, self.calls = m, n, k, collective, calls

    def run(self, ctx: RankContext) -> dict:
        m, n, k, coll, w = self.m, self.n, self.k, self.collective, ctx.world_size
        a, b, ref = operands_and_reference(ctx, m, n, k, coll)
        op = gemm_all_reduce if coll == "all_reduce" else gemm_reduce_scatter
        row = Schedule(
            collective=coll, dtype="bfloat16", world_size=w, problem=Problem(m=m, n=n, k=k), overlap=False
        )
        graphs = runtime_for(ctx.device, None).fallback().graphs
        assert graphs is not None, "needs CUDA and NCCL"

        def fo(after: int) -> Callable[[], torch.Tensor]:
            def call() -> torch.Tensor:
                graphs.after = after
                return op(a, b, schedule=row)

            return call

        full = torch.empty((m, n), dtype=a.dtype, device=a.device)
        shard = torch.empty((m // w, n), dtype=a.dtype, device=a.device)
        torch.mm(a, b, out=full)

        def comm_only() -> None:
            if coll == "all_reduce":
                all_reduce_now(full)
            else:
                reduce_scatter_now(shard, full)

        checked = {
            "seq": sequential_call(coll, a, b, w)[0],
            "inline": lambda: sequential(coll, a, b, None, w),
            "fo_eager": fo(0),
            "fo_graph": fo(GRAPH_AFTER_CALLS),
        }
        out = {}
        for name, fn in checked.items():
            out[name] = {"rel_err": rel_err(fn(), ref)}
        unchecked = {
            "nccl_graph": _graph_of(comm_only),
            "gemm_graph": _graph_of(lambda: torch.mm(a, b, out=full)),
        }
        for name, fn in {**checked, **unchecked}.items():
            for _ in range(WARM_CALLS):
                fn()
            times, gpu = _issue(fn, self.calls, ctx.device)
            blocked = [i for i, t in enumerate(times) if t > BLOCKED_US]
            out.setdefault(name, {"rel_err": float("nan")}).update(
                first_us=times[0], median_us=statistics.median(times), max_us=max(times),
                before_block=blocked[0] if blocked else self.calls, blocked=len(blocked), gpu_us=gpu,
                loop_us=_loop(fn, self.calls, ctx.device),
            )  # fmt: skip
        graphs.after = GRAPH_AFTER_CALLS
        return out


def main() -> None:
    ap = case_options(__doc__.splitlines()[0], rounds=None, shapes="1024x4096x4096")
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    shapes, collectives = cases(args, ((1024, 4096, 4096),))
    mixing = os.environ.get("NCCL_GRAPH_MIXING_SUPPORT", "default")
    progress = Progress()
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        for (m, n, k), coll in ((s, c) for s in shapes for c in collectives):
            per_rank = pool.run(FallbackHostTask(m, n, k, coll, args.calls), timeout_s=300)
            rows = []
            for rank, res in enumerate(per_rank):
                for name, r in res.items():
                    rows.append(
                        dict(m=m, n=n, k=k, collective=coll, mixing=mixing, rank=rank, variant=name, **r)
                    )
            append_rows(args.out / "fallback_host.csv", rows)
            for name in per_rank[0]:
                r0, r1 = per_rank[0][name], per_rank[1][name]
                bad = any(not (r["rel_err"] < TOLERANCE) for r in (r0, r1)) and name in (
                    "seq",
                    "inline",
                    "fo_eager",
                    "fo_graph",
                )
                progress.line(
                    f"{m}x{n}x{k} {coll} mixing={mixing} {name}: issue first {r0['first_us']:.0f} median "
                    f"{r0['median_us']:.0f} max {r0['max_us']:.0f} us, {r0['before_block']} calls before a "
                    f"block ({r0['blocked']} blocked); gpu {r0['gpu_us']:.0f} us; loop {r0['loop_us']:.0f} / "
                    f"{r1['loop_us']:.0f} us (r0/r1)" + (" FAIL" if bad else "")
                )
    progress.summary()


if __name__ == "__main__":
    main()
