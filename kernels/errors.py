"""Error types of the runtime; the tuner and the CLI reuse them.

One base class, ``FoTuneError``; each subclass also inherits the builtin a caller would expect
(``ValueError`` for bad input, ``FileNotFoundError`` for a missing table, ``RuntimeError`` for the
environment), so ``except ValueError`` keeps working for code that does not know about fo-tune.
The CLI maps input errors to exit code 2 and one line on stderr.
"""

from __future__ import annotations

# What each of fo-tune's optional extras (pyproject.toml) installs, as one pip command a message can
# name: it works wherever fo-tune came from (a checkout's ``pip install -e '.[cuda]'`` as well).
_EXTRA_PACKAGES = {"cuda": "cuda-bindings", "postgres": "'psycopg[binary]'"}


def install_hint(extra: str) -> str:
    """fo-tune's optional ``extra`` (``"cuda"``, ``"postgres"``) and the pip command that adds it."""
    return f"fo-tune's {extra} extra: pip install {_EXTRA_PACKAGES[extra]}"


class FoTuneError(Exception):
    """Base of every error fo-tune raises on purpose."""


class ShapeError(FoTuneError, ValueError):
    """Operands or a problem shape that the operation cannot take."""


class ScheduleError(FoTuneError, ValueError):
    """A schedule that is malformed or does not fit the problem; the message names the field."""


class DeviceLimitError(ScheduleError):
    """A schedule whose tile needs more of this GPU (shared memory, registers) than it has: the
    kernel cannot load here, whatever the input."""


class ScaleError(ShapeError):
    """fp8 operands and their scales that the ops cannot take (``fo_kernels.scaling``): scales on
    other operands, wrong scale shapes or dtypes, mixed operand dtypes, another fp8 variant."""


class Fp8TrainingError(FoTuneError, NotImplementedError):
    """A backward through an op with fp8 operands: fo-tune runs fp8 for inference only."""


class DoubleBackwardError(FoTuneError, NotImplementedError):
    """A gradient of a gradient (``create_graph=True``, then a backward through the gradients) of an
    op whose backward is not differentiable: the expert-parallel FFN's (``expert_parallel_ffn``)."""


class GroupError(FoTuneError, ValueError):
    """A process group the call cannot use: this rank is not in it, or it is unknown or destroyed."""


class ArgumentError(FoTuneError, ValueError):
    """An argument a call does not take (an unknown ``reduce_op``, a flag that is not a bool)."""


class SignatureError(FoTuneError, TypeError):
    """A call whose arguments do not fit its function's signature (an operand given twice, or
    missing): a ``TypeError``, as Python raises for such a call."""


class NotInitializedError(GroupError, ArgumentError, ScheduleError):
    """A collective call (an op, a fused op, a layer or a style) before
    ``torch.distributed.init_process_group``: every such entry point raises this one type, with one
    message. It is also an ``ArgumentError`` and a ``ScheduleError`` (and so a ``ValueError``), so an
    ``except`` clause written for either still catches it."""


class PlanError(FoTuneError, ValueError):
    """A tensor-parallel plan (``parallelize_linears``) naming no module, or a module it cannot shard."""


class AlreadyParallelizedError(PlanError, RuntimeError):
    """A tensor-parallel style applied to a module whose parameters a style already distributed
    (``parallelize_module`` run twice on it). Also a ``RuntimeError``, what torch's styles raise
    for it, so a drop-in caller's ``except`` still catches it."""


class TableError(FoTuneError, ValueError):
    """A schedule table that is malformed, of an unknown schema, or for other hardware."""


class TableNotFoundError(FoTuneError, FileNotFoundError):
    """A table file that does not exist."""


class ProtocolError(FoTuneError, RuntimeError):
    """An operation list broke the copy engine's protocol (``fo_kernels.engines.copy_engine.cpu``:
    a flag set twice, a wait or reset of a peer's cell, an event waited for before it is recorded)."""


class ProtocolTimeout(ProtocolError):
    """A wait was not satisfied within the timeout: a lost flag or a deadlock."""


class EnvironmentMismatchError(FoTuneError, RuntimeError):
    """The machine cannot run what was asked (no GPU, wrong backend, missing package)."""


class VersionDriftWarning(UserWarning):
    """A table was measured with other library versions than the ones running now, or on another
    device key of this device's compute capability (another GPU model, SM count or interconnect)."""


class HeuristicScheduleWarning(UserWarning):
    """No table row matched, so a documented heuristic schedule is used."""


class TableDirWarning(UserWarning):
    """``$FO_TUNE_TABLE_DIR`` names something that is not a folder, so no table is read from it."""


class TileStagesWarning(UserWarning):
    """An fp8 call's ``out_dtype`` is wider than the bfloat16 its schedule was tuned for and the
    schedule's tile does not load with it on this GPU: it runs with fewer pipeline stages."""


class NotOverlappedWarning(UserWarning):
    """A tensor-parallel layer, or part of one, runs as torch's style runs it: fo-tune cannot overlap it."""
