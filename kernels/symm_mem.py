"""torch's fused tensor-parallel ops (``torch.ops.symm_mem``), same signatures, on fo-tune's ops.

A caller of torch's async-TP ops switches by import:

    torch.ops.symm_mem.fused_all_gather_matmul(A, Bs, gather_dim, group_name, return_A=True)
    fo_kernels.symm_mem.fused_all_gather_matmul(A, Bs, gather_dim, group_name, return_A=True)

    fused_all_gather_matmul(A, Bs, gather_dim, group_name, *, return_A=True)
        -> (A_full or None, [A_full @ B for B in Bs]), A_full = all_gather(A) on gather_dim
    fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name)
        -> reduce_scatter(A @ B) on scatter_dim, reduce_op "sum" or "avg"

``group_name`` is the process group's ``group_name``, as torch's ops take it (or the
``ProcessGroup`` itself, as torch's reference implementations take it). The results are
torch's (the values of its reference implementation, ``_fused_*_fallback``, and the same dims
moved back as views). A leading ``gather_dim`` / ``scatter_dim`` is moved to the front and the
rows run through ``all_gather_gemm`` / ``gemm_reduce_scatter`` (several ``Bs`` as one GEMM of
their concatenation, whose output is split); the last dim (the features), dtypes the ops do not
take, empty operands (no rows, features or outputs) and an empty ``Bs`` run as torch's reference
runs them, with a ``NotOverlappedWarning``. Unlike torch's ops these are differentiable in ``A``
and ``Bs``, the gathered A that ``return_A`` gives too (its gradient reaches the shard by a
ReduceScatter, as through torch's reference). Bad arguments raise a ``ValueError``
subclass naming the problem before any collective (traced by torch.compile, when the graph runs:
``fo_kernels.refusal``); fp8 operands are one (``ScaleError``: these
signatures take no scales; ``all_gather_gemm`` / ``gemm_reduce_scatter`` take them).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fo_kernels import ops
from fo_kernels.errors import (
    ArgumentError,
    FoTuneError,
    GroupError,
    NotOverlappedWarning,
    ScaleError,
    ShapeError,
)
from fo_kernels.execute import check_local
from fo_kernels.fields import check_bool
from fo_kernels.gemm import BOperand
from fo_kernels.groups import check_group, require_initialized, resolve_group
from fo_kernels.ops import call_op, warn_while_tracing
from fo_kernels.refusal import refusal, refused, shape_of, shape_text
from fo_kernels.scaling import is_fp8
from fo_kernels.schedule import TORCH_DTYPES

__all__ = ["fused_all_gather_matmul", "fused_matmul_reduce_scatter"]

REDUCE_OPS = ("sum", "avg")
# The dtypes these functions run on the ops (fp8 needs scales, which torch's signatures have no
# place for: ``_check_not_fp8``), as a warning names them.
_DTYPES = ", ".join(str(t).removeprefix("torch.") for t in TORCH_DTYPES.values() if not is_fp8(t))


def _dim(dim: int, ndim: int, what: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ShapeError(f"{what} {dim!r} is not a dim of a {ndim}-dim A")
    return dim % ndim


def _check_b(a: torch.Tensor, b: torch.Tensor, what: str, k: int) -> None:
    """Raise ``ShapeError`` unless ``b`` is a (k, N) matrix (k: A's features, gathered or not) of
    A's dtype and device: ``torch.matmul`` refuses mixed ones, which the reference path would reach
    only after its collective."""
    if not isinstance(b, torch.Tensor) or b.dim() != 2:
        raise ShapeError(f"{what} must be a (K, N) matrix, got {_described(b)}")
    if b.shape[0] != k:
        raise ShapeError(
            f"K mismatch: A is {shape_text(a)} ({int(k)} features) and {what} is {shape_text(b)}"
        )
    if b.dtype != a.dtype or b.device != a.device:
        raise ShapeError(
            f"A is {a.dtype} on {a.device} and {what} is {b.dtype} on {b.device}: give the operands "
            "one dtype and one device (torch.matmul takes no mix)"
        )


def _check_a(a: torch.Tensor, bs: list[torch.Tensor]) -> None:
    if not isinstance(a, torch.Tensor) or a.dim() < 2:
        raise ShapeError(f"A must be a tensor of at least 2 dims, got {_described(a)}")
    check_local(A=a, **{f"Bs[{i}]": b for i, b in enumerate(bs)})


# The op that takes scales, named by each fused function's fp8 refusal (``_check_not_fp8``).
_FP8_OPS = {
    "fused_all_gather_matmul": "all_gather_gemm",
    "fused_matmul_reduce_scatter": "gemm_reduce_scatter",
}


def _check_not_fp8(what: str, a: torch.Tensor, bs: list[torch.Tensor]) -> None:
    """Raise ``ScaleError`` for fp8 operands: torch's unscaled signatures have no ``scale_a`` /
    ``scale_b`` (torch has ``fused_all_gather_scaled_matmul`` for those), and torch.matmul has no
    fp8 kernel, so the call would fail after its collective."""
    dtypes = [t.dtype for t in (a, *bs) if is_fp8(t.dtype)]
    if dtypes:
        raise ScaleError(
            f"{what} has no scales for {dtypes[0]} operands (torch's unscaled signature): call "
            f"fo_kernels.{_FP8_OPS[what]} with float8_e4m3fn operands, scale_a and scale_b, or pass "
            "bfloat16, float16 or float32 operands"
        )


def _described(t: object) -> str:
    return f"shape {shape_text(t)}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"


def _named(group_name: str | dist.ProcessGroup) -> str:
    """``group_name`` as a name: a string as it is, a ``ProcessGroup`` by its ``group_name``;
    anything else raises ``GroupError``."""
    if isinstance(group_name, str):
        return group_name
    if isinstance(group_name, dist.ProcessGroup):
        return group_name.group_name
    if group_name is dist.GroupMember.NON_GROUP_MEMBER:
        check_group(group_name)  # (what dist.new_group returns outside the group: that message)
    expected = "group_name: expected a process group's group_name (str) or a ProcessGroup, got"
    if isinstance(group_name, DeviceMesh):  # (a traced call sees it as another type: named here)
        raise GroupError(f"{expected} a DeviceMesh; pass the group of one of its dims, mesh.get_group(dim)")
    raise GroupError(f"{expected} {type(group_name).__name__}")


def _world(group_name: str | dist.ProcessGroup) -> tuple[str, int]:
    """(the group's name as the ops take it, its size); an unknown name raises ``GroupError``.
    Traced by torch.compile, the size is read by name (a function Dynamo folds to a constant),
    after the name is checked by a function whose result Dynamo keeps (its raise would be Dynamo's
    internal error)."""
    group_name = _named(group_name)
    if torch.compiler.is_compiling():
        require_initialized()  # (before the default group's name, which is None until then)
        name = group_name or dist.group.WORLD.group_name
        problem = _name_problem(name)
        if problem:
            raise GroupError(problem)
        return name, dist.distributed_c10d._get_group_size_by_name(name)
    require_initialized()
    group = resolve_group(group_name)
    return ("" if group is None else group.group_name), dist.get_world_size(group)


@torch.compiler.assume_constant_result
def _name_problem(name: str) -> str:
    """The ``GroupError`` message of a group name no process group has ("" for a known name)."""
    try:
        resolve_group(name)
    except GroupError as exc:
        return str(exc)
    return ""


def _reference_why(a: torch.Tensor, bs: list[torch.Tensor], d: int) -> Callable[[], str] | None:
    """Why a call runs as torch's reference (a callable: torch.compile traces no message), or None
    when it runs on the ops: a gather or scatter of the features (dim ``d`` of ``a`` the last), a
    dtype or device the ops do not take, or an empty operand (the ops take no empty GEMM; torch's
    reference gives the empty or zero result)."""
    if d == a.dim() - 1:
        return lambda: "a gather or scatter of the features"
    if a.dtype not in TORCH_DTYPES.values():
        return lambda: f"A {a.dtype}, B {', '.join(str(b.dtype) for b in bs)} (the ops take one of {_DTYPES})"
    if not bs:  # no products: torch's reference gathers A alone
        return lambda: "no Bs (nothing to multiply)"
    if a.numel() == 0 or any(b.numel() == 0 for b in bs):
        return lambda: f"an empty operand: A {tuple(a.shape)}, B {', '.join(str(tuple(b.shape)) for b in bs)}"
    return None


def _not_overlapped(why: Callable[[], str]) -> None:
    """Warn that a call runs as torch's reference, saying ``why()`` (a callable: it may format
    shapes); once per trace where torch.compile traces the call, with a constant text."""
    if torch.compiler.is_compiling():
        warn_while_tracing(
            "fo_kernels.symm_mem: a call runs as torch's reference (seen as torch.compile traced it)"
        )
        return
    warnings.warn(f"fo_kernels.symm_mem: {why()}; it runs as torch's reference", NotOverlappedWarning, 3)


def _operand(b: torch.Tensor) -> torch.Tensor:
    """``b`` as the ops take it: row-major, or the transposed view of a row-major weight."""
    return b if BOperand.of(b) is not None else b.contiguous()


def fused_all_gather_matmul(
    A: torch.Tensor,
    Bs: list[torch.Tensor],
    gather_dim: int,
    group_name: str | dist.ProcessGroup,
    *,
    return_A: bool = True,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """``all_gather(A, gather_dim) @ B`` for each B of ``Bs`` (``A`` this rank's shard, named as
    torch's op schema names it, so a call by keyword switches too), with the gather overlapped
    with the GEMM (``all_gather_gemm``); returns (the gathered A if ``return_A`` else None, the
    products). See the module docstring."""
    checked, why_refused = refusal(lambda: _gather_checks(A, Bs, gather_dim, group_name, return_A))
    if why_refused is not None:  # (traced: raised when the graph runs)
        like = (A, *_listed(Bs))
        d, world = _refused_dim(A, gather_dim), _refused_world(group_name)
        rows = None if d == len(shape_of(A)) - 1 else d  # (a gather of the features: K grows, not M)
        outs = [refused(why_refused, like, _times(_out_of(A, b), rows, world)) for b in _listed(Bs)]
        a_full = None if return_A is False else refused(why_refused, like, _times(shape_of(A), d, world))
        return a_full, outs
    d, name, world = checked
    why = _reference_why(A, Bs, d)
    if why is not None:
        _not_overlapped(why)
        return _gather_then_matmul(A, Bs, d, name, world, return_A)
    moved = A.movedim(d, 0)
    lead = moved.shape[:-1]
    b = _operand(Bs[0] if len(Bs) == 1 else torch.cat(list(Bs), dim=1))
    out, gathered = call_op("all_gather", moved.reshape(-1, moved.shape[-1]), b, name)
    out = out.view(lead[0] * world, *lead[1:], -1)
    # several Bs: each product in its own storage, as torch's op allocates them (a column slice of
    # the one GEMM's output would not take a caller's .view)
    pieces = (
        [p.contiguous() for p in out.split([each.shape[1] for each in Bs], dim=-1)] if len(Bs) > 1 else [out]
    )
    outs = [p.movedim(0, d) for p in pieces]
    a_full = gathered.view(lead[0] * world, *lead[1:], -1).movedim(0, d) if return_A else None
    return a_full, outs


def fused_matmul_reduce_scatter(
    A: torch.Tensor,
    B: torch.Tensor,
    reduce_op: str,
    scatter_dim: int,
    group_name: str | dist.ProcessGroup,
) -> torch.Tensor:
    """``reduce_scatter(A @ B, reduce_op, scatter_dim)``, the GEMM overlapped with the
    ReduceScatter (``gemm_reduce_scatter``). See the module docstring."""
    checked, why_refused = refusal(lambda: _scatter_checks(A, B, reduce_op, scatter_dim, group_name))
    if why_refused is not None:  # (traced: raised when the graph runs)
        d, world = _refused_dim(A, scatter_dim), _refused_world(group_name)
        return refused(why_refused, (A, B), _shard_of(_out_of(A, B), d, world))
    d, name, world = checked
    why = _reference_why(A, [B], d)
    if why is not None:
        _not_overlapped(why)
        return _matmul_then_reduce_scatter(A, B, reduce_op, d, name, world)
    moved = A.movedim(d, 0)
    lead = moved.shape[:-1]
    out = call_op("reduce_scatter", moved.reshape(-1, moved.shape[-1]), _operand(B), name)
    if reduce_op == "avg":
        out = out / world
    return _scattered(out.view(lead[0] // world, *lead[1:], -1), d)


# ------------------------------------------------------------------------- checks
def _gather_checks(
    A: torch.Tensor, Bs: object, gather_dim: object, group_name: object, return_A: object
) -> tuple[int, str, int]:
    """(gather dim, group name, world size) of a ``fused_all_gather_matmul`` call, or the
    ``FoTuneError`` of an argument it refuses."""
    _check_a(A, _listed(Bs))
    check_bool("return_A", return_A)  # (torch's schema takes a bool; "no" would read as true)
    if isinstance(Bs, torch.Tensor) or not isinstance(Bs, list | tuple):
        raise ShapeError(f"Bs must be a list of (K, N) matrices, got {type(Bs).__name__}")
    d = _dim(gather_dim, A.dim(), "gather_dim")
    name, world = _world(group_name)
    k = A.shape[-1] * (world if d == A.dim() - 1 else 1)
    for i, b in enumerate(Bs):
        _check_b(A, b, f"Bs[{i}]", k)
    _check_not_fp8("fused_all_gather_matmul", A, list(Bs))
    return d, name, world


def _scatter_checks(
    A: torch.Tensor, B: object, reduce_op: object, scatter_dim: object, group_name: object
) -> tuple[int, str, int]:
    """(scatter dim, group name, world size) of a ``fused_matmul_reduce_scatter`` call, or the
    ``FoTuneError`` of an argument it refuses."""
    _check_a(A, [B])
    _check_b(A, B, "B", A.shape[-1])
    _check_not_fp8("fused_matmul_reduce_scatter", A, [B])
    if reduce_op not in REDUCE_OPS:
        raise ArgumentError(f"reduce_op {reduce_op!r} is not one of {', '.join(REDUCE_OPS)}")
    d = _dim(scatter_dim, A.dim(), "scatter_dim")
    name, world = _world(group_name)
    size = A.shape[d] if d < A.dim() - 1 else B.shape[1]
    if size % world:
        raise ShapeError(
            f"scatter_dim {scatter_dim} has {int(size)} entries, not divisible by the world size {world}"
        )
    return d, name, world


def _listed(bs: object) -> list:
    """A refused call's ``Bs`` as a list (none where it is no list of them)."""
    return list(bs) if isinstance(bs, list | tuple) else []


def _columns(b: object, a: object) -> int:
    """A refused call's output columns: ``b``'s where it is a matrix, else ``a``'s features (1
    where ``a`` has none)."""
    if isinstance(b, torch.Tensor) and b.dim() == 2:
        return b.shape[-1]
    return shape_of(a)[-1] if shape_of(a) else 1


def _out_of(a: object, b: object) -> tuple[int, ...]:
    """A refused call's product of ``a`` and ``b``, before its gather or scatter: ``a``'s leading
    dims (none where ``a`` is no tensor) and the columns."""
    return (*shape_of(a)[:-1], _columns(b, a))


def _refused_dim(a: object, dim: object) -> int | None:
    """A refused call's gather or scatter dim of ``a``, or None where ``a`` or the dim itself is
    refused."""
    if len(shape_of(a)) < 2:
        return None
    try:
        return _dim(dim, len(shape_of(a)), "dim")  # type: ignore[arg-type]
    except FoTuneError:
        return None


def _refused_world(group_name: object) -> int:
    """A refused call's world size (a constant to Dynamo: ``ops.traced_world_size``); 1 where the
    group itself is refused."""
    if isinstance(group_name, dist.ProcessGroup):
        group_name = group_name.group_name
    return ops.traced_world_size(group_name) if isinstance(group_name, str) else 1


def _times(shape: tuple[int, ...], d: int | None, world: int) -> tuple[int, ...]:
    """A gather's ``shape``: dim ``d`` times ``world`` (as it is where ``d`` is None)."""
    if d is None:
        return shape
    return (*shape[:d], shape[d] * world, *shape[d + 1 :])


def _shard_of(shape: tuple[int, ...], d: int | None, world: int) -> tuple[int, ...]:
    """A scatter's ``shape``: dim ``d`` divided by ``world`` (as it is where ``d`` is None or its
    size does not divide, which the call refuses)."""
    if d is None or shape[d] % world:
        return shape
    return (*shape[:d], shape[d] // world, *shape[d + 1 :])


# ------------------------------------------------------------------------- torch's reference
def _wait(t: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(t)


def _gather_then_matmul(
    a: torch.Tensor, bs: list[torch.Tensor], d: int, name: str, world: int, return_A: bool
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """torch's ``_fused_all_gather_matmul_fallback``, with autograd."""
    gathered = _wait(
        torch.ops._c10d_functional_autograd.all_gather_into_tensor(a.contiguous(), world, _torch_name(name))
    )
    if d == a.dim() - 1:
        full = torch.cat(gathered.chunk(world), dim=-1)
        outs = [torch.matmul(full, b) for b in bs]
        return (full if return_A else None), outs
    full = gathered.view(world, *a.shape).movedim(d + 1, 1).flatten(0, 1)
    outs = [torch.matmul(full, b).movedim(0, d) for b in bs]
    return (full.movedim(0, d) if return_A else None), outs


def _matmul_then_reduce_scatter(
    a: torch.Tensor, b: torch.Tensor, reduce_op: str, d: int, name: str, world: int
) -> torch.Tensor:
    """torch's ``_fused_matmul_reduce_scatter_fallback`` (``reduce_scatter_single``), with autograd;
    "avg" as a sum divided by the world size (gloo has no average)."""
    y = (a @ b).movedim(d, 0).contiguous()
    out = _wait(torch.ops._c10d_functional_autograd.reduce_scatter_tensor(y, "sum", world, _torch_name(name)))
    return _scattered(out / world if reduce_op == "avg" else out, d)


def _scattered(out: torch.Tensor, d: int) -> torch.Tensor:
    """A dim-0 ReduceScatter's shard with dim 0 moved back to ``d``, contiguous as torch's."""
    return out if d == 0 else out.movedim(0, d).contiguous()


def _torch_name(name: str) -> str:
    """A group's name as torch's functional collectives take it (the default group's own)."""
    return name or dist.group.WORLD.group_name
