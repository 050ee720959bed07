"""A bad argument of a compiled call, refused when the graph runs, as the eager call refuses it.

Dynamo makes its own ``Unsupported`` error (a RuntimeError) of an exception that a traced function
raises and does not catch, so under torch.compile(fullgraph=True) the ``ValueError`` subclasses of
the public ops' operand checks (``fo_kernels.overlap``), torch's fused-op signatures
(``fo_kernels.symm_mem``), the layers (``fo_kernels.layers``), the styles' forward
(``fo_kernels.parallel_forward``) and the MoE FFN and its module (``fo_kernels.moe.ffn``,
``fo_kernels.moe.module``) would not reach the caller. ``refusal`` runs a call's checks: eagerly
they raise as they are; traced, Dynamo traces the raise and the ``except`` here, and the refusal
comes back as (error type's name, message). ``refused`` gives the call's output as the output of the
``fo_kernels::refused`` op, which raises that error when the graph runs it, before the call's own
work (which the graph then does not hold); the graph traces without a break. The custom ops
themselves defer their refusals of a group or schedule through their string arguments instead
(``fo_kernels.ops``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from fo_kernels import errors
from fo_kernels.errors import FoTuneError

T = TypeVar("T")


@torch.library.custom_op("fo_kernels::refused", mutates_args=())
def _refused(like: torch.Tensor, error: str, message: str) -> torch.Tensor:
    """Raise the ``fo_kernels.errors`` type named ``error`` with ``message`` (a traced call's
    refusal, when the graph runs)."""
    kind = getattr(errors, error, None)
    if not (isinstance(kind, type) and issubclass(kind, FoTuneError)):
        kind = FoTuneError
    raise kind(message)


@_refused.register_fake
def _(like: torch.Tensor, error: str, message: str) -> torch.Tensor:
    return like.new_empty(())


def refusal(check: Callable[[], T]) -> tuple[T | None, tuple[str, str] | None]:
    """(``check()``, None); where it raises a ``FoTuneError``: eagerly the error itself, traced by
    torch.compile (None, (the error type's name, its message)) for ``refused``."""
    if not torch.compiler.is_compiling():
        return check(), None
    try:
        return check(), None
    except FoTuneError as exc:
        return None, (type(exc).__name__, str(exc))


def shape_text(t: torch.Tensor) -> str:
    """``t``'s shape as a tuple prints, for a refusal's message. Traced with dynamic shapes, a
    message that formats a symbolic size (or a tuple) is no constant the refused op can take; one
    built of ``int`` sizes is (the refused call's graph is specialized to them, a good call's is
    not)."""
    parts = []
    for size in t.shape:
        parts.append(f"{int(size)}")
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def _plain(t: object) -> torch.Tensor | None:
    """``t`` as a plain tensor for a refused output to take its dtype and device from: a DTensor's
    local tensor, a tensor as it is, None for anything else."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.to_local()
    return t if isinstance(t, torch.Tensor) else None


def refused(
    why: tuple[str, str],
    like: object,
    shape: tuple[int, ...],
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A tensor of ``shape`` (a traced call's output) whose op raises the refusal ``why`` (from
    ``refusal``) when the graph runs. Its dtype and device are ``like``'s, or the first tensor's of
    ``like`` where it is a tuple (a DTensor's local one; a float32 CPU tensor where none is a
    tensor: a refused operand may be a list or a number); ``dtype`` overrides the dtype. No
    gradient flows through it."""
    base = None
    for t in like if isinstance(like, tuple) else (like,):
        base = _plain(t)
        if base is not None:
            break
    if base is None:
        base = torch.zeros(())
    out = _refused(base.detach(), *why)
    return (out if dtype is None else out.to(dtype)).expand(shape)


def shape_of(t: object) -> tuple[int, ...]:
    """``t``'s shape where it is a tensor, else () (the shape of a refused call's operand that may
    be no tensor)."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) else ()
