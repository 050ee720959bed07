"""Why is the ``overlap: false`` ReduceScatter slower than a plain loop at small shapes? (2 GPUs)

    python3 bench/rs_fallback_probe.py [--shape MxNxK]

Run 64 (``bench/host_probe.py --shape 1024x4096x4096``) timed the runtime's fallback (the table
says ``overlap: false`` there: cuBLAS, then the collective through ``fo_kernels.runtime``) at 114 us
per call in a plain loop against 82 for the probe's sequential call, with the same GPU time (80 us,
all calls queued) and 66-69 us of host time per call. This probe times, per rank, 200-call loops
(synchronized at the end, median of 3 rounds) of the ways to write GEMM then ReduceScatter:
``pre_*`` reuse preallocated buffers, ``fresh_*`` allocate the GEMM's output and the shard per call
(as the fallback must); ``*_dist`` go through ``torch.distributed``'s wrapper, ``*_now`` through
``fo_kernels.runtime.reduce_scatter_now``; ``fresh_out_only`` / ``fresh_full_only`` allocate one of
the two; ``ar_fresh_now`` is the AllReduce fallback's body; ``fo`` is ``gemm_reduce_scatter`` with
the table's row. Prints one line per rank.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fo_kernels import gemm_reduce_scatter
from fo_kernels.runtime import all_reduce_now, reduce_scatter_now, reduce_scatter_tensor
from fo_tune.harness import open_pool
from fo_tune.launch import RankContext
from fo_tune.measure import gemm_operands

CALLS, WARM, ROUNDS = 200, 10, 3


class FallbackLoops:
    def __init__(self, m: int, n: int, k: int) -> None:
        self.m, self.n, self.k = m, n, k

    def run(self, ctx: RankContext) -> dict[str, float]:
        m, n, w, dev = self.m, self.n, ctx.world_size, ctx.device
        a, b = gemm_operands(m, n, self.k, "bfloat16", dev, seed=3 + ctx.rank)
        full_p = torch.empty(m, n, device=dev, dtype=a.dtype)
        out_p = torch.empty(m // w, n, device=dev, dtype=a.dtype)

        def shard() -> torch.Tensor:
            return torch.empty(m // w, n, device=dev, dtype=a.dtype)

        def pre(rs: Callable) -> Callable[[], None]:
            return lambda: (torch.mm(a, b, out=full_p), rs(out_p, full_p))

        def fresh(rs: Callable) -> Callable[[], None]:
            return lambda: rs(shard(), a @ b)

        fns: dict[str, Callable[[], object]] = {
            "pre_dist": pre(reduce_scatter_tensor),
            "pre_now": pre(reduce_scatter_now),
            "fresh_dist": fresh(reduce_scatter_tensor),
            "fresh_now": fresh(reduce_scatter_now),
            "fresh_out_only": lambda: (torch.mm(a, b, out=full_p), reduce_scatter_now(shard(), full_p)),
            "fresh_full_only": lambda: reduce_scatter_now(out_p, a @ b),
            "ar_fresh_now": lambda: all_reduce_now(a @ b),
            "fo": lambda: gemm_reduce_scatter(a, b),
        }
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(ROUNDS):
            for name, fn in fns.items():
                for _ in range(WARM):
                    fn()
                torch.cuda.synchronize(dev)
                dist.barrier()
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    fn()
                torch.cuda.synchronize(dev)
                samples[name].append((time.perf_counter() - t0) / CALLS * 1e6)
        return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1024x4096x4096")
    args = ap.parse_args()
    m, n, k = (int(x) for x in args.shape.split("x"))
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        for rank, loops in enumerate(pool.run(FallbackLoops(m, n, k), timeout_s=200)):
            print(f"r{rank} us per call: " + " ".join(f"{name} {us:.0f}" for name, us in loops.items()))


if __name__ == "__main__":
    main()
