"""Is a fo-tune call bound by the host or by the GPU? (2 GPUs)

    python3 bench/host_probe.py --out DIR [--shape MxNxK ...] [--calls N] [--collective C] [--profile]

Session 7's timeline (``docs/perf-notes.md``, run 43: ``bench/ce_trace_probe.py``, profiled) put
the copy-engine call at 2048x4096x4096 AllReduce at ~137 us of GPU work against 0.16 ms per call
in the bench, with idle gaps between calls on one rank. The profiler slows the host, so this probe
times the op the bench times (``fo_kernels.gemm_all_reduce`` / ``gemm_reduce_scatter`` with the
table's schedule, the engine's own graphs replaying) without it, per rank, ``--calls`` calls each:

- ``issue_us``: host time to issue one call (the loop's wall time with no synchronization, the GPU
  held busy by a spin kernel queued first, so no call waits for the GPU);
- ``gpu_us``: GPU time per call with the host out of the way (CUDA events around the calls, all
  queued behind that spin kernel before the first starts);
- ``loop_us``: wall time per call of the plain loop, synchronized at its end (the bench's way).

If ``issue_us`` is near ``loop_us`` and above ``gpu_us``, the host bounds the call. When the queued
calls fill the GPU's launch queue, the host blocks in the launch until the spin ends and
``issue_us`` reads the spin's time per call instead (run 59: AllReduce at 4096x8192x4096 and up).
The same three for the sequential baseline (cuBLAS then NCCL). Every op's result is checked against a float32
reference first. ``--profile``: each rank also profiles its fo-tune calls' host time (cProfile,
``PROFILE_CALLS`` calls after the timings) into DIR/profile_<shape>_<collective>_r<rank>.txt, the
functions by own time, and counts the calls that synchronize with the GPU
(``torch.cuda.set_sync_debug_mode``: session 7 saw one host synchronization per 40-call loop).
Writes DIR/host.csv; prints one line per case and a summary last.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_common import Progress, append_rows, case_options, cases, operands_and_reference, sequential_call

from fo_kernels import gemm_all_reduce, gemm_reduce_scatter
from fo_tune.harness import open_pool
from fo_tune.launch import RankContext
from fo_tune.measure import rel_err

TOLERANCE = 2e-2
WARM_CALLS = 8  # enough for the engine's own graph of the call (captured on the 2nd sighting)
# The spin kernel that holds the GPU while the host queues the calls: this many ms per call queued
# (more than any suite shape's call takes), so the host never waits for the GPU while issuing.
HOLD_MS_PER_CALL = 3.0
DEFAULT_SHAPES = ((2048, 4096, 4096), (4096, 8192, 4096))  # the suite's two smallest
PROFILE_CALLS = 400
PROFILE_LINES = 40  # functions listed per profile


def _measure(fn: Callable[[], torch.Tensor], calls: int, device: torch.device) -> dict[str, float]:
    """issue_us, gpu_us and loop_us of ``fn`` (see the module docstring)."""
    for _ in range(WARM_CALLS):
        fn()
    torch.cuda.synchronize(device)
    cycles_per_ms = torch.cuda.get_device_properties(device).clock_rate  # kHz
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(HOLD_MS_PER_CALL * calls * cycles_per_ms))
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    issue = (time.perf_counter() - t0) / calls * 1e6
    end.record()
    torch.cuda.synchronize(device)
    gpu = start.elapsed_time(end) / calls * 1e3
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize(device)
    loop = (time.perf_counter() - t0) / calls * 1e6
    return {"issue_us": issue, "gpu_us": gpu, "loop_us": loop}


def _profile(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[str, int]:
    """(cProfile's listing by own time, synchronizing calls seen) over ``PROFILE_CALLS`` calls."""
    torch.cuda.synchronize(device)
    profiler = cProfile.Profile()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            profiler.enable()
            for _ in range(PROFILE_CALLS):
                fn()
            profiler.disable()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(PROFILE_LINES)
    # (torch's own notice that the mode is a prototype also says "Synchronization": run 58 counted it)
    syncs = [str(w.message) for w in seen if "called a synchronizing" in str(w.message)]
    head = f"{PROFILE_CALLS} calls; {len(syncs)} synchronizing operations" + "".join(
        f"\n  {x}" for x in sorted(set(syncs))
    )
    return head + "\n" + text.getvalue(), len(syncs)


class HostTask:
    def __init__(self, m: int, n: int, k: int, collective: str, calls: int, profile: bool) -> None:
        self.m, self.n, self.k, self.collective, self.calls = m, n, k, collective, calls
        self.profile = profile

    def run(self, ctx: RankContext) -> dict:
        a, b, ref = operands_and_reference(ctx, self.m, self.n, self.k, self.collective)
        op = gemm_all_reduce if self.collective == "all_reduce" else gemm_reduce_scatter
        fns = {"fo_tune": lambda: op(a, b), "seq": sequential_call(self.collective, a, b, ctx.world_size)[0]}
        out = {}
        for name, fn in fns.items():
            err = rel_err(fn(), ref)
            out[name] = {**_measure(fn, self.calls, ctx.device), "rel_err": err}
        if self.profile:
            out["profile"], out["fo_tune"]["syncs"] = _profile(fns["fo_tune"], ctx.device)
        return out


def main() -> None:
    ap = case_options(__doc__.splitlines()[0], rounds=None, shapes="2048x4096x4096 and 4096x8192x4096")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--profile", action="store_true", help="also profile the fo-tune calls' host time")
    args = ap.parse_args()
    shapes, collectives = cases(args, DEFAULT_SHAPES)
    progress = Progress()
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        for m, n, k in shapes:
            for coll in collectives:
                per_rank = pool.run(HostTask(m, n, k, coll, args.calls, args.profile), timeout_s=300)
                rows, parts = [], []
                for rank, res in enumerate(per_rank):
                    profile = res.pop("profile", None)
                    if profile is not None:
                        (args.out / f"profile_{m}x{n}x{k}_{coll}_r{rank}.txt").write_text(profile)
                    for name, r in res.items():
                        r.setdefault("syncs", "")
                        ok = r["rel_err"] == r["rel_err"] and r["rel_err"] < TOLERANCE
                        rows.append(dict(m=m, n=n, k=k, collective=coll, rank=rank, variant=name,
                                         status="PASS" if ok else "FAIL", **r))  # fmt: skip
                        parts.append(
                            f"r{rank} {name} issue {r['issue_us']:.0f} gpu {r['gpu_us']:.0f} "
                            f"loop {r['loop_us']:.0f} us{'' if ok else ' FAIL'}"
                        )
                append_rows(args.out / "host.csv", rows)
                progress.line(f"{m}x{n}x{k} {coll}: " + ", ".join(parts))
    progress.summary()


if __name__ == "__main__":
    main()
