"""What one ``fo-tune bench`` run measures (``BenchRequest``), its per-device defaults, and the
checks that refuse a request before any rank starts."""

from __future__ import annotations

from dataclasses import dataclass

from fo_kernels.errors import FoTuneError, ShapeError
from fo_kernels.schedule import COLLECTIVES, DTYPES, SHARDED_COLLECTIVES
from fo_tune.bench.suite import Shape
from fo_tune.ranks.limits import CPU_MAX_SIDE, check_problem_size, largest_for_the_interpreter, local_target
from fo_tune.ranks.pool import TASK_TIMEOUT_S

# Row chunks of the hand-chunked baseline: the design brief's H200 prototype split M into 2, 4 and 8
# (docs/design.md#triton-engine).
CHUNK_COUNTS = (2, 4, 8)
# Untimed calls before each timing (fo_tune.ranks.timing.time_region's default); the interpreter is slow,
# so one on the CPU. The checked call comes before these.
WARMUP, CPU_WARMUP = 3, 1
# Timed samples per variant (each sample spans >= comparison_sample_ms on GPUs). 30 on GPUs: with
# 10, the host-heavy variants of one H200 x2 bench had 0.1-0.6 ms outliers that moved their medians
# by up to 60%, and 30 reproduced within a few % in two processes; the five-shape suite then takes
# ~55 s for both collectives with 16 ms samples (docs/design.md#timing).
GPU_REPS, CPU_REPS = 30, 3
# bf16 tl.dot is wrong in Triton's CPU interpreter (docs/design.md), so the CPU default is float32.
GPU_DTYPE, CPU_DTYPE = "bfloat16", "float32"
# The default shape on the CPU: small enough for the interpreter (~40 ms per fo_tune call on 2 ranks).
CPU_SHAPES = ((64, 96, 64),)


class BenchRequestError(FoTuneError, ValueError):
    """A request that cannot run here as asked; the message says what to run instead."""


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
    sample_ms: float | None = None  # None: fo_tune.ranks.timing.comparison_sample_ms (16 ms on GPUs)
    allow_slow: bool = False  # run shapes above limits.CPU_MAX_MACS in Triton's CPU interpreter anyway

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
        self._check_shardable()

    def _check_shardable(self) -> None:
        """Refuse a shape none of whose collectives can run: reduce_scatter and all_gather need M
        divisible by the world size (a shape that another collective runs gets SKIP rows instead)."""
        if any(c not in SHARDED_COLLECTIVES for c in self.collectives):
            return
        w = self.world_size
        names = " and ".join(self.collectives)
        verb = "needs" if len(self.collectives) == 1 else "need"
        gathered = ", all_gather's M being the gathered M" if "all_gather" in self.collectives else ""
        for m, n, k in self.shapes:
            if m % w:
                raise ShapeError(
                    f"shape {m}x{n}x{k}: {names} {verb} M divisible by the world size {w} (each rank "
                    f"holds M/{w} rows{gathered}); give M a multiple of {w}, or add all_reduce to the "
                    "collectives (--collective)"
                )

    def dtype_for(self, backend: str) -> str:
        """The operand dtype: the request's, else the device's default."""
        return self.dtype or (GPU_DTYPE if backend == "nccl" else CPU_DTYPE)


def check_runnable(request: BenchRequest, backend: str) -> None:
    """Refuse, before any rank starts, shapes that cannot exist on the ranks' devices
    (``fo_tune.ranks.limits``) and, on the CPU (any backend but NCCL), shapes above ``limits.CPU_MAX_MACS``
    unless ``request.allow_slow``."""
    check_problem_size(request.shapes, request.dtype_for(backend), local_target(backend, request.world_size))
    if backend == "nccl" or request.allow_slow:
        return
    largest = largest_for_the_interpreter(request.shapes)
    if largest is None:
        return
    m, n, k = largest
    what = f"the suite {request.suite!r} holds GPU shapes" if request.suite else "the shapes are GPU-sized"
    default = "x".join(map(str, CPU_SHAPES[0]))
    side = CPU_MAX_SIDE
    raise BenchRequestError(
        f"{what} (up to {m}x{n}x{k}): without GPUs every call runs in Triton's CPU interpreter, "
        f"hours per shape; run `fo-tune bench` without --suite and --shape for the CPU default "
        f"({default}), give shapes up to {side}x{side}x{side}, or pass --allow-slow to run them anyway"
    )
