"""Pieces the two-GPU probes share (``bench/ce_*_probe.py``, ``bench/cublas_chunks_probe.py``,
``bench/host_probe.py``): the suite's shapes, the per-case probes' options, a case's operands and
float32 reference, the sequential baseline, a variant's error on poisoned outputs, the merge of the
ranks' checks and timings, CSV rows appended case by case, and the progress and summary lines."""

from __future__ import annotations

import argparse
import csv
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from fo_kernels.copy_engine import CopyEnginePeers
from fo_kernels.runtime import reduce_scatter_tensor
from fo_tune.bench import load_suite, packaged_suite
from fo_tune.harness import Timing
from fo_tune.launch import RankContext
from fo_tune.measure import _collective_fp32, gemm_operands, rel_err, worst_error

# The shipped suite's (M, N, K) (suites/h200_tp.yaml, DESIGN.md's five shapes).
SUITE_SHAPES = load_suite(packaged_suite()).shapes
# Seed of rank r's operands: OPERAND_SEED + r (every probe draws the same operands per shape).
OPERAND_SEED = 11
COLLECTIVES = ("all_reduce", "reduce_scatter")
# Output blocks of one shape the copy engine's output pool can hold free at a check: the variants'
# dropped outputs are reused, so two or three; poisoning more covers them all.
POISON_BLOCKS = 6
_ENGINES: dict[str, CopyEnginePeers] = {}  # shared_engine's one engine per rank process


def case_options(
    description: str, *, rounds: int | None = 15, shapes: str = "the suite"
) -> argparse.ArgumentParser:
    """The options of a probe that runs per (shape, collective): ``--out``, ``--shape``,
    ``--collective`` and (``rounds`` not None) ``--rounds``; ``cases`` reads them back."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", action="append", default=[], help=f"MxNxK (repeatable; default: {shapes})")
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--collective", action="append", default=[], help="default: both")
    return ap


def cases(
    args: argparse.Namespace, default_shapes: Sequence[tuple[int, int, int]] = SUITE_SHAPES
) -> tuple[list[tuple[int, int, int]], list[str]]:
    """(shapes, collectives) of ``case_options``' parsed ``args``, the output folder made."""
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shape] or list(default_shapes)
    args.out.mkdir(parents=True, exist_ok=True)
    return shapes, args.collective or list(COLLECTIVES)


def operands_and_reference(
    ctx: RankContext, m: int, n: int, k: int, collective: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, b, reference): this rank's random bf16 (M, K) and (K, N) operands and the float32
    ``collective(sum over ranks of a @ b)`` the probe's variants are checked against."""
    a, b = gemm_operands(m, n, k, "bfloat16", ctx.device, OPERAND_SEED + ctx.rank)
    ref = _collective_fp32(collective, (a.float() @ b.float()).contiguous(), ctx.world_size)
    return a, b, ref


def sequential_call(
    collective: str, a: torch.Tensor, b: torch.Tensor, world: int
) -> tuple[Callable[[], torch.Tensor], torch.Tensor, torch.Tensor]:
    """(call, full, shard): ``call`` runs cuBLAS into the preallocated (M, N) ``full``, then the
    collective (in place, or into the (M/world, N) ``shard``) and returns the result."""
    m, n = a.shape[0], b.shape[1]
    full = torch.empty((m, n), dtype=a.dtype, device=a.device)
    shard = torch.empty((m // world, n), dtype=a.dtype, device=a.device)

    def call() -> torch.Tensor:
        torch.mm(a, b, out=full)
        if collective == "all_reduce":
            dist.all_reduce(full)
            return full
        reduce_scatter_tensor(shard, full)
        return shard

    return call, full, shard


def graphed(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` captured in a CUDA graph after two eager calls (which make cuBLAS's workspaces of the
    streams it uses outside the graph): a call that replays it and returns the captured output."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def shared_engine(device: torch.device, nbytes: int) -> CopyEnginePeers:
    """The rank process's one ``CopyEnginePeers`` (symmetric buffers are made once per process),
    its buffers reserved for ``nbytes`` at first use, so no later case grows them (which would
    drop the engine's graphs between cases)."""
    if "engine" not in _ENGINES:
        _ENGINES["engine"] = CopyEnginePeers(device=device)
        _ENGINES["engine"]._reserve(nbytes)
    return _ENGINES["engine"]


def poisoned_error(
    call: Callable[[], torch.Tensor], ref: torch.Tensor, full: torch.Tensor, peers, rows: int
) -> float:
    """``call``'s error against ``ref`` with its possible outputs poisoned first: ``full`` (the
    preallocated output of the non-engine variants) and every free block of ``rows`` rows in the
    copy engine ``peers``' output pool, where the dropped outputs of every engine variant went (the
    next engine output is one of them). A variant that wrote nothing reads NaN."""
    call()  # (the engine's output pool exists from here on)
    full.fill_(float("nan"))
    if peers._outputs is not None and peers._outputs.pool is not None:
        with torch.cuda.use_mem_pool(peers._outputs.pool, device=full.device):
            blocks = [torch.empty_like(full[:rows]) for _ in range(POISON_BLOCKS)]
        for block in blocks:
            block.fill_(float("nan"))
        del blocks
    err = rel_err(call(), ref)
    torch.cuda.synchronize()
    return err


def merge_checked(per_rank: list[dict], tolerance: float) -> tuple[dict[str, Timing], dict, dict]:
    """(timings, errors, passed) per variant over the ranks' ``timings``, ``errs`` and ``after``:
    the slowest rank's timing, the worst error before or after timing, and whether that error is
    a number below ``tolerance`` (NaN never passes)."""
    names = list(per_rank[0]["timings"])
    merged = {x: Timing.max_over([r["timings"][x] for r in per_rank]) for x in names}
    errors = {x: worst_error([e for r in per_rank for e in (r["errs"][x], r["after"][x])]) for x in names}
    passed = {x: errors[x] < tolerance for x in names}
    return merged, errors, passed


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append ``rows`` to the CSV at ``path`` (header first when the file is new; nothing when
    there are no rows), so a probe killed by its timeout keeps the cases it finished."""
    if not rows:
        return
    new = not path.exists()
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)


class Progress:
    """A probe's output: a line per case as it goes (seconds since the start first), and the lines
    kept for the end, printed again under ``SUMMARY`` (the device tool returns the output's tail)."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.lines: list[str] = []

    def line(self, text: str, *, keep: bool = True) -> None:
        print(f"[{time.time() - self.t0:.0f}s] {text}", flush=True)
        if keep:
            self.lines.append(text)

    def keep(self, text: str) -> None:
        """Kept for the summary, not printed now."""
        self.lines.append(text)

    def summary(self) -> None:
        print("SUMMARY")
        print("\n".join(self.lines))
