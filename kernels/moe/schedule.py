"""``MoeSchedule``: how one expert-parallel FFN call runs, for a range of tokens per rank.

    problem   hidden H, intermediate I, experts E_local, top_k k, tokens per rank [tokens_min,
              tokens_max]: the key a table row is found by (tokens per rank is the M bucket)
    engine    None: no overlap (dispatch -> grouped GEMMs -> combine, each one step; the
              fallback); ``triton``: the signalled grouped GEMM and NCCL per peer; ``copy_engine``:
              rows pushed into the peers' symmetric buffers (``fo_kernels.moe`` docstring)
    tile      triton: the grouped GEMMs' tile (the SwiGLU kernel takes BLOCK_N / 2 columns of the
              gate and of the up projection)
    sms_free, nccl_max_ctas, wait_mode
              triton: as the dense engine's (``fo_kernels.engines.triton.settings``)
    chunks    copy_engine: pieces each source's rows are pushed in (each signalled on its own)

``tokens_max`` is the token bound: the copy engine sizes its symmetric buffers for it (a slot of
tokens_max x k rows per source rank, made once) and a call with more tokens on any rank is refused
before any row moves. Routing changes every step, so a buffer sized for one step's rows would
be resized on most steps; sized for the bound it never is.

A call's tokens are the most any of its ranks holds (the M bucket the table keys rows by), which
no rank knows before the counts exchange: ``check_call`` checks what this rank alone can see
(before any collective), ``check_tokens`` the tokens from the exchange, so that every rank of a
call refuses it alike instead of one raising while the others wait for it in a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fo_kernels.errors import ScheduleError
from fo_kernels.fields import check_choice, check_int, from_mapping
from fo_kernels.moe.routing import MOE_DTYPES, FfnShape
from fo_kernels.schedule import OP_TEXT_ENCODER, dtype_name
from fo_kernels.tile import Tile

MOE_ENGINES = ("triton", "copy_engine")
WAIT_MODES = ("stream_wait", "spin")
# The copy engine's most pieces per source slot (each piece is one push and one flag).
MAX_CHUNKS = 16


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeProblem:
    """The expert shapes and the tokens per rank a schedule is for."""

    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tokens_min: int = 0
    tokens_max: int

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "experts", "top_k", "tokens_max"):
            check_int(f"problem.{name}", getattr(self, name), minimum=1)
        check_int("problem.tokens_min", self.tokens_min, minimum=0)
        if self.tokens_min > self.tokens_max:
            raise ScheduleError(
                f"problem.tokens_min: {self.tokens_min} is above tokens_max {self.tokens_max}"
            )

    def same_experts(self, shape: FfnShape) -> bool:
        """True when a call of ``shape`` has this problem's experts' shape (H, I, E_local, k)."""
        return (shape.hidden, shape.intermediate, shape.experts, shape.top_k) == (
            self.hidden,
            self.intermediate,
            self.experts,
            self.top_k,
        )

    def covers(self, shape: FfnShape) -> bool:
        """True when a call of ``shape`` is this problem (its tokens in range)."""
        return self.same_experts(shape) and self.tokens_min <= shape.tokens <= self.tokens_max

    def describe(self) -> str:
        """The shape and token range in a few words, for logs and reports."""
        return (
            f"H {self.hidden}, I {self.intermediate}, E_local {self.experts}, k {self.top_k}, "
            f"tokens [{self.tokens_min}, {self.tokens_max}]"
        )

    def to_dict(self) -> dict[str, int]:
        return {
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "experts": self.experts,
            "top_k": self.top_k,
            "tokens_min": self.tokens_min,
            "tokens_max": self.tokens_max,
        }


@dataclass(frozen=True, kw_only=True)
class MoeSchedule:
    """How ``expert_parallel_ffn`` runs (see the module docstring)."""

    dtype: str
    world_size: int
    problem: MoeProblem
    engine: str | None = None
    tile: Tile | None = None
    sms_free: int = 0
    nccl_max_ctas: int = 0
    wait_mode: str = "stream_wait"
    chunks: int = 1
    op_text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, MOE_DTYPES)
        check_int("world_size", self.world_size, minimum=1)
        if not isinstance(self.problem, MoeProblem):
            raise ScheduleError(
                f"problem: expected a fo_kernels.MoeProblem(hidden=H, intermediate=I, experts=E_LOCAL, "
                f"top_k=K, tokens_max=T), got {type(self.problem).__name__} (MoeSchedule.from_dict reads a "
                "mapping)"
            )
        if self.engine is not None:
            check_choice("engine", self.engine, MOE_ENGINES)
        if self.tile is not None and not isinstance(self.tile, Tile):
            raise ScheduleError(f"tile: expected a Tile config, got {type(self.tile).__name__}")
        check_int("sms_free", self.sms_free, minimum=0)
        check_int("nccl_max_ctas", self.nccl_max_ctas, minimum=0)
        check_choice("wait_mode", self.wait_mode, WAIT_MODES)
        check_int("chunks", self.chunks, minimum=1)
        if self.chunks > MAX_CHUNKS:
            raise ScheduleError(f"chunks: at most {MAX_CHUNKS}, got {self.chunks}")
        if self.engine == "triton" and self.tile is None:
            raise ScheduleError("tile: engine triton needs the grouped GEMMs' tile")
        if self.engine == "copy_engine" and self.world_size < 2:
            raise ScheduleError("engine: copy_engine runs between at least 2 ranks")
        object.__setattr__(self, "op_text", OP_TEXT_ENCODER.encode(self.to_dict()))

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "dtype": self.dtype,
            "world_size": self.world_size,
            "problem": self.problem.to_dict(),
            "engine": self.engine,
        }
        if self.engine == "triton":
            data.update(
                tile=self.tile.to_dict(),
                sms_free=self.sms_free,
                nccl_max_ctas=self.nccl_max_ctas,
                wait_mode=self.wait_mode,
            )
        elif self.engine == "copy_engine":
            data["chunks"] = self.chunks
        return data

    @classmethod
    def from_dict(cls, data: Any) -> MoeSchedule:
        if not isinstance(data, dict):
            raise ScheduleError(f"schedule: expected a mapping, got {type(data).__name__}")
        data = dict(data)
        data["problem"] = from_mapping(MoeProblem, data.get("problem"), "problem")
        if data.get("tile") is not None:
            data["tile"] = Tile.from_dict(data["tile"])
        return from_mapping(cls, data, "schedule")

    def check_call(self, shape: FfnShape, dtype: torch.dtype | str) -> None:
        """Raise ``ScheduleError`` unless this schedule is for a call of ``shape`` in ``dtype`` (x's
        dtype, or its name), its tokens aside (``check_tokens``: the most any rank holds, known
        after the counts exchange). A float64 call (a reference) has no schedule."""
        if dtype == torch.float64:
            raise ScheduleError("dtype: a schedule is for bfloat16, float16 or float32; x is float64")
        dtype = dtype_name(dtype)
        for name, want in (("dtype", dtype), ("world_size", shape.world)):
            if getattr(self, name) != want:
                have = getattr(self, name)
                raise ScheduleError(f"{name}: the schedule says {have!r}, this call needs {want!r}")
        if not self.problem.same_experts(shape):
            raise ScheduleError(
                f"problem: the schedule is for {self.problem.describe()}; called with H {shape.hidden}, "
                f"I {shape.intermediate}, E_local {shape.experts}, k {shape.top_k}"
            )

    def check_tokens(self, tokens: Sequence[int]) -> None:
        """Raise ``ScheduleError`` unless the most tokens any rank of the call holds (``tokens``:
        every rank's, from the counts exchange; every rank sees the same) is in the schedule's
        range, so every rank of the call raises alike."""
        most = max(tokens)
        if not self.problem.tokens_min <= most <= self.problem.tokens_max:
            raise ScheduleError(
                f"problem: the schedule is for {self.problem.describe()}; the call's ranks hold up to "
                f"{most} tokens (group rank {list(tokens).index(most)}); use a schedule whose tokens "
                "cover it"
            )
