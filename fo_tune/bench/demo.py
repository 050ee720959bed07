"""The demo: run both overlapped ops on N local ranks, check them against matmul + collective, time them.

``plan_demo`` decides where the ranks run and says why in one line (``DemoPlan.note``):

    --backend gloo            the CPU on purpose: gloo, Triton's interpreter, no GPU visible to the ranks
    no GPU visible            the CPU: gloo, Triton's interpreter
    one GPU per rank          NCCL, one GPU each
    fewer GPUs than ranks     without --world-size: one rank per GPU (one GPU: world size 1); with
                              it: an error naming --world-size and --backend gloo

``run_demo`` then spawns the ranks (``fo_tune.ranks.launch.run_ranks``; what they run is
``fo_tune.bench.demo_rank``'s). Each rank, for each shape and for each collective (ReduceScatter
and AllGather only when M % world_size == 0, else a skipped row):

    a, b  = random (M, K), (K, N) operands from a per-rank seed; AllGather takes this rank's
            (M/w, K) shard, the first M/w rows of a (M is the gathered M)
    out   = gemm_all_reduce(a, b) | gemm_reduce_scatter(a, b) | all_gather_gemm(a, b)
                                                    # schedule=None: the table row, else overlap: false
    ref   = collective(a.double() @ b.double())     # float64: dist.all_reduce / reduce_scatter_tensor
            | all_gather(a.double()) @ b.double()   # all_gather_into_tensor

With ``float8_e4m3fn`` the operands come with the tuner's rowwise scales (``scale_a`` of this
rank's rows, ``fo_tune.ranks.scaled.scale_kwargs``; ``b`` the transposed view of an (N, K) weight)
and the op's bfloat16 output is checked against the float64 reference of the dequantized operands,
``(a * scale_a) @ (b * scale_b)``, within the issue's 2e-2; the sequential baseline is the
library's scaled GEMM (``torch._scaled_mm``) then the collective (the gather of the fp8 rows and
their scales, then the GEMM). N and K must be multiples of 16.
    err   = ||out - ref|| / ||ref||,  pass iff no NaN and err < TOL[dtype]
    time  = median of `reps` calls after 2 warm-ups (the checked call is the first warm-up), for the
            overlapped op and for the sequential baseline (a @ b, then the collective; for
            AllGather the gather, then the GEMM)

and the parent merges the ranks: the largest error and time of any rank, NaN on any rank.

On the CPU the timings measure the Triton interpreter against torch's CPU matmul: they show that the
pipeline runs, not what overlap gains. ``run_copy_engine_demo`` runs the copy engine's protocol
instead, with no process group: on one GPU as virtual ranks (every rank in this process, its
operation lists issued through the CUDA driver as on N GPUs), without a GPU on thread-ranks of its
CPU executor.

``TRITON_INTERPRET`` is set for the ranks (1 for gloo, 0 for NCCL) before they start and restored
afterwards; gloo ranks also get ``CUDA_VISIBLE_DEVICES=""``,
so on a machine with GPUs they run exactly as on a CPU-only one (Triton's interpreter beside
visible GPUs is not a tested combination). Nothing heavy is imported at module import.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fo_tune.bench.demo_rank import Job, merge_ranks, rank_main
from fo_tune.output import Reporter, SilentReporter

# The ranks the demo starts without --world-size (TP=2, the setup the tables are tuned for).
DEFAULT_WORLD_SIZE = 2
# The relative error a row passes within; fp8: the bound for its bfloat16 output.
TOL = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 1e-2, "float8_e4m3fn": 2e-2}
FP8_NAME = "float8_e4m3fn"
CPU_SHAPES = [(258, 130, 70), (96, 64, 48)]  # small: the interpreter runs every tile in Python
# fp8's CPU shapes: N and K multiples of 16 (the fp8 ops' rule), M still odd.
FP8_CPU_SHAPES = [(258, 128, 80), (96, 64, 48)]
GPU_SHAPES = [(4096, 8192, 4096), (8192, 8192, 8192)]  # two of the benchmark suite (docs/design.md)
CPU_DTYPE, GPU_DTYPE = "float32", "bfloat16"  # bf16 tl.dot is wrong in the CPU interpreter (docs/design.md)


@dataclass(frozen=True, slots=True)
class DemoRow:
    """One (shape, collective) of the demo, merged over ranks; ``skipped`` rows carry ``reason``."""

    collective: str
    m: int
    n: int
    k: int
    dtype: str
    backend: str
    world_size: int
    schedule: str  # Schedule.describe(), or the skip reason
    schedule_source: str  # "table", "no table row" (overlap: false) or "" (skipped)
    rel_err: float  # max over ranks (nan when skipped)
    has_nan: bool
    passed: bool
    overlapped_ms: float  # median per rank, max over ranks
    sequential_ms: float
    speedup: float  # sequential_ms / overlapped_ms
    skipped: bool = False
    reason: str = ""

    @property
    def status(self) -> str:
        return "SKIP" if self.skipped else ("PASS" if self.passed else "FAIL")

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


@dataclass(frozen=True, slots=True)
class DemoPlan:
    """Where the demo runs: world size, backend, and the line that says which and why."""

    world_size: int
    backend: str  # "nccl" or "gloo"
    note: str


def plan_demo(world_size: int | None, backend: str | None, gpus: int) -> DemoPlan:
    """The demo's ranks for ``world_size`` (None: ``DEFAULT_WORLD_SIZE``, or fewer to fit the GPUs)
    and ``backend`` (None or "auto", "gloo", "nccl") on a machine with ``gpus`` GPUs (module
    docstring). Raises ``EnvironmentMismatchError`` when the asked ranks cannot run here."""
    from fo_kernels.errors import ArgumentError
    from fo_tune.output import count
    from fo_tune.ranks.backend import check_cpu_world_size, check_world_size, too_few_gpus

    asked = check_world_size(DEFAULT_WORLD_SIZE if world_size is None else world_size)
    if backend not in (None, "auto", "gloo", "nccl"):
        raise ArgumentError(f"--backend {backend!r} is not one of auto, gloo, nccl")
    cpu = f"{count(asked, 'rank')} on the CPU (gloo, Triton's interpreter"
    if backend == "gloo" or (gpus == 0 and backend != "nccl"):
        check_cpu_world_size(asked)
    if backend == "gloo":
        return DemoPlan(asked, "gloo", f"{cpu}, asked for with --backend gloo)")
    if gpus >= asked:
        return DemoPlan(asked, "nccl", f"{count(asked, 'rank')}, one GPU each (NCCL)")
    if gpus == 0 and backend != "nccl":
        return DemoPlan(asked, "gloo", f"{cpu}: no GPU visible)")
    if world_size is None and gpus > 0:
        return DemoPlan(
            gpus,
            "nccl",
            f"{count(gpus, 'GPU')} visible: {count(gpus, 'rank')}, one GPU each (NCCL), instead of {asked}; "
            f"--backend gloo runs {asked} ranks on the CPU",
        )
    raise too_few_gpus(asked, gpus, default_fits=True)


def default_shapes(on_gpu: bool, dtype: str | None = None, world_size: int = 1) -> list[tuple[int, int, int]]:
    """The demo's shapes when none are given: ``GPU_SHAPES`` on a GPU, else the CPU's small ones (fp8's for
    ``dtype`` float8_e4m3fn), each M rounded up to a multiple of ``world_size`` so that every
    collective runs at any world size (a shape the user gives is run as given)."""
    shapes = GPU_SHAPES if on_gpu else (FP8_CPU_SHAPES if dtype == FP8_NAME else CPU_SHAPES)
    step = max(world_size, 1)
    return [(-(-m // step) * step, n, k) for m, n, k in shapes]


def default_dtype(on_gpu: bool) -> str:
    """The demo's dtype when none is given, on a GPU or on the CPU."""
    return GPU_DTYPE if on_gpu else CPU_DTYPE


# ------------------------------------------------------------------------------------ checks
def _check_args(
    world_size: int, shapes: Sequence[tuple[int, int, int]], dtype: str, reps: int, timeout_s: float
) -> None:
    from fo_kernels.errors import ArgumentError, ShapeError
    from fo_tune.ranks.limits import check_fp8_shapes

    if dtype not in TOL:
        raise ShapeError(f"dtype {dtype!r} is not supported; use one of {', '.join(TOL)}")
    if not shapes:
        raise ShapeError("no shapes to run")
    for shape in shapes:
        if len(shape) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in shape):
            raise ShapeError(f"shape {shape!r}: expected (M, N, K), integers >= 1")
    check_fp8_shapes(shapes, dtype)
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ArgumentError(f"reps must be an integer >= 1, got {reps!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ArgumentError(f"timeout_s must be a number > 0, got {timeout_s!r}")


def demo_inputs(
    plan: DemoPlan,
    shapes: Sequence[tuple[int, int, int]] | None,
    dtype: str | None,
    reps: int,
    timeout_s: float,
    *,
    allow_slow: bool = False,
) -> tuple[list[tuple[int, int, int]], str]:
    """The shapes and dtype ``run_demo`` runs on ``plan``'s ranks (the device's defaults where
    None), checked before any rank starts: ``ShapeError``, ``ArgumentError``, ``ProblemSizeError``
    (shapes too large for the ranks' memory), and ``ShapeError`` for a shape above
    ``limits.CPU_MAX_MACS`` on the CPU (hours in Triton's interpreter) unless ``allow_slow``."""
    from fo_kernels.errors import ShapeError
    from fo_tune.ranks.limits import (
        CPU_MAX_SIDE,
        check_problem_size,
        largest_for_the_interpreter,
        local_target,
    )

    on_gpu = plan.backend == "nccl"
    shapes = list(shapes) if shapes else default_shapes(on_gpu, dtype, plan.world_size)
    dtype = dtype or default_dtype(on_gpu)
    _check_args(plan.world_size, shapes, dtype, reps, timeout_s)
    check_problem_size(shapes, dtype, local_target(plan.backend, plan.world_size))
    largest = None if on_gpu or allow_slow else largest_for_the_interpreter(shapes)
    if largest is not None:
        side = CPU_MAX_SIDE
        raise ShapeError(
            f"--shape {'x'.join(map(str, largest))} without GPUs runs every op in Triton's CPU "
            f"interpreter, hours for a GPU-sized shape: run it on GPUs, give shapes up to "
            f"{side}x{side}x{side}, or pass --allow-slow to run it anyway"
        )
    return shapes, dtype


def run_demo(
    world_size: int | None = None,
    shapes: Sequence[tuple[int, int, int]] | None = None,
    dtype: str | None = None,
    backend: str | None = None,
    reps: int = 5,
    timeout_s: float = 600.0,
    *,
    seed: int = 0,
    allow_slow: bool = False,
) -> list[DemoRow]:
    """Run the demo (see the module docstring); rows in (shape, collective) order, the collectives
    in ``fo_kernels.schedule.COLLECTIVES`` order.

    ``world_size`` and ``backend`` are decided by ``plan_demo``; ``shapes`` and ``dtype`` default
    per device (``CPU_SHAPES`` / float32, ``GPU_SHAPES`` / bfloat16). Raises ``ShapeError`` for bad
    shapes or dtype (``ProblemSizeError`` for shapes too large for the ranks' memory),
    ``EnvironmentMismatchError`` when the ranks cannot run here, ``LaunchError`` when a rank fails
    or hangs.
    """
    from fo_kernels.schedule import COLLECTIVES
    from fo_tune.ranks.backend import visible_gpus
    from fo_tune.ranks.launch import run_ranks

    plan = plan_demo(world_size, backend, visible_gpus())
    on_gpu = plan.backend == "nccl"
    shapes, dtype = demo_inputs(plan, shapes, dtype, reps, timeout_s, allow_slow=allow_slow)
    job = Job(tuple(tuple(s) for s in shapes), dtype, reps, seed)  # type: ignore[misc]
    # the spawned ranks inherit these: compiled kernels on the GPUs, else the interpreter and no GPU
    env = {"TRITON_INTERPRET": "0"} if on_gpu else {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    saved = {key: os.environ.get(key) for key in env}
    try:
        os.environ.update(env)
        per_rank = run_ranks(rank_main, plan.world_size, job, backend=plan.backend, timeout_s=timeout_s)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    world_size, backend = plan.world_size, plan.backend
    rows: list[DemoRow] = []
    cases = [(s, c) for s in job.shapes for c in COLLECTIVES]
    for i, ((m, n, k), collective) in enumerate(cases):
        head = dict(collective=collective, m=m, n=n, k=k, dtype=dtype, backend=backend, world_size=world_size)
        results = [r[i] for r in per_rank]
        if any(r is None for r in results):
            rows.append(_skipped(head, f"M={m} is not divisible by the world size {world_size}"))
            continue
        rows.append(DemoRow(**head, **merge_ranks(results, TOL[dtype])))  # type: ignore[arg-type]
    return rows


def _skipped(head: dict[str, Any], reason: str) -> DemoRow:
    nan = float("nan")
    return DemoRow(
        **head,
        schedule=reason,
        schedule_source="",
        rel_err=nan,
        has_nan=False,
        passed=False,
        overlapped_ms=nan,
        sequential_ms=nan,
        speedup=nan,
        skipped=True,
        reason=reason,
    )


# ------------------------------------------------------------------------------ the copy engine
COPY_ENGINE_BACKEND = "cpu-threads"  # DemoRow.backend of the copy engine's CPU executor rows
VIRTUAL_BACKEND = "virtual-ranks"  # DemoRow.backend of its virtual ranks on one GPU
COPY_ENGINE_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
COPY_ENGINE_WEIGHTS = (1, 1)  # two chunks per shard: each hop runs beside the next chunk's GEMM
COPY_ENGINE_STAGE = "check and time"  # the reporter's stage of run_copy_engine_demo


def copy_engine_backend(gpus: int) -> str:
    """Where ``--engine copy_engine`` runs its ranks: as virtual ranks on one GPU when this
    process sees one (``fo_kernels.engines.copy_engine.virtual``: ranks cannot share a GPU through
    NCCL), else as thread-ranks of the CPU executor."""
    return VIRTUAL_BACKEND if gpus > 0 else COPY_ENGINE_BACKEND


def run_copy_engine_demo(
    world_size: int = 2,
    shapes: Sequence[tuple[int, int, int]] | None = None,
    dtype: str | None = None,
    reps: int = 5,
    *,
    seed: int = 0,
    backend: str | None = None,
    reporter: Reporter | None = None,
) -> list[DemoRow]:
    """The copy engine's protocol on ``world_size`` ranks (``backend``: ``copy_engine_backend``
    of the GPUs this process sees, unless given): for each shape, all_reduce, reduce_scatter and
    all_gather (the latter two when M is divisible by the world size, else a skipped row; a shape
    of M below the world size is skipped, and ``ShapeError`` when no shape runs at all), each
    ``reps`` calls on the same buffers in the ``ring`` mode, checked against float64. On the CPU
    executor (``check_on_threads``) its time is the executor's; on the virtual ranks of one GPU
    (``check_on_gpu``, every call issued eagerly: the GPU tests run the graphs) the median GPU
    time of a call of all ranks on that GPU. Neither is a rank's time on its own GPU, so there is
    no sequential baseline. ``reporter`` gets a stage ``COPY_ENGINE_STAGE`` with a step per
    (shape, collective) that runs."""
    import torch

    from fo_kernels.engines.copy_engine import CpuCheck, check_on_threads

    backend, shapes, dtype = copy_engine_demo_inputs(world_size, shapes, dtype, reps, backend)
    on_gpu = backend == VIRTUAL_BACKEND
    skips = {
        (m, collective): _copy_engine_skip(m, collective, world_size)
        for m, _n, _k in shapes
        for collective in COPY_ENGINE_COLLECTIVES
    }
    rep = reporter or SilentReporter()
    rep.stage(COPY_ENGINE_STAGE, sum(skip is None for skip in skips.values()))
    rows: list[DemoRow] = []
    weights = COPY_ENGINE_WEIGHTS
    how = f"copy engine ring, {len(weights)} chunk(s) per shard, weights {list(weights)}"
    for m, n, k in shapes:
        for collective in COPY_ENGINE_COLLECTIVES:
            head = dict(
                collective=collective,
                m=m,
                n=n,
                k=k,
                dtype=dtype,
                backend=backend,
                world_size=world_size,
            )
            skip = skips[m, collective]
            if skip is not None:
                rows.append(_skipped(head, skip))
                continue
            check = CpuCheck(
                collective=collective, world=world_size, m=m, n=n, k=k, weights=weights,
                dtype=getattr(torch, dtype), calls=reps, seed=seed,
                scaling="rowwise" if dtype == FP8_NAME else "",
            )  # fmt: skip
            got = _on_gpu(check) if on_gpu else check_on_threads(check)
            rep.step(COPY_ENGINE_STAGE, f"{collective} {m}x{n}x{k}")
            nan = float("nan")
            passed = not got.has_nan and got.rel_err < TOL[dtype]
            rows.append(
                DemoRow(
                    **head,
                    schedule=how,
                    schedule_source="virtual ranks, one GPU" if on_gpu else "cpu executor",
                    rel_err=got.rel_err,
                    has_nan=got.has_nan,
                    passed=passed,
                    overlapped_ms=got.wall_ms,
                    sequential_ms=nan,
                    speedup=nan,
                )
            )
    return rows


def copy_engine_demo_inputs(
    world_size: int,
    shapes: Sequence[tuple[int, int, int]] | None,
    dtype: str | None,
    reps: int,
    backend: str | None,
) -> tuple[str, list[tuple[int, int, int]], str]:
    """(backend, shapes, dtype) ``run_copy_engine_demo`` runs (the defaults of the GPUs this
    process sees where None), checked before any rank starts: ``ShapeError`` (also when no shape
    runs at all), ``ArgumentError``."""
    from fo_kernels.errors import ArgumentError, ShapeError
    from fo_tune.ranks.backend import check_cpu_world_size, check_world_size, visible_gpus

    check_world_size(world_size)
    backend = backend or copy_engine_backend(visible_gpus())
    if backend not in (COPY_ENGINE_BACKEND, VIRTUAL_BACKEND):
        raise ArgumentError(f"backend {backend!r} is not one of {COPY_ENGINE_BACKEND}, {VIRTUAL_BACKEND}")
    on_gpu = backend == VIRTUAL_BACKEND
    shapes = list(shapes) if shapes else default_shapes(on_gpu, dtype, world_size)
    dtype = dtype or default_dtype(on_gpu)
    _check_args(world_size, shapes, dtype, reps, 1.0)
    if not on_gpu:
        check_cpu_world_size(world_size)
    if world_size < 2:
        raise ShapeError(f"the copy engine runs between at least 2 ranks, got --world-size {world_size}")
    if all(_copy_engine_skip(m, c, world_size) for m, _n, _k in shapes for c in COPY_ENGINE_COLLECTIVES):
        raise ShapeError(
            f"no --shape runs on the copy engine at world size {world_size}: each needs M >= the world "
            "size (a multiple of it for reduce_scatter and all_gather); give a larger M"
        )
    return backend, shapes, dtype


def _copy_engine_skip(m: int, collective: str, world_size: int) -> str | None:
    """Why the copy-engine demo skips ``collective`` at M = ``m`` on ``world_size`` ranks, else
    None: its ring splits M among the ranks, and the runtime runs a call of M < world size as the
    GEMM then the collective instead."""
    if m < world_size:
        return (
            f"M={m} is below the world size {world_size} (the runtime runs such a call as GEMM then "
            "the collective)"
        )
    if collective != "all_reduce" and m % world_size:
        return f"M={m} is not divisible by the world size {world_size}"
    return None


def _on_gpu(check: Any) -> Any:
    """``check`` on new virtual ranks of this process's GPU (the regions sized for it: a captured
    graph would hold them), every call issued eagerly."""
    from fo_kernels.engines.copy_engine.check import check_on_gpu
    from fo_kernels.engines.copy_engine.virtual import VirtualRanks, cuda_device

    return check_on_gpu(check, VirtualRanks(check.world, cuda_device()))
