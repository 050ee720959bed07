"""``fo-tune bench`` as a library call: every way to run GEMM + collective, checked, then timed.

Owns the benchmark's rank task, the driver that merges ranks into ``BenchRow``s, the suite file
reader and the bench folder (bench.csv, bench.yaml, bench.png). The CLI is ``fo_tune.cli.bench``.

    run_bench(BenchRequest(shapes=((4096, 8192, 4096),)), reporter)
      one worker pool (fo_tune.harness); rank 0's fingerprint; then per shape x collective, one
      BenchCaseTask on every rank:
        a, b  = gemm_operands(M, N, K, seed per rank)       # random, never zero
        ref   = collective(a.float() @ b.float())           # float32, the default group
        for each variant: out = fn(); pass iff no NaN and rel_err(out, ref) < GEMM_TOL[dtype] on
        every rank (they agree before anything is timed); a failed variant is not timed
          gemm        a @ b (checked against a.float() @ b.float(), no collective)
          collective  the collective alone on the full (M, N) buffer, default group
          sequential  GEMM, then the collective
          chunked_cC  M split into C row chunks: GEMM chunk j on the caller's stream, an event,
                      the collective of chunk j on the high-priority stream after it; for
                      ReduceScatter chunk j holds rows j*S/C..(j+1)*S/C of every shard (S = M/w),
                      GEMMed by one strided batched GEMM, so rank r still gets rows [r*S, (r+1)*S)
          async_tp    torch.ops.symm_mem.fused_matmul_reduce_scatter (ReduceScatter, CUDA only;
                      UNAVAILABLE with the reason where it cannot run)
          fo_tune     fo_kernels.gemm_all_reduce / gemm_reduce_scatter, schedule=None
                      (these two allocate their output per call, so they are checked on a second
                      operand set: a freed buffer holding an earlier variant's answer cannot pass)
        time = fo_tune.harness.time_interleaved over every variant that passed (alternating rounds,
               each sample >= harness.comparison_sample_ms of back-to-back calls, the ranks agree on call
               counts), max over ranks
        fo_tune is checked once more after timing, its previous output poisoned with NaN first: the
        runtime replays repeated calls from CUDA graphs of its own, which the first check precedes
      derived per case: chunked (the best C), ideal = max(gemm, collective) (not run),
      speedup_vs_sequential = sequential / variant, fraction_of_ideal = ideal / variant

On the CPU (gloo, Triton's interpreter) there is no second stream: the chunks run one after the
other (said in the detail column) and the numbers describe the CPU, not overlap.
"""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from fo_kernels.errors import EnvironmentMismatchError, FoTuneError, HeuristicScheduleWarning, ShapeError
from fo_kernels.files import read_yaml
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.runtime import reduce_scatter_tensor, runtime_for

from .calibrate import Reporter
from .harness import (
    MIN_SAMPLE_MS,
    TASK_TIMEOUT_S,
    Timing,
    comparison_sample_ms,
    open_pool,
    time_interleaved,
)
from .launch import RankContext
from .measure import DTYPES, GEMM_TOL, FingerprintTask, gemm_operands, rel_err, worst_error
from .report import check_writable, figure, replacing_folder, write_rows

__all__ = [
    "BENCH_COLUMNS",
    "BENCH_FILES",
    "COLLECTIVES",
    "STATUSES",
    "VARIANTS",
    "BenchCaseTask",
    "BenchRequest",
    "BenchResult",
    "BenchRow",
    "Suite",
    "SuiteError",
    "SuiteNotFoundError",
    "case_rows",
    "check_bench_out",
    "default_bench_dir",
    "load_suite",
    "packaged_suite",
    "run_bench",
    "write_bench_dir",
]

BENCH_SCHEMA_VERSION = 1
BENCH_KIND = "fo-tune-bench"
COLLECTIVES = ("all_reduce", "reduce_scatter")
# The variants of every case, in row order; chunked_c<C> rows follow "chunked".
VARIANTS = ("gemm", "collective", "sequential", "chunked", "async_tp", "fo_tune", "ideal")
# Rows derived from others, not run themselves: the best chunk count, and max(gemm, collective).
DERIVED = ("chunked", "ideal")
# Row statuses: checked and timed, wrong (never timed), not applicable, cannot run here.
STATUSES = ("PASS", "FAIL", "SKIP", "UNAVAILABLE")
# Row chunks of the hand-chunked baseline: DESIGN.md's H200 prototype split M into 2, 4 and 8.
CHUNK_COUNTS = (2, 4, 8)
# Untimed calls before each timing (fo_tune.harness.time_region's default); the interpreter is slow,
# so one on the CPU. The checked call comes before these.
WARMUP, CPU_WARMUP = 3, 1
# Timed samples per variant (each sample spans >= comparison_sample_ms on GPUs). 30 on GPUs: with
# 10, the host-heavy variants of one H200 x2 bench had 0.1-0.6 ms outliers that moved their medians
# by up to 60% (docs/perf-notes.md, run 22); 30 reproduced within a few % in two processes (run 24).
# The five-shape suite then takes ~55 s for both collectives with 16 ms samples (run 61).
GPU_REPS, CPU_REPS = 30, 3
# bf16 tl.dot is wrong in Triton's CPU interpreter (DESIGN.md), so the CPU default is float32.
GPU_DTYPE, CPU_DTYPE = "bfloat16", "float32"
# The default shape on the CPU: small enough for the interpreter (~40 ms per fo_tune call on 2 ranks).
CPU_SHAPES = ((64, 96, 64),)
# Seed offset of the second operand set (any number keeping it apart from the first set's seeds).
FRESH_SEED = 7919
BENCH_ROOT = Path("results/bench")
BENCH_FILES = ("bench.csv", "bench.yaml", "bench.png")
# Variants drawn in bench.png (speedup over sequential; gemm and collective alone are not overlap).
PLOTTED = ("sequential", "chunked", "async_tp", "fo_tune", "ideal")
PLOT_COLORS = dict(sequential="tab:gray", chunked="tab:orange", async_tp="tab:green", fo_tune="tab:blue",
                   ideal="tab:purple")  # fmt: skip

Shape = tuple[int, int, int]


class SuiteError(FoTuneError, ValueError):
    """A suite file that is malformed; the message names the file and the key."""


class SuiteNotFoundError(SuiteError, FileNotFoundError):
    """A suite file that does not exist."""


# ----------------------------------------------------------------------------------------- suites
@dataclass(frozen=True, kw_only=True, slots=True)
class Suite:
    """A benchmark suite file (``suites/*.yaml``): name, dtype, shapes, and odd shapes beside them."""

    name: str
    dtype: str | None
    shapes: tuple[Shape, ...]
    odd_shapes: tuple[Shape, ...] = ()


def packaged_suite() -> Path:
    """The repository's benchmark suite (``suites/h200_tp.yaml``, DESIGN.md's five shapes)."""
    return Path(__file__).resolve().parents[1] / "suites" / "h200_tp.yaml"


def _suite_shapes(data: dict, key: str, source: str) -> tuple[Shape, ...]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise SuiteError(f"{source}: {key}: expected a list of [M, N, K], got {value!r}")
    shapes = []
    for i, item in enumerate(value):
        ok = isinstance(item, list) and len(item) == 3
        if not ok or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in item):
            raise SuiteError(f"{source}: {key}[{i}]: expected [M, N, K] with integers >= 1, got {item!r}")
        shapes.append((item[0], item[1], item[2]))
    return tuple(shapes)


def load_suite(path: str | Path) -> Suite:
    """Read and validate a suite file; errors name the file and the key."""
    source = str(path)
    data = read_yaml(
        path,
        error=SuiteError,
        missing=SuiteNotFoundError,
        missing_hint=f"no suite file here; the shipped one is {packaged_suite()}",
    )
    if not isinstance(data, dict):
        raise SuiteError(f"{source}: expected a mapping with name, dtype and shapes")
    unknown = sorted(set(data) - {"name", "dtype", "shapes", "odd_shapes"})
    if unknown:
        raise SuiteError(f"{source}: unknown key {unknown[0]!r}; known: name, dtype, shapes, odd_shapes")
    dtype = data.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise SuiteError(f"{source}: dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    shapes = _suite_shapes(data, "shapes", source)
    if not shapes:
        raise SuiteError(f"{source}: shapes: no shapes given")
    name = data.get("name", Path(path).stem)
    return Suite(
        name=str(name), dtype=dtype, shapes=shapes, odd_shapes=_suite_shapes(data, "odd_shapes", source)
    )


# ---------------------------------------------------------------------------------------- request
@dataclass(frozen=True, kw_only=True, slots=True)
class BenchRequest:
    """What to benchmark; None fields default per device (see the module constants)."""

    shapes: tuple[Shape, ...]
    collectives: tuple[str, ...] = COLLECTIVES
    world_size: int = 2
    dtype: str | None = None
    backend: str | None = None
    reps: int | None = None
    timeout_s: float = TASK_TIMEOUT_S
    chunks: tuple[int, ...] = CHUNK_COUNTS
    suite: str = ""  # the suite's name when the shapes came from one
    seed: int = 0
    sample_ms: float | None = None  # None: fo_tune.harness.comparison_sample_ms (16 ms on GPUs)

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ShapeError("no shapes to benchmark")
        for shape in self.shapes:
            if len(shape) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in shape):
                raise ShapeError(f"shape {shape!r}: expected (M, N, K), integers >= 1")
        unknown = [c for c in self.collectives if c not in COLLECTIVES]
        if unknown or not self.collectives:
            raise ShapeError(f"collectives {list(self.collectives)}: choose from {', '.join(COLLECTIVES)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ShapeError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        for name in ("world_size", "reps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ShapeError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.timeout_s > 0:
            raise ShapeError(f"timeout must be > 0 seconds, got {self.timeout_s!r}")
        ms = self.sample_ms
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, int | float) or not ms > 0):
            raise ShapeError(f"sample length must be > 0 ms, got {self.sample_ms!r}")
        if not self.chunks or any(c < 2 for c in self.chunks):
            raise ShapeError(f"chunks must be integers >= 2, got {list(self.chunks)}")


# ------------------------------------------------------------------------------------ rank task
def _entry(variant: str, status: str, detail: str = "", err: float = math.nan, **extra: Any) -> dict:
    return dict(variant=variant, status=status, detail=detail, rel_err=err, timing=None, source="", **extra)


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}".rstrip(": ")


def _splits(total: int, parts: int) -> list[int]:
    """``parts + 1`` row boundaries splitting ``total`` rows as evenly as integers allow."""
    return [i * total // parts for i in range(parts + 1)]


def _worst(code: int, device: torch.device) -> int:
    """The largest code of any rank (0 pass, 1 fail, 2 unavailable): every rank decides alike."""
    t = torch.tensor([code], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


@dataclass(frozen=True)
class BenchCaseTask:
    """Every variant of one (shape, collective) on this rank: check, agree, then time."""

    collective: str
    m: int
    n: int
    k: int
    dtype: str
    chunks: tuple[int, ...] = CHUNK_COUNTS
    warmup: int = WARMUP
    reps: int = GPU_REPS
    seed: int = 0
    # how samples are taken (fo_tune.harness.time_interleaved): ranks aligned, a lead, their length
    align: bool = False
    lead_ms: float = 0.0
    min_sample_ms: float = MIN_SAMPLE_MS

    def run(self, ctx: RankContext) -> list[dict[str, Any]]:
        m, n, k, w = self.m, self.n, self.k, ctx.world_size
        seed = (((self.seed * 1009 + m) * 1009 + n) * 1009 + k) * 1009 + ctx.rank
        a, b = gemm_operands(m, n, k, self.dtype, ctx.device, seed=seed % (1 << 62))
        local = a.float() @ b.float()
        ref = self._collective(local.clone(), None)
        rs = self.collective == "reduce_scatter"
        out = [
            self._measure(ctx, "gemm", "", lambda: lambda: a @ b, local),
            self._measure(ctx, "collective", "", lambda: self._collective_alone(local), ref),
            self._measure(ctx, "sequential", "", lambda: self._sequential(a, b), ref),
        ]
        rows = m // w if rs else m
        for c in self.chunks:
            name = f"chunked_c{c}"
            if rows < c:
                what = f"M/world = {rows} rows per shard" if rs else f"M = {rows} rows"
                out.append(_entry(name, "SKIP", f"chunks={c}: {what}, fewer than {c}"))
                continue
            detail = f"chunks={c}"
            if ctx.device.type != "cuda":
                detail += ", CPU: no second stream, the chunks run one after the other"
            out.append(self._measure(ctx, name, detail, lambda c=c: self._chunked(ctx, a, b, c), ref))
        # The next two allocate their output each call, and the caching allocator may hand back a
        # freed buffer of an earlier variant that holds the right answer for (a, b): they are
        # checked (and timed) on a second operand set, so a stale result cannot pass.
        a2, b2 = gemm_operands(m, n, k, self.dtype, ctx.device, seed=(seed + FRESH_SEED) % (1 << 62))
        ref2 = self._collective(a2.float() @ b2.float(), None)
        if rs:
            out.append(self._async_tp(ctx, a2, b2, ref2))
        else:
            out.append(_entry("async_tp", "SKIP", "torch async-TP fuses matmul + reduce_scatter only"))
        out.append(self._fo_tune(ctx, a2, b2, ref2))
        # every variant that passed its check is timed now, side by side in alternating rounds
        # (time_interleaved): a clock drift during the case cannot favour the variant timed first
        calls = {i: e.pop("fn") for i, e in enumerate(out) if "fn" in e}
        before = _own_graph_calls(ctx.device)
        with warnings.catch_warnings():  # fo_tune's schedule source is recorded in its row instead
            warnings.simplefilter("ignore", HeuristicScheduleWarning)
            timings = time_interleaved(
                calls,
                ctx.device,
                warmup=self.warmup,
                rounds=self.reps,
                agree=True,
                align=self.align,
                lead_ms=self.lead_ms,
                min_sample_ms=self.min_sample_ms,
            )
        for i, timing in timings.items():
            out[i]["timing"] = timing
        fo = len(out) - 1  # fo_tune: checked again, now that its calls replay from the runtime's graphs
        if fo in calls:
            why = self._recheck(ctx, calls[fo], ref2)
            if why:
                out[fo].update(status="FAIL", detail=f"{out[fo]['detail']}: {why}", timing=None)
        after = _own_graph_calls(ctx.device)
        if after[0] > before[0]:  # fo_tune ran through the runtime's graphs (no other variant does)
            out[-1]["replayed"] = (after[1] - before[1], after[0] - before[0])
        return out

    # ------------------------------------------------------------------ check, agree, time
    def _measure(
        self,
        ctx: RankContext,
        variant: str,
        detail: str,
        build: Callable[[], Callable[[], torch.Tensor]],
        ref: torch.Tensor,
        *,
        raise_code: int = 1,
    ) -> dict[str, Any]:
        """``build()`` returns the call; its first result is checked and every rank agrees; a passing
        entry carries the call (``fn``) for ``run`` to time beside the others.

        An exception counts as ``raise_code`` (1: FAIL, 2: UNAVAILABLE); the worst code of any rank wins.
        """
        fn: Callable[[], torch.Tensor] | None = None
        err, why, code = math.nan, "", 0
        try:
            fn = build()
            err, why = self._verdict(fn(), ref)
            code = 1 if why else 0
        except Exception as exc:  # a variant that cannot run is reported, never timed
            code, why = raise_code, _reason(exc)
        worst = _worst(code, ctx.device)
        if worst:
            why = why or "failed on another rank"
            status = "UNAVAILABLE" if worst == 2 else "FAIL"
            return _entry(variant, status, f"{detail}: {why}" if detail else why, err)
        assert fn is not None
        return {**_entry(variant, "PASS", detail, err), "fn": fn}  # timed with the others in run()

    def _verdict(self, got: torch.Tensor, ref: torch.Tensor) -> tuple[float, str]:
        """(relative error, '' or why ``got`` fails: a NaN, or an error at or above the dtype's
        tolerance)."""
        tol = GEMM_TOL[self.dtype]
        err = rel_err(got, ref)
        if bool(torch.isnan(got).any()):
            return err, "NaN in the output"
        if not err < tol:
            return err, f"relative error {err:.2e} >= {tol:g}"
        return err, ""

    def _recheck(self, ctx: RankContext, fn: Callable[[], torch.Tensor], ref: torch.Tensor) -> str:
        """'' if ``fn``'s result is right with its previous output poisoned, else why not (every
        rank agrees). A call dropping its output gets the same block back (the runtime's outputs
        have a pool of their own), so a replay that wrote nothing reads NaN instead of the answer
        of the call before."""
        why = ""
        try:
            got = fn()
            got.fill_(math.nan)
            del got
            _, why = self._verdict(fn(), ref)
            why = f"{why} after timing" if why else ""
        except Exception as exc:
            why = f"after timing: {_reason(exc)}"
        if _worst(1 if why else 0, ctx.device):
            return why or "failed after timing on another rank"
        return ""

    # ------------------------------------------------------------------------- the variants
    def _collective(self, full: torch.Tensor, group: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """The collective of the (M, N) buffer ``full``: in place (all_reduce) or into ``out``."""
        if self.collective == "all_reduce":
            dist.all_reduce(full, group=group)
            return full
        if out is None:
            rows = full.shape[0] // dist.get_world_size()
            out = torch.empty((rows, full.shape[1]), dtype=full.dtype, device=full.device)
        reduce_scatter_tensor(out, full, group=group)
        return out

    def _collective_alone(self, local: torch.Tensor) -> Callable[[], torch.Tensor]:
        full = local.to(DTYPES[self.dtype])  # the reference GEMM result, so the check means something
        out = torch.empty((self.m // dist.get_world_size(), self.n), dtype=full.dtype, device=full.device)
        return lambda: self._collective(full, None, out)

    def _sequential(self, a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor]:
        full = torch.empty((self.m, self.n), dtype=a.dtype, device=a.device)
        out = torch.empty((self.m // dist.get_world_size(), self.n), dtype=a.dtype, device=a.device)

        def run() -> torch.Tensor:
            torch.mm(a, b, out=full)
            return self._collective(full, None, out)

        return run

    def _chunked(
        self, ctx: RankContext, a: torch.Tensor, b: torch.Tensor, c: int
    ) -> Callable[[], torch.Tensor]:
        """GEMM chunk j on the caller's stream, an event, its collective on the high-priority stream.

        The collectives use the runtime's high-priority NCCL group with NCCL's default CTA count
        (``OverlapRuntime.comm_group(0)``, as the overlapped ops do); gloo's default group on the CPU.
        """
        rt = runtime_for(ctx.device, None)
        side = rt.comm_stream
        gemms, comms, result = self._chunk_calls(a, b, c, rt.comm_group(0), ctx.world_size)
        if side is None:  # the CPU: one after the other

            def serial() -> torch.Tensor:
                for gemm, comm in zip(gemms, comms, strict=True):
                    gemm()
                    comm()
                return result

            return serial
        events = [torch.cuda.Event() for _ in range(c)]

        def overlapped() -> torch.Tensor:
            main = torch.cuda.current_stream(ctx.device)
            side.wait_stream(main)  # the buffers are free: the previous call's readers are done
            for gemm, comm, event in zip(gemms, comms, events, strict=True):
                gemm()
                event.record(main)
                with torch.cuda.stream(side):
                    side.wait_event(event)
                    comm()
            main.wait_stream(side)
            return result

        return overlapped

    def _chunk_calls(
        self, a: torch.Tensor, b: torch.Tensor, c: int, group: Any, w: int
    ) -> tuple[list[Callable[[], Any]], list[Callable[[], Any]], torch.Tensor]:
        """Per chunk: its GEMM and its collective (on views made once), and the output."""
        n = self.n
        if self.collective == "all_reduce":  # chunk j = rows bounds[j]..bounds[j+1] of the output
            bounds = _splits(self.m, c)
            full = torch.empty((self.m, n), dtype=a.dtype, device=a.device)
            parts = [(a[r0:r1], full[r0:r1]) for r0, r1 in itertools.pairwise(bounds)]
            gemms = [functools.partial(torch.mm, ai, b, out=oi) for ai, oi in parts]
            comms = [functools.partial(dist.all_reduce, oi, group=group) for _, oi in parts]
            return gemms, comms, full
        # chunk j = rows bounds[j]..bounds[j+1] of every shard, laid out shard after shard: one
        # strided batched GEMM writes it, and its reduce_scatter gives rank r those rows of shard r
        shard = self.m // w
        bounds = _splits(shard, c)
        a3, b3 = a.view(w, shard, self.k), b.expand(w, self.k, n)  # b3: batch stride 0, no copy
        result = torch.empty((shard, n), dtype=a.dtype, device=a.device)
        gemms, comms = [], []
        for s0, s1 in itertools.pairwise(bounds):
            buf = torch.empty((w, s1 - s0, n), dtype=a.dtype, device=a.device)
            gemms.append(functools.partial(torch.bmm, a3[:, s0:s1], b3, out=buf))
            comms.append(
                functools.partial(reduce_scatter_tensor, result[s0:s1], buf.view(-1, n), group=group)
            )
        return gemms, comms, result

    def _async_tp(self, ctx: RankContext, a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> dict:
        """PyTorch async-TP: ``fused_matmul_reduce_scatter(a, b, "sum", scatter_dim=0, group_name)``."""

        def build() -> Callable[[], torch.Tensor]:
            if ctx.device.type != "cuda" or ctx.backend != "nccl":
                raise EnvironmentMismatchError(
                    f"needs CUDA GPUs and NCCL, this run uses {ctx.backend} on the CPU"
                )
            from torch.distributed import _symmetric_memory as symm_mem

            op = torch.ops.symm_mem.fused_matmul_reduce_scatter
            name = dist.group.WORLD.group_name
            with warnings.catch_warnings():  # deprecated (a no-op) from torch 2.11, needed before
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(name)
            return lambda: op(a, b, "sum", 0, name)  # reduce_op, scatter_dim, group_name

        return self._measure(ctx, "async_tp", "fused_matmul_reduce_scatter", build, ref, raise_code=2)

    def _fo_tune(self, ctx: RankContext, a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> dict:
        """The runtime's op with ``schedule=None``: the table row for this shape, else the heuristic."""
        from fo_kernels import gemm_all_reduce, gemm_reduce_scatter, lookup_schedule
        from fo_kernels.table import MISS_SOURCE

        op = gemm_all_reduce if self.collective == "all_reduce" else gemm_reduce_scatter
        w = ctx.world_size
        with warnings.catch_warnings():  # the source is recorded instead
            warnings.simplefilter("ignore", HeuristicScheduleWarning)
            try:
                schedule = lookup_schedule(
                    self.collective, self.m, self.n, self.k, dtype=self.dtype, world_size=w, device=ctx.device
                )
                missed = schedule.provenance.get("source") in ("heuristic", MISS_SOURCE)
                source = "heuristic" if missed else "table"
                detail = schedule.describe()
            except FoTuneError as exc:  # e.g. a table for other hardware: the same on every rank
                source, detail = "", _reason(exc)
            entry = self._measure(ctx, "fo_tune", detail, lambda: lambda: op(a, b, schedule=None), ref)
        return {**entry, "source": source}


# --------------------------------------------------------------------------------------- results
@dataclass(frozen=True, kw_only=True, slots=True)
class BenchRow:
    """One variant of one (shape, collective), merged over ranks (times: the slowest rank's median)."""

    device_key: str
    world_size: int
    dtype: str
    m: int
    n: int
    k: int
    collective: str
    variant: str
    detail: str
    status: str  # PASS, FAIL, SKIP or UNAVAILABLE
    rel_err: float  # the largest of any rank; NaN when not checked
    median_ms: float
    spread_ms: float
    speedup_vs_sequential: float  # sequential_ms / median_ms
    fraction_of_ideal: float  # ideal_ms / median_ms
    schedule_source: str  # fo_tune rows: "table" or "heuristic"

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


BENCH_COLUMNS = tuple(f.name for f in fields(BenchRow))


@dataclass(kw_only=True)
class BenchResult:
    """Everything one ``fo-tune bench`` run measured, with where and how."""

    fingerprint: Fingerprint
    backend: str
    settings: dict[str, Any]
    rows: list[BenchRow] = field(default_factory=list)
    created: str = ""
    wall_s: float = 0.0

    @property
    def checked(self) -> list[BenchRow]:
        """Rows of variants that ran and were checked (PASS or FAIL), derived rows left out."""
        return [r for r in self.rows if r.variant not in DERIVED and r.status in ("PASS", "FAIL")]

    @property
    def failed(self) -> list[BenchRow]:
        return [r for r in self.checked if r.status == "FAIL"]

    def to_dict(self) -> dict[str, Any]:
        return dict(
            schema_version=BENCH_SCHEMA_VERSION,
            kind=BENCH_KIND,
            created=self.created,
            wall_s=round(self.wall_s, 3),
            backend=self.backend,
            settings=self.settings,
            fingerprint=self.fingerprint.to_dict(),
            rows=[asdict(r) for r in self.rows],
        )


def _own_graph_calls(device: torch.device) -> tuple[int, int]:
    """(calls, replayed calls) so far of this rank's copy engine and ``overlap: false`` fallback, the
    runtime's two users of CUDA graphs of its own; (0, 0) before either is made. A bench row run
    eagerly pays a call's host time (~0.3 ms at 2048x4096x4096 on the copy engine, run 25 in
    docs/perf-notes.md), so the fo_tune row says how many of its timed calls were replayed."""
    if device.type != "cuda":
        return 0, 0
    runtime = runtime_for(device, None)
    engine, fallback = runtime.made_copy_engine(), runtime.made_fallback()
    calls, replays = engine.call_counts() if engine is not None else (0, 0)
    if fallback is not None and fallback.graphs is not None:
        calls, replays = calls + fallback.graphs.calls, replays + fallback.graphs.replays
    return calls, replays


def _merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's entries of every rank: the worst status, the largest error, the slowest time."""
    statuses = {e["status"] for e in per_rank}
    status = next(s for s in ("FAIL", "UNAVAILABLE", "SKIP", "PASS") if s in statuses)
    errs = [e["rel_err"] for e in per_rank]
    err = worst_error(errs)
    timings = [e["timing"] for e in per_rank]
    t = Timing.max_over(timings) if status == "PASS" and all(timings) else None
    first = next((e for e in per_rank if e["status"] == status), per_rank[0])
    detail = first["detail"]
    replayed = [e["replayed"] for e in per_rank if "replayed" in e]
    if replayed:  # the rank that replayed the fewest of its timed calls from the runtime's graphs
        done, runs = min(replayed, key=lambda x: x[0] / x[1])
        detail += f"; {done} of {runs} timed calls replayed from fo-tune's own CUDA graphs"
    return dict(
        variant=first["variant"],
        status=status,
        detail=detail,
        rel_err=err,
        median_ms=t.median_ms if t else math.nan,
        spread_ms=t.spread_ms if t else math.nan,
        schedule_source=first["source"],
    )


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 and not math.isnan(num) else math.nan


def _derived(variant: str, status: str, detail: str, median_ms: float = math.nan) -> dict[str, Any]:
    """A row that was not measured itself (the best chunk count, the ideal)."""
    return dict(variant=variant, status=status, detail=detail, rel_err=math.nan, median_ms=median_ms,
                spread_ms=math.nan, schedule_source="")  # fmt: skip


def case_rows(head: dict[str, Any], merged: Sequence[dict[str, Any]]) -> list[BenchRow]:
    """A case's rows in ``VARIANTS`` order: the best chunk count as ``chunked``, ideal, the ratios."""
    nan = math.nan
    by = {e["variant"]: e for e in merged}
    chunks = [e for e in merged if e["variant"].startswith("chunked_c")]
    ran = [e for e in chunks if e["status"] == "PASS"]
    if ran:
        best = min(ran, key=lambda e: e["median_ms"])
        tried = ",".join(e["variant"].removeprefix("chunked_c") for e in ran)
        by["chunked"] = {**best, "variant": "chunked", "detail": f"{best['detail']} (best of {tried})"}
    else:
        bad = next((e for e in chunks if e["status"] == "FAIL"), chunks[0] if chunks else None)
        status, why = (bad["status"], bad["detail"]) if bad else ("SKIP", "no chunk count given")
        by["chunked"] = _derived("chunked", status, why)
    gemm, comm = by["gemm"], by["collective"]
    if gemm["status"] == comm["status"] == "PASS":
        ideal_ms = max(gemm["median_ms"], comm["median_ms"])
        by["ideal"] = _derived("ideal", "PASS", "max(gemm, collective), not run", ideal_ms)
    else:
        ideal_ms = nan
        by["ideal"] = _derived("ideal", "SKIP", "needs gemm and collective to pass")
    seq = by["sequential"]["median_ms"] if by["sequential"]["status"] == "PASS" else nan
    order = [v for v in (*VARIANTS[:4], *(e["variant"] for e in chunks), *VARIANTS[4:]) if v in by]
    rows = []
    for name in order:
        e = by[name]
        ms = e["median_ms"] if e["status"] == "PASS" else nan
        ratios = dict(speedup_vs_sequential=_ratio(seq, ms), fraction_of_ideal=_ratio(ideal_ms, ms))
        rows.append(BenchRow(**head, **{**e, "median_ms": ms}, **ratios))
    return rows


def _skipped(head: dict[str, Any], chunks: Sequence[int], why: str) -> list[BenchRow]:
    names = [*VARIANTS[:4], *(f"chunked_c{c}" for c in chunks), *VARIANTS[4:]]
    nan = math.nan
    return [
        BenchRow(**head, **_derived(v, "SKIP", why), speedup_vs_sequential=nan, fraction_of_ideal=nan)
        for v in names
    ]


class _Silent:
    def stage(self, name: str, total: int) -> None:
        pass

    def step(self, name: str, detail: str = "") -> None:
        pass


def run_bench(request: BenchRequest, reporter: Reporter | None = None) -> BenchResult | None:
    """Benchmark every (shape, collective) of ``request`` in one worker pool (module docstring).

    Returns None on a torchrun rank other than 0 (it served rank 0's tasks). Raises
    ``EnvironmentMismatchError`` when the ranks see different hardware, ``LaunchError`` when a rank
    fails, dies or hangs (``request.timeout_s`` per case).
    """
    rep = reporter or _Silent()
    t0 = time.monotonic()
    with open_pool(request.world_size, backend=request.backend) as pool:
        if not pool.is_driver:
            return None
        fps = pool.run(FingerprintTask())
        fp = fps[0]
        if any(f.device_key != fp.device_key for f in fps):
            keys = sorted({f.device_key for f in fps})
            raise EnvironmentMismatchError(f"ranks see different hardware ({keys}); bench on identical GPUs")
        cpu = pool.backend != "nccl"
        dtype = request.dtype or (CPU_DTYPE if cpu else GPU_DTYPE)
        reps = request.reps or (CPU_REPS if cpu else GPU_REPS)
        sample_ms = request.sample_ms or comparison_sample_ms(not cpu)
        warmup = CPU_WARMUP if cpu else WARMUP
        cases = [(s, c) for s in request.shapes for c in request.collectives]
        result = BenchResult(
            fingerprint=fp,
            backend=pool.backend,
            created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            settings=dict(
                shapes=[list(s) for s in request.shapes],
                collectives=list(request.collectives),
                world_size=request.world_size,
                dtype=dtype,
                backend=pool.backend,
                reps=reps,
                sample_ms=sample_ms,
                warmup=warmup,
                chunks=list(request.chunks),
                suite=request.suite,
                timeout_s=request.timeout_s,
                seed=request.seed,
            ),
        )
        rep.stage("bench", len(cases))
        for (m, n, k), collective in cases:
            head = dict(
                device_key=fp.device_key,
                world_size=pool.world_size,
                dtype=dtype,
                m=m,
                n=n,
                k=k,
                collective=collective,
            )
            if collective == "reduce_scatter" and m % pool.world_size:
                why = f"M={m} is not divisible by the world size {pool.world_size}"
                result.rows += _skipped(head, request.chunks, why)
            else:
                task = BenchCaseTask(
                    collective, m, n, k, dtype, request.chunks, warmup, reps, request.seed,
                    min_sample_ms=sample_ms,
                )  # fmt: skip
                per_rank = pool.run(task, timeout_s=request.timeout_s)
                merged = [_merge([r[i] for r in per_rank]) for i in range(len(per_rank[0]))]
                result.rows += case_rows(head, merged)
            rep.step("bench", f"{collective} {m}x{n}x{k}")
    result.wall_s = time.monotonic() - t0
    return result


# ----------------------------------------------------------------------------------------- files
def default_bench_dir(device_key: str, world_size: int) -> Path:
    """``results/bench/<device-key>/tp<N>`` (relative to the working directory)."""
    return BENCH_ROOT / device_key / f"tp{world_size}"


def check_bench_out(out_dir: str | Path) -> None:
    """Raise ``OutputError`` unless ``write_bench_dir`` can create or replace ``out_dir``: a new
    folder, or one holding only ``BENCH_FILES`` (``fo_tune.report.check_writable``'s rules)."""
    check_writable(out_dir, allowed=BENCH_FILES, what="bench", writer="fo-tune bench")


def _plot(result: BenchResult, path: Path) -> None:
    """Grouped bars of speedup over sequential, per shape and variant; one panel per collective."""
    collectives = list(dict.fromkeys(r.collective for r in result.rows)) or ["-"]
    fig, axes = figure(1, len(collectives), 6.0, 3.8)
    where = "NCCL" if result.backend == "nccl" else "gloo on the CPU (not overlap)"
    fig.suptitle(f"speedup over GEMM then collective: {result.fingerprint.device_key}, {where}")
    width = 0.8 / len(PLOTTED)
    for ax, collective in zip(axes[0], collectives, strict=True):
        rows = [r for r in result.rows if r.collective == collective]
        shapes = list(dict.fromkeys(r.shape for r in rows))
        for i, variant in enumerate(PLOTTED):
            values = {r.shape: r.speedup_vs_sequential for r in rows if r.variant == variant}
            bars = [
                (j + (i - (len(PLOTTED) - 1) / 2) * width, values[s])
                for j, s in enumerate(shapes)
                if not math.isnan(values.get(s, math.nan))
            ]
            if not bars:  # never ran here (async_tp beside all_reduce, or unavailable)
                continue
            drawn = ax.bar(*zip(*bars, strict=True), width, label=variant, color=PLOT_COLORS[variant],
                           hatch="//" if variant == "ideal" else None)  # fmt: skip
            ax.bar_label(drawn, fmt="%.2f", fontsize=6, rotation=90, padding=2)
        for j, s in enumerate(shapes):
            if all(r.status == "SKIP" for r in rows if r.shape == s):
                ax.text(j, 0.5, "skipped", ha="center", va="bottom", rotation=90, fontsize="small")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlim(-0.5, len(shapes) - 0.5)
        ax.set_xticks(range(len(shapes)), shapes, rotation=30, ha="right", fontsize="small")
        ax.set_title(collective)
        ax.set_ylabel("sequential ms / variant ms")
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.15)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)


def write_bench_dir(result: BenchResult, out_dir: str | Path) -> list[Path]:
    """Write ``BENCH_FILES`` into ``out_dir``, replacing it as a whole (``write_calibration_dir``'s way:
    built in a temporary sibling, swapped in; on error nothing changes). Returns the paths written."""
    check_bench_out(out_dir)
    with replacing_folder(out_dir) as tmp:
        rows = [[getattr(r, c) for c in BENCH_COLUMNS] for r in result.rows]
        with (tmp / "bench.csv").open("w", newline="", encoding="utf-8") as f:
            write_rows(f, BENCH_COLUMNS, rows)
        with (tmp / "bench.yaml").open("w", encoding="utf-8") as f:
            yaml.safe_dump(result.to_dict(), f, sort_keys=False, width=120)
        _plot(result, tmp / "bench.png")
        for name in BENCH_FILES:
            os.chmod(tmp / name, 0o644)
    return [Path(out_dir) / name for name in BENCH_FILES]
