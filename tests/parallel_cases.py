"""Rank functions for the tests of ``fo_kernels.parallel`` and ``fo_kernels.symm_mem`` (spawned
processes import this module).

Each style case builds one model from a seed every rank shares, parallelizes one copy with torch's
styles and one with fo-tune's (the same plan, the classes swapped), and runs both on the same
input and output gradient: the outputs, the input's gradient and every parameter's gradient (this
rank's shard) must agree, and the parameters and their gradients must carry the same placements.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import parallel as torch_tp

from fo_kernels import execute as execute_mod
from fo_kernels import overlap as overlap_mod
from fo_kernels import parallel as fo_tp
from fo_kernels.errors import NotOverlappedWarning
from fo_kernels.groups import group_size

TORCH = (torch_tp.ColwiseParallel, torch_tp.RowwiseParallel)
FO = (fo_tp.ColwiseParallel, fo_tp.RowwiseParallel)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = (t.to_local() if isinstance(t, DTensor) else t for t in (got, want))
    if got.shape != want.shape:
        return float("inf")
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------- models
class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int, bias: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, inner, bias=bias)
        self.down = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class FFN(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A torchtitan-shaped block: norm (sequence parallel), then a SwiGLU FFN fed a DTensor."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.ffn = FFN(hidden, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.norm(x))


class Wrapped(nn.Module):
    """A module around another, for a plan that prepares the inner one's input."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(self.tok(tokens))


class LossParallelLM(nn.Module):
    """A torchtitan-shaped language model head with loss parallelism: a sequence-parallel
    embedding, a sequence-parallel norm whose DTensor feeds a colwise projection directly (its
    ``Shard(1)`` input gathered), a rowwise one back to ``Shard(1)``, a residual, a final norm
    and an output projection that keeps its vocabulary shard as a DTensor (``Shard(-1)``)."""

    def __init__(self, vocab: int, hidden: int, inner: int, bias: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.norm = nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, inner, bias=bias)
        self.down = nn.Linear(inner, hidden, bias=bias)
        self.final_norm = nn.RMSNorm(hidden)
        self.output = nn.Linear(hidden, vocab, bias=bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        h = h + self.down(torch.tanh(self.up(self.norm(h))))
        return self.output(self.final_norm(h))


# ---------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class StyleCase:
    """A model, its plan (from the (colwise, rowwise) style classes) and its input.

    ``x_shard``: the input is this rank's shard (drawn per rank), else the same on every rank;
    ``y_shard`` likewise for the output's gradient. ``warnings``: how many NotOverlappedWarnings
    fo-tune's plan gives, when it is applied and in its first run."""

    model: Callable[[int], nn.Module]
    plan: Callable[[tuple[type, type]], dict]
    x_shape: Callable[[int], tuple[int, ...]]
    x_shard: bool
    y_shard: bool
    ops: frozenset[str] = frozenset()  # the collectives fo-tune's ops run, forward and backward
    warnings: int = 0
    tokens: int = 0  # > 0: an integer input below this
    # fo-tune's copy through parallelize_linears(model, linears, sequence_parallel=...) instead
    linears: dict[str, str] | None = None
    sequence_parallel: bool = False


def _mlp_plan(sp_dim: int | None, bias: bool = True) -> StyleCase:
    act = Replicate() if sp_dim is None else Shard(sp_dim)
    return StyleCase(
        model=lambda w: MLP(8, 4 * w, bias),
        plan=lambda s: {"up": s[0](input_layouts=act), "down": s[1](output_layouts=act)},
        x_shape=lambda w: (4, 3, 8) if sp_dim is None else (2, 3, 8),
        x_shard=sp_dim is not None,
        y_shard=sp_dim is not None,
        ops=AR if sp_dim is None else AG_RS,
    )


AR, AG_RS = frozenset({"all_reduce"}), frozenset({"all_gather", "reduce_scatter"})
CASES: dict[str, StyleCase] = {
    "mlp": _mlp_plan(None),
    "mlp_sp": _mlp_plan(0),
    "mlp_sp_seq": _mlp_plan(1, bias=False),
    "block": StyleCase(
        model=lambda w: Block(8, 6 * w),
        plan=lambda s: {
            "norm": torch_tp.SequenceParallel(),
            "ffn": torch_tp.PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "ffn.w1": s[0](),
            "ffn.w3": s[0](),
            "ffn.w2": s[1](output_layouts=Shard(1)),
        },
        x_shape=lambda w: (2, 2, 8),
        x_shard=True,
        y_shard=True,
        ops=AG_RS,
    ),
    "dtensor_out": StyleCase(
        model=lambda w: MLP(8, 2 * w),
        plan=lambda s: {
            "up": s[0](use_local_output=False),
            "down": s[1](use_local_output=False),
        },
        x_shape=lambda w: (5, 8),
        x_shard=False,
        y_shard=False,
        ops=AR,
    ),
    # a rowwise input sharded on its features named from the front (Shard(2) of 3 dims: Shard(-1))
    "row_in_dim": StyleCase(
        model=lambda w: MLP(8, 2 * w),
        plan=lambda s: {"up": s[0](), "down": s[1](input_layouts=Shard(2))},
        x_shape=lambda w: (2, 3, 8),
        x_shard=False,
        y_shard=False,
        ops=AR,
    ),
    # a colwise output sharded on its features named from the front (Shard(2) of 3 dims: Shard(-1)),
    # which DTensor does not redistribute: no warning
    "col_out_dim": StyleCase(
        model=lambda w: nn.Sequential(nn.Linear(8, 2 * w)),
        plan=lambda s: {"0": s[0](output_layouts=Shard(2))},
        x_shape=lambda w: (2, 3, 8),
        x_shard=False,
        y_shard=True,
        ops=AR,
    ),
    # a colwise output sharded on its sequence dim (Shard(1) of 3 dims): redistributed by DTensor,
    # one warning (from the first eager run, none from the compiled one)
    "col_out_seq": StyleCase(
        model=lambda w: nn.Sequential(nn.Linear(8, 2 * w)),
        plan=lambda s: {"0": s[0](output_layouts=Shard(1))},
        x_shape=lambda w: (2, 2 * w, 8),
        x_shard=False,
        y_shard=True,
        ops=AR,
        warnings=1,
    ),
    # (a hidden size of 6: the second colwise layer's output features divide by 2 and 3 ranks)
    "gather_out": StyleCase(
        model=lambda w: MLP(6, 2 * w, bias=False),
        plan=lambda s: {
            "up": s[0](input_layouts=Shard(0), output_layouts=Replicate()),
            "down": s[0](),
        },
        x_shape=lambda w: (1, 3, 6),
        x_shard=True,
        y_shard=True,
        ops=AG_RS | AR,
        warnings=1,
    ),
    "embedding": StyleCase(
        model=lambda w: Embed(4 * w, 6),
        plan=lambda s: {
            "tok": s[1](input_layouts=Replicate(), output_layouts=Shard(1)),
            "proj": s[0](input_layouts=Shard(1), output_layouts=Replicate()),
        },
        x_shape=lambda w: (2, 2 * w),
        x_shard=False,
        y_shard=False,
        ops=AG_RS,
        warnings=2,
        tokens=8,
    ),
    # torchtitan's plan with loss parallelism on 3-dim activations: the embedding runs as torch's
    # style (one warning), the colwise layers gather a Shard(1) DTensor, the output stays Shard(-1)
    "loss_parallel": StyleCase(
        model=lambda w: LossParallelLM(4 * w, 8, 2 * w, bias=True),
        plan=lambda s: {
            "tok": s[1](input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": torch_tp.SequenceParallel(),
            "up": s[0](input_layouts=Shard(1)),
            "down": s[1](output_layouts=Shard(1)),
            "final_norm": torch_tp.SequenceParallel(),
            "output": s[0](input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
        x_shape=lambda w: (2, 2 * w),
        x_shard=False,
        y_shard=True,
        ops=AG_RS,
        warnings=1,
        tokens=4,
    ),
    # parallelize_linears over the styles, with sequence parallelism: the plan of "mlp_sp"
    "linears_sp": StyleCase(
        model=lambda w: MLP(8, 4 * w),
        plan=lambda s: {"up": s[0](input_layouts=Shard(0)), "down": s[1](output_layouts=Shard(0))},
        x_shape=lambda w: (2, 3, 8),
        x_shard=True,
        y_shard=True,
        ops=AG_RS,
        linears={"up": "column", "do*": "row"},
        sequence_parallel=True,
    ),
    # runs as torch's style does: a float64 model (at apply time), rows that do not divide by the
    # world size (at run time), an input sharded on its features
    "float64": StyleCase(
        model=lambda w: MLP(8, 2 * w).double(),
        plan=lambda s: {"up": s[0](use_local_output=False), "down": s[1]()},
        x_shape=lambda w: (3, 8),
        x_shard=False,
        y_shard=False,
        warnings=2,
    ),
    "uneven_rows": StyleCase(
        model=lambda w: MLP(8, 2 * w),
        plan=lambda s: {"up": s[0](), "down": s[1](output_layouts=Shard(0))},
        x_shape=lambda w: (2 * w + 1, 8),
        x_shard=False,
        y_shard=True,
        ops=AR,
        warnings=1,
    ),
    # a sequence of 5 that does not divide by the world size, as DTensor shards it (unevenly) after
    # a SequenceParallel norm: DTensor gathers it, and the output is reduce-scattered by DTensor
    "uneven_seq": StyleCase(
        model=lambda w: Wrapped(Block(8, 2 * w)),
        plan=lambda s: {
            "inner": torch_tp.PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)
            ),
            "inner.norm": torch_tp.SequenceParallel(),
            "inner.ffn.w1": s[0](input_layouts=Shard(1)),
            "inner.ffn.w3": s[0](input_layouts=Shard(1)),
            "inner.ffn.w2": s[1](output_layouts=Shard(1), use_local_output=False),
        },
        x_shape=lambda w: (2, 5, 8),
        x_shard=False,
        y_shard=True,
        warnings=3,
    ),
    "features_in": StyleCase(
        model=lambda w: nn.Sequential(nn.Linear(4 * w, 5 * w)),
        plan=lambda s: {"0": s[0](input_layouts=Shard(-1))},
        x_shape=lambda w: (3, 4),
        x_shard=True,
        y_shard=True,
        warnings=1,
    ),
    # the features named from the front (Shard(2) of a 3-dim input: seen at run time), gathered by
    # DTensor as torch's style does
    "features_in_dim": StyleCase(
        model=lambda w: nn.Sequential(nn.Linear(4 * w, 5 * w)),
        plan=lambda s: {"0": s[0](input_layouts=Shard(2))},
        x_shape=lambda w: (2, 3, 4),
        x_shard=True,
        y_shard=True,
        warnings=1,
    ),
    # features that do not divide by the world size, the output a DTensor: the replicated input's
    # gradient is all-reduced as torch's style does (each rank's GEMM of dy would have another K)
    "uneven_features": StyleCase(
        model=lambda w: nn.Sequential(nn.Linear(6, 2 * w + 1)),
        plan=lambda s: {"0": s[0](use_local_output=False)},
        x_shape=lambda w: (2, 6),
        x_shard=False,
        y_shard=True,
        warnings=1,
    ),
    # fewer output features than ranks (a one-logit head): a rank holds no feature, and the
    # replicated input's gradient is all-reduced as torch's style does it (it raised on that rank
    # while the others waited in the all-reduce)
    "head": StyleCase(
        model=lambda w: nn.Sequential(nn.Linear(8, 1)),
        plan=lambda s: {"0": s[0]()},
        x_shape=lambda w: (3, 8),
        x_shard=False,
        y_shard=True,
        warnings=1,
    ),
    # the inner features do not divide by the world size (the colwise output a DTensor, as torch's
    # styles need then): the sequence-parallel gather and the row-parallel GEMMs run as torch's
    # styles do (each rank's local N or K would differ)
    "uneven_inner_sp": StyleCase(
        model=lambda w: MLP(8, 2 * w + 1),
        plan=lambda s: {
            "up": s[0](input_layouts=Shard(0), use_local_output=False),
            "down": s[1](output_layouts=Shard(0)),
        },
        x_shape=lambda w: (2, 3, 8),
        x_shard=True,
        y_shard=True,
        warnings=2,
        ops=frozenset(),
    ),
    "uneven_inner": StyleCase(
        model=lambda w: MLP(8, 2 * w + 1),
        plan=lambda s: {"up": s[0](use_local_output=False), "down": s[1]()},
        x_shape=lambda w: (3, 8),
        x_shard=False,
        y_shard=False,
        warnings=2,
    ),
}


def _mesh(ctx) -> DeviceMesh:
    return DeviceMesh.from_group(dist.group.WORLD, ctx.device.type)


def _input(case: StyleCase, rank: int, world: int, shape_seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(shape_seed * 131 + (rank if case.x_shard else 0))
    if case.tokens:
        return torch.randint(0, case.tokens, case.x_shape(world), generator=gen)
    return torch.randn(case.x_shape(world), generator=gen)


def _run(model: nn.Module, x: torch.Tensor, rank: int, y_shard: bool, params: nn.Module) -> dict[str, object]:
    """Forward and backward of ``model`` (``params``: the module that holds its parameters)."""
    for p in params.parameters():
        p.grad = None
    x = x.clone().requires_grad_(x.is_floating_point())
    y = model(x)
    local = y.to_local() if isinstance(y, DTensor) else y
    gen = torch.Generator().manual_seed(977 + (rank if y_shard else 0))
    dy = torch.randn(local.shape, generator=gen).to(local.dtype)
    (local * dy).sum().backward()
    return {
        "y": y.detach(),
        "y_placements": (tuple(y.placements), tuple(y.shape)) if isinstance(y, DTensor) else None,
        "dx": x.grad,
        "grads": {n: p.grad for n, p in params.named_parameters()},
    }


def _placements(model: nn.Module) -> dict[str, tuple]:
    return {n: tuple(p.placements) if isinstance(p, DTensor) else None for n, p in model.named_parameters()}


@contextlib.contextmanager
def recorded_collectives() -> Iterator[list[str]]:
    """The collective of every fo-tune op call made inside (direct and through the custom ops)."""
    seen: list[str] = []
    real = execute_mod.execute

    def recording(collective, *args, **kwargs):
        seen.append(collective)
        return real(collective, *args, **kwargs)

    execute_mod.execute, overlap_mod.execute = recording, recording
    try:
        yield seen
    finally:
        execute_mod.execute, overlap_mod.execute = real, real


def style_case(ctx, name: str, backends: list[str | None]) -> dict[str, object]:
    """One case: fo-tune's styles against torch's, eagerly and with each torch.compile backend."""
    case = CASES[name]
    rank, world = ctx.rank, ctx.world_size
    mesh = _mesh(ctx)
    torch.manual_seed(3)
    full = case.model(world)
    ref, ours = copy.deepcopy(full), copy.deepcopy(full)
    x = _input(case, rank, world, 1)
    if x.is_floating_point():
        x = x.to(next(full.parameters()).dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_tp.parallelize_module(ref, mesh, case.plan(TORCH))
        want = _run(ref, x, rank, case.y_shard, ref)
    out: dict[str, object] = {"runs": []}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if case.linears is None:
            torch_tp.parallelize_module(ours, mesh, case.plan(FO))
        else:
            fo_tp.parallelize_linears(ours, case.linears, sequence_parallel=case.sequence_parallel)
        for backend in backends:
            torch._dynamo.reset()
            model = ours if backend is None else torch.compile(ours, backend=backend, fullgraph=True)
            with recorded_collectives() as ops:
                got = _run(model, x, rank, case.y_shard, ours)
            errs = {"y": rel(got["y"], want["y"])}
            if want["dx"] is not None:
                errs["dx"] = rel(got["dx"], want["dx"])
            for n, g in want["grads"].items():
                errs[f"d.{n}"] = rel(got["grads"][n], g)
            same = got["y_placements"] == want["y_placements"] and all(
                type(got["grads"][n]) is type(g) and got["grads"][n].placements == g.placements
                for n, g in want["grads"].items()
                if isinstance(g, DTensor)
            )
            out["runs"].append({"backend": backend, "errs": errs, "same_placements": same, "ops": set(ops)})
    out["warnings"] = [str(w.message) for w in seen if issubclass(w.category, NotOverlappedWarning)]
    out["placements_equal"] = _placements(ref) == _placements(ours)
    out["params_equal"] = all(
        torch.equal(p.to_local(), q.to_local())
        for p, q in zip(ref.parameters(), ours.parameters(), strict=True)
    )
    return out


def style_cases(ctx, payload: dict[str, list[str | None]]) -> dict[str, dict]:
    """Every case named in ``payload`` (name -> torch.compile backends, None for eager)."""
    return {name: style_case(ctx, name, backends) for name, backends in payload.items()}


def suite(ctx, parts: dict[str, tuple[str, object]]) -> dict[str, object]:
    """Several rank functions of this module in one start of the ranks: name -> (function, payload)."""
    return {name: globals()[fn](ctx, payload) for name, (fn, payload) in parts.items()}


# ---------------------------------------------------------------------------------- fused ops
def fused_ops(ctx, compiled: bool) -> dict[str, float]:
    """fo_kernels.symm_mem against torch's reference implementations of the same ops (what
    torch.ops.symm_mem computes; its own kernels are CUDA-only), name -> relative error, the
    gradients of the overlapped path against those of torch's path through autograd collectives,
    and with ``compiled`` both functions under torch.compile(fullgraph=True) against eager."""
    from torch.distributed import _symmetric_memory as torch_symm

    from fo_kernels import symm_mem

    rank, world = ctx.rank, ctx.world_size
    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(40 + rank)
    errs: dict[str, float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for shape, gather_dim in (
            ((3, 8), 0),
            ((2, 3, 8), 1),
            ((2, 3, 8), 0),
            ((2, 3, 4), 2),
            ((2, 3, 4), -1),
        ):
            a = torch.randn(shape, generator=gen)
            k = a.shape[-1] * (world if gather_dim in (-1, len(shape) - 1) else 1)
            bs = [torch.randn(k, 5, generator=gen), torch.randn(7, k, generator=gen).t()]
            for n_bs in (1, 2):
                for return_a in (True, False):
                    got_a, got = symm_mem.fused_all_gather_matmul(
                        a, bs[:n_bs], gather_dim, name, return_A=return_a
                    )
                    want_a, want = torch_symm._fused_all_gather_matmul_fallback(
                        a, bs[:n_bs], gather_dim, name, return_A=return_a
                    )
                    key = f"ag{shape}@{gather_dim} bs={n_bs} A={return_a}"
                    errs[key] = max(rel(g, w) for g, w in zip(got, want, strict=True))
                    errs[key + " A"] = rel(got_a, want_a) if return_a else float(got_a is not None)
                    if gather_dim == 0:  # each product its own contiguous tensor, as torch's
                        errs[key + " contiguous"] = 0.0 if all(g.is_contiguous() for g in got) else 1.0
        for shape, scatter_dim in (((2 * world, 8), 0), ((2, 3 * world, 8), 1), ((3, 2, 8), 2)):
            a = torch.randn(shape, generator=gen)
            n = 4 * world
            for b in (torch.randn(8, n, generator=gen), torch.randn(n, 8, generator=gen).t()):
                got = symm_mem.fused_matmul_reduce_scatter(a, b, "sum", scatter_dim, name)
                want = torch_symm._fused_matmul_reduce_scatter_fallback(a, b, "sum", scatter_dim, name)
                errs[f"rs{shape}@{scatter_dim}"] = rel(got, want)
                avg = symm_mem.fused_matmul_reduce_scatter(a, b, "avg", scatter_dim, name)
                errs[f"rs{shape}@{scatter_dim} avg"] = rel(avg * world, want)
                errs[f"rs{shape}@{scatter_dim} contiguous"] = 0.0 if got.is_contiguous() else 1.0
        errs.update(_fused_edges(gen, world, name))
    errs.update(_fused_grads(rank, world, name))
    if compiled:
        errs["compiled"] = _fused_compiled(rank, world, name)
    return errs


def _fused_edges(gen: torch.Generator, world: int, name: str) -> dict[str, float]:
    """Empty operands (no rows, no outputs, no features: torch's reference gives the empty or zero
    result), no Bs (the gathered A alone) and the group as a ``ProcessGroup`` (torch's reference
    takes one) against torch's reference; name -> relative error (the summed absolute difference
    where the result is empty or zero, a shape mismatch inf)."""
    from torch.distributed import _symmetric_memory as torch_symm

    from fo_kernels import symm_mem

    def err(got: torch.Tensor, want: torch.Tensor) -> float:
        if got.shape != want.shape:
            return float("inf")
        return rel(got, want) if want.abs().sum() > 0 else (got - want).abs().sum().item()

    errs = {}
    group = dist.group.WORLD
    for key, (rows, k, n) in {"rows": (0, 8, 5), "outputs": (3, 8, 0), "features": (3, 0, 5)}.items():
        a, b = torch.randn(rows, k, generator=gen), torch.randn(k, n, generator=gen)
        got_a, (got,) = symm_mem.fused_all_gather_matmul(a, [b], 0, name)
        want_a, (want,) = torch_symm._fused_all_gather_matmul_fallback(a, [b], 0, name)
        errs[f"ag empty {key}"] = max(err(got, want), err(got_a, want_a))
        a = torch.randn(rows * world, k, generator=gen)
        got = symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, name)
        errs[f"rs empty {key}"] = err(
            got, torch_symm._fused_matmul_reduce_scatter_fallback(a, b, "sum", 0, name)
        )
    a = torch.randn(3, 8, generator=gen)  # no Bs: torch's reference gathers A alone
    got_a, got = symm_mem.fused_all_gather_matmul(a, [], 0, name)
    want_a, want = torch_symm._fused_all_gather_matmul_fallback(a, [], 0, name)
    errs["ag no Bs"] = err(got_a, want_a) if got == want == [] else float("inf")
    a, b = torch.randn(2 * world, 3, 8, generator=gen), torch.randn(8, 4, generator=gen)
    # (by keyword, as torch's op schema names the arguments)
    got = symm_mem.fused_all_gather_matmul(A=a, Bs=[b], gather_dim=1, group_name=group, return_A=False)[1][0]
    errs["ag group"] = err(got, torch_symm._fused_all_gather_matmul_fallback(a, [b], 1, name)[1][0])
    got = symm_mem.fused_matmul_reduce_scatter(a, b, "avg", 0, group)
    errs["rs group"] = err(got, torch_symm._fused_matmul_reduce_scatter_fallback(a, b, "avg", 0, name))
    return errs


def _fused_compiled(rank: int, world: int, name: str) -> float:
    """Both functions in one torch.compile(fullgraph=True) block against the same block eagerly."""
    from fo_kernels import symm_mem

    def block(a: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor, b3: torch.Tensor) -> torch.Tensor:
        gathered, (y1, y2) = symm_mem.fused_all_gather_matmul(a, [b1, b2], 1, name)
        z = symm_mem.fused_matmul_reduce_scatter(y1, b3, "sum", 1, name)
        return gathered.sum() + y2.sum() + z.sum()

    gen = torch.Generator().manual_seed(80 + rank)
    args = (torch.randn(2, 3, 6, generator=gen), torch.randn(6, 4, generator=gen))
    args += (torch.randn(6, 5, generator=gen), torch.randn(4, 2, generator=gen))
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = block(*args)
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(*args)
    return rel(compiled, eager)


def _fused_grads(rank: int, world: int, name: str) -> dict[str, float]:
    """The overlapped paths' gradients against torch's path's (autograd collectives)."""
    from fo_kernels import symm_mem

    gen = torch.Generator().manual_seed(60 + rank)
    a = torch.randn(2, 2 * world, 6, generator=gen)
    b1, b2 = torch.randn(6, 4, generator=gen), torch.randn(6, 3, generator=gen)
    dy = [torch.randn(2 * world, 2 * world, n, generator=gen) for n in (4, 3)]
    da_full = torch.randn(2 * world, 2 * world, 6, generator=gen)  # the gathered A's, used too
    out = {}
    grads = []
    for fn in (symm_mem.fused_all_gather_matmul, _torch_gather):
        leaves = [t.clone().requires_grad_(True) for t in (a, b1, b2)]
        a_full, ys = fn(leaves[0], leaves[1:], 0, name)
        loss = sum((y * g).sum() for y, g in zip(ys, dy, strict=True)) + (a_full * da_full).sum()
        loss.backward()
        grads.append([t.grad for t in leaves])
    out.update({f"ag grad {i}": rel(g, w) for i, (g, w) in enumerate(zip(*grads, strict=True))})
    grads = []
    dz = torch.randn(2, 2, 4, generator=gen)  # the shard of scatter dim 1 (2 * world rows)
    for fn in (symm_mem.fused_matmul_reduce_scatter, _torch_scatter):
        leaves = [t.clone().requires_grad_(True) for t in (a, b1)]
        (fn(leaves[0], leaves[1], "sum", 1, name) * dz).sum().backward()
        grads.append([t.grad for t in leaves])
    out.update({f"rs grad {i}": rel(g, w) for i, (g, w) in enumerate(zip(*grads, strict=True))})
    return out


def _torch_gather(a, bs, d, name):
    from fo_kernels import symm_mem

    return symm_mem._gather_then_matmul(a, bs, d, name, group_size(name), True)


def _torch_scatter(a, b, op, d, name):
    from fo_kernels import symm_mem

    return symm_mem._matmul_then_reduce_scatter(a, b, op, d, name, group_size(name))


def fused_on_subgroup(ctx, ranks: tuple[int, ...]) -> dict[str, float | str]:
    """fo_kernels.symm_mem's two functions on a process group of ``ranks``, by its ranks: named by
    the group's ``group_name`` (and passed as the group, as torch's reference takes it) against
    torch's reference on the same group, gathered and scattered on dims 0 and 1, and the
    gradients (``_fused_grads``); name -> relative error. A rank outside the group gets each
    function's refusal of it ("outside ag" / "outside rs": the error's type and message)."""
    from torch.distributed import _symmetric_memory as torch_symm

    from fo_kernels import symm_mem

    group = dist.new_group(list(ranks))
    if ctx.rank not in ranks:
        a = torch.randn(2, 8)
        out = {}
        for key, call in (
            ("outside ag", lambda: symm_mem.fused_all_gather_matmul(a, [a.t()], 0, group)),
            ("outside rs", lambda: symm_mem.fused_matmul_reduce_scatter(a, a.t(), "sum", 0, group)),
        ):
            try:
                call()
                out[key] = "NO ERROR"
            except ValueError as exc:
                out[key] = f"{type(exc).__name__}: {exc}"
        return out
    rank, world, name = ranks.index(ctx.rank), len(ranks), group.group_name
    gen = torch.Generator().manual_seed(90 + rank)
    errs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = torch.randn(2, 2 * world, 8, generator=gen), torch.randn(8, 5, generator=gen)
        for d in (0, 1):
            want_a, (want,) = torch_symm._fused_all_gather_matmul_fallback(a, [b], d, name)
            for key, g in (("name", name), ("group", group)):
                got_a, (got,) = symm_mem.fused_all_gather_matmul(a, [b], d, g)
                errs[f"ag@{d} by {key}"] = max(rel(got, want), rel(got_a, want_a))
            for op in ("sum", "avg"):
                want = torch_symm._fused_matmul_reduce_scatter_fallback(a, b, op, d, name)
                errs[f"rs@{d} {op}"] = rel(symm_mem.fused_matmul_reduce_scatter(a, b, op, d, name), want)
    errs.update(_fused_grads(rank, world, name))
    return errs


# ---------------------------------------------------------------------------------- copies
def copies(ctx, _payload) -> dict[str, object]:
    """A deep copy of a model parallelized with fo-tune's styles (an EMA or reference copy), and
    the model saved whole with torch.save and loaded again, run on fo-tune's ops as the original
    does: per copy ("deepcopy", "saved"), relative error of its output, whether its modules keep
    a plan and own their parameters, the collectives it ran."""
    import io

    mesh = _mesh(ctx)
    torch.manual_seed(5)
    model = MLP(8, 2 * ctx.world_size)
    torch_tp.parallelize_module(model, mesh, {"up": FO[0](), "down": FO[1]()})
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    out = {}
    loaded = torch.load(saved, weights_only=False)
    for name, copied in (("deepcopy", copy.deepcopy(model)), ("saved", loaded)):
        x = torch.randn(3, 8)
        with warnings.catch_warnings(), recorded_collectives() as ops:
            warnings.simplefilter("ignore")
            err = rel(copied(x), model(x))
        out[name] = {
            "err": err,
            "planned": all(fo_tp.plan_of(copied.get_submodule(n)) is not None for n in ("up", "down")),
            "own_params": copied.up.weight is not model.up.weight,
            "ops": sorted(set(ops)),
        }
    return out


def meta_linears(ctx, _payload) -> dict[str, float]:
    """An MLP built on the meta device, sharded by ``parallelize_linears`` (with and without sequence
    parallelism), materialized by ``to_empty`` and given the weights of a model built on the CPU,
    against that model: per plan, relative errors of the output and of the input's gradient (the
    backward raised where the mesh was the meta device's)."""
    rank, world = ctx.rank, ctx.world_size
    out = {}
    for sp in (False, True):
        torch.manual_seed(8)
        full = MLP(8, 4 * world)
        with torch.device("meta"):
            model = MLP(8, 4 * world)
        fo_tp.parallelize_linears(model, {"up": "column", "down": "row"}, sequence_parallel=sp)
        model.to_empty(device=ctx.device)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.to_local().copy_(
                    distribute_tensor(full.get_parameter(n), p.device_mesh, p.placements).to_local()
                )
        x = torch.randn(2 * world, 3, 8, generator=torch.Generator().manual_seed(21))
        want = x.clone().requires_grad_(True)
        y_full = full(want)
        y_full.sum().backward()
        mine = (x.chunk(world)[rank] if sp else x).clone().requires_grad_(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = model(mine)
        y.sum().backward()
        key = "sequence" if sp else "replicated"
        y_want = y_full.chunk(world)[rank] if sp else y_full
        dx_want = want.grad.chunk(world)[rank] if sp else want.grad
        out[key] = rel(y, y_want)
        out[key + " dx"] = rel(mine.grad, dx_want)
    return out


# ---------------------------------------------------------------------------------- double backward
def double_backward(ctx, _payload) -> dict[str, float]:
    """A gradient of a gradient (``create_graph=True``) through a rowwise ``nn.Linear`` with
    fo-tune's style against torch's, per output layout ("Replicate", "Shard(0)"): the relative
    errors of the input's first gradient, then of the input's, weight's and bias' gradients of a
    loss on it. Each rank's loss is of its own shard of the first gradient, so the gradient of the
    all-reduced output's gradient is summed over the ranks (it was each rank's term alone)."""
    rank, world, mesh = ctx.rank, ctx.world_size, _mesh(ctx)
    torch.manual_seed(7)
    full = nn.Linear(4 * world, 6)
    x = torch.randn(2 * world, 4 * world, generator=torch.Generator().manual_seed(31))
    x = x.chunk(world, -1)[rank]
    out = {}
    for layout in (Replicate(), Shard(0)):
        runs = []
        for styles in (TORCH, FO):
            model = copy.deepcopy(full)
            torch_tp.parallelize_module(model, mesh, styles[1](output_layouts=layout))
            leaf = x.clone().requires_grad_(True)
            (dx,) = torch.autograd.grad((model(leaf) ** 2).sum(), leaf, create_graph=True)
            (dx**2).sum().backward()
            runs.append((dx.detach(), leaf.grad, model.weight.grad.to_local(), model.bias.grad.to_local()))
        for key, got, want in zip(("dx", "ddx", "dw", "db"), runs[1], runs[0], strict=True):
            out[f"{layout} {key}"] = rel(got, want)
    return out


# ---------------------------------------------------------------------------------- autocast
def autocast(ctx, _payload) -> dict[str, dict[str, object]]:
    """An MLP (replicated and sequence-parallel activations) under torch.autocast(bfloat16) with
    fo-tune's styles against torch's: per plan, the output's dtype with each, the relative errors
    of the output, the input's and the parameters' gradients, the gradients' dtypes and the
    collectives fo-tune's ops ran."""
    rank, mesh = ctx.rank, _mesh(ctx)
    out = {}
    for name, act, x_shape in (("replicated", Replicate(), (4, 6, 16)), ("sequence", Shard(1), (2, 6, 16))):
        torch.manual_seed(6)
        full = MLP(16, 8 * ctx.world_size)
        gen = torch.Generator().manual_seed(12 + (0 if isinstance(act, Replicate) else rank))
        x = torch.randn(x_shape, generator=gen)
        runs = {}
        for which, styles in (("torch", TORCH), ("fo", FO)):
            model = copy.deepcopy(full)
            plan = {"up": styles[0](input_layouts=act), "down": styles[1](output_layouts=act)}
            torch_tp.parallelize_module(model, mesh, plan)
            xi = x.clone().requires_grad_(True)
            with recorded_collectives() as ops, torch.autocast(ctx.device.type, dtype=torch.bfloat16):
                y = model(xi)
            y.float().sum().backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
            runs[which] = (y.detach(), xi.grad, grads, sorted(set(ops)))
        (y_t, dx_t, g_t, _), (y_f, dx_f, g_f, ops) = runs["torch"], runs["fo"]
        errs = {"y": rel(y_f, y_t), "dx": rel(dx_f, dx_t)}
        out[name] = {
            "dtypes": (str(y_f.dtype), str(y_t.dtype)),
            "errs": errs | {n: rel(g_f[n], g) for n, g in g_t.items()},
            "grad_dtypes_equal": all(g_f[n].dtype == g.dtype for n, g in g_t.items()),
            "ops": ops,
        }
    return out


# ---------------------------------------------------------------------------------- bad input
def bad_inputs(ctx, _payload) -> dict[str, str]:
    """Each bad call raises a ValueError subclass naming the problem before any collective;
    name -> message."""
    from fo_kernels import FoTuneError, symm_mem

    world, name = ctx.world_size, dist.group.WORLD.group_name
    mesh = _mesh(ctx)
    a, b = torch.randn(2 * world, 8), torch.randn(8, 4)
    col = torch_tp.parallelize_module(nn.Linear(8, 2 * world), mesh, fo_tp.ColwiseParallel())
    row = torch_tp.parallelize_module(nn.Linear(2 * world, 8), mesh, fo_tp.RowwiseParallel())
    # an unsharded state dict loaded with assign=True: the parameters are plain tensors again
    assigned = {}
    for kind, style, shape in (
        ("col", fo_tp.ColwiseParallel(), (8, 2 * world)),
        ("row", fo_tp.RowwiseParallel(), (2 * world, 8)),
    ):
        assigned[kind] = torch_tp.parallelize_module(nn.Linear(*shape), mesh, style)
        assigned[kind].load_state_dict(nn.Linear(*shape).state_dict(), assign=True)
    calls = {
        "col_assigned": lambda: assigned["col"](torch.randn(3, 8)),
        "row_assigned": lambda: assigned["row"](torch.randn(3, 2 * world)),
        "col_features": lambda: col(torch.randn(3, 9)),
        "row_features": lambda: row(torch.randn(3, 5)),
        "ag_k": lambda: symm_mem.fused_all_gather_matmul(a, [torch.randn(7, 4)], 0, name),
        "ag_bs_tensor": lambda: symm_mem.fused_all_gather_matmul(a, b, 0, name),
        "ag_dim": lambda: symm_mem.fused_all_gather_matmul(a, [b], 2, name),
        "ag_vector": lambda: symm_mem.fused_all_gather_matmul(torch.randn(8), [b], 0, name),
        "rs_op": lambda: symm_mem.fused_matmul_reduce_scatter(a, b, "max", 0, name),
        "rs_rows": lambda: symm_mem.fused_matmul_reduce_scatter(
            torch.randn(2 * world + 1, 8), b, "sum", 0, name
        ),
        "rs_dim": lambda: symm_mem.fused_matmul_reduce_scatter(a, b, "sum", -3, name),
        "rs_group": lambda: symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, "no-such-group"),
        "twice": lambda: torch_tp.parallelize_module(col, mesh, fo_tp.ColwiseParallel()),
        "twice_after_torch": lambda: torch_tp.parallelize_module(
            torch_tp.parallelize_module(nn.Linear(2 * world, 8), mesh, torch_tp.RowwiseParallel()),
            mesh,
            fo_tp.RowwiseParallel(),
        ),
        "ag_dtype": lambda: symm_mem.fused_all_gather_matmul(a, [b, b.bfloat16()], 0, name),
        "rs_dtype": lambda: symm_mem.fused_matmul_reduce_scatter(a, b.double(), "sum", 0, name),
        "ag_group_type": lambda: symm_mem.fused_all_gather_matmul(a, [b], 0, 0),
        # fp8 operands: these signatures take no scales (torch.matmul has no fp8 kernel either)
        "ag_fp8": lambda: symm_mem.fused_all_gather_matmul(
            torch.randn(2, 3, 16).to(torch.float8_e4m3fn),
            [torch.randn(16, 16).to(torch.float8_e4m3fn)],
            1,
            name,
        ),
        "rs_e5m2": lambda: symm_mem.fused_matmul_reduce_scatter(
            torch.randn(2 * world, 16).to(torch.float8_e5m2),
            torch.randn(16, 16).to(torch.float8_e5m2),
            "sum",
            0,
            name,
        ),
        "plan_unknown": lambda: fo_tp.parallelize_linears(MLP(4, 8), {"nope": "column"}),
        "install_plain": lambda: fo_tp.install(nn.Linear(4, 4), mesh, fo_tp.ColwiseParallel()),
        "install_style": lambda: fo_tp.install(col, mesh, torch_tp.ColwiseParallel()),
        "install_embedding": lambda: fo_tp.install(nn.Embedding(4, 4), mesh, fo_tp.RowwiseParallel()),
        "plan_kind": lambda: fo_tp.parallelize_linears(MLP(4, 8), {"up": "diagonal"}),
    }
    msgs = {}
    for key, call in calls.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                call()
        except FoTuneError as exc:
            assert isinstance(exc, ValueError), exc
            msgs[key] = f"{type(exc).__name__}: {exc}"
        else:
            msgs[key] = "NO ERROR"
    dist.barrier()  # every rank is still in step: no collective was left half-started
    return msgs


# A layout naming a dim a 2-dim (tokens, features) activation does not have, per case: (index of
# the style in TORCH / FO, the style's arguments).
UNKNOWN_DIMS = {
    "col input Shard(2)": (0, {"input_layouts": Shard(2)}),
    "col output Shard(3)": (0, {"output_layouts": Shard(3)}),
    "row input Shard(3)": (1, {"input_layouts": Shard(3)}),
    "row output Shard(2)": (1, {"output_layouts": Shard(2)}),
}


def _outcome(model: nn.Module, x: torch.Tensor) -> tuple[str, int]:
    """(the type of the error ``model(x)`` raises, or "ran"; the NotOverlappedWarnings it gives)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            model(x)
            outcome = "ran"
        except Exception as exc:  # (torch's error, whichever type it is)
            outcome = type(exc).__name__
    return outcome, sum(issubclass(w.category, NotOverlappedWarning) for w in seen)


def unknown_dims(ctx, _payload) -> dict[str, dict[str, object]]:
    """Each ``UNKNOWN_DIMS`` style on an ``nn.Linear`` called with a 2-dim input, with torch's style
    and with fo-tune's: per case and style, the type of the error it raises (or "ran"), and the
    NotOverlappedWarnings fo-tune's gives. torch's style refuses a dim the input does not have;
    fo-tune's raises the same error rather than take the dim modulo the input's dims (Shard(2) of
    2 dims as Shard(0)) and gather or scatter another dim."""
    mesh, world = _mesh(ctx), ctx.world_size
    features = 4 * world
    out = {}
    for key, (kind, args) in UNKNOWN_DIMS.items():
        # (a row input of the default layout is this rank's shard of the features)
        local = features // world if kind == 1 and "input_layouts" not in args else features
        x = torch.randn(2 * world, local, generator=torch.Generator().manual_seed(ctx.rank))
        got = {}
        for which, styles in (("torch", TORCH), ("fo", FO)):
            model = nn.Linear(features, features)
            torch_tp.parallelize_module(model, mesh, styles[kind](**args))
            got[which], got[which + " warnings"] = _outcome(model, x)
        out[key] = got
    return out


def bias_of_another_dtype(ctx, _payload) -> dict[str, dict[str, object]]:
    """A bfloat16 ``nn.Linear`` whose bias is float32, called with a bfloat16 input outside
    autocast, per kind ("col", "row"), with torch's style and with fo-tune's: the type of the error
    each raises (``F.linear`` refuses the bias; fo-tune's ops took it, cast to the output's dtype)
    or "ran", and the NotOverlappedWarnings fo-tune's gives."""
    mesh, world = _mesh(ctx), ctx.world_size
    features = 4 * world
    out = {}
    for kind, key in enumerate(("col", "row")):
        local = features // world if kind == 1 else features
        x = torch.randn(2 * world, local, generator=torch.Generator().manual_seed(ctx.rank)).bfloat16()
        got = {}
        for which, styles in (("torch", TORCH), ("fo", FO)):
            model = nn.Linear(features, features).bfloat16()
            model.bias.data = model.bias.data.float()
            torch_tp.parallelize_module(model, mesh, styles[kind]())
            got[which], got[which + " warnings"] = _outcome(model, x)
        out[f"{key} bias float32"] = got
    return out


# ---------------------------------------------------------------------------------- FSDP2
# The training steps of fsdp2_tp's torchtitan-shaped composition, the micro-batches accumulated
# before each AdamW step, and a gradient-norm cap it reaches (so clip_grad_norm_ scales).
FSDP_STEPS, FSDP_MICRO, FSDP_CLIP = 2, 2, 0.05
# fsdp2_tp's (batch, sequence, hidden) and the per-rank sequence lengths of its eval-mode calls.
FSDP_SHAPE, EVAL_SEQS = (2, 8, 8), (4, 1, 3)


def fsdp2_tp(ctx, checkpoint_dir: str) -> dict[str, object]:
    """FSDP2 over fo-tune's styles on a 2 x 2 (dp, tp) mesh against FSDP2 over torch's: the
    output, every gradient (this rank's shard) and the parameters' 2-D placements agree, and
    fo-tune's ops ran. Then the compositions torchtitan trains with (``_fsdp2_training``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (2, ctx.world_size // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(4)
    full = MLP(8, 4 * mesh["tp"].size())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(9 + mesh["dp"].get_local_rank()))
    runs = {}
    for name, styles in (("torch", TORCH), ("fo", FO)):
        model = copy.deepcopy(full)
        torch_tp.parallelize_module(model, mesh["tp"], {"up": styles[0](), "down": styles[1]()})
        fully_shard(model, mesh=mesh["dp"])
        with warnings.catch_warnings(), recorded_collectives() as ops:
            warnings.simplefilter("ignore")
            y = model(x)
            y.sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        runs[name] = (y.detach(), grads, _placements(model), sorted(set(ops)))
    (y_t, g_t, p_t, _), (y_f, g_f, p_f, ops_f) = runs["torch"], runs["fo"]
    return {
        "errs": {"y": rel(y_f, y_t), **{n: rel(g_f[n], g) for n, g in g_t.items()}},
        "placements_equal": p_f == p_t,
        "ops": ops_f,
        "training": _fsdp2_training(mesh, checkpoint_dir),
    }


def styles_on_mesh_dims(ctx, _payload) -> dict[str, dict[str, object]]:
    """fo-tune's styles against torch's on each dim of a 2 x 2 (dp, tp) mesh alone (no FSDP): the
    "dp" dim's groups, ranks (0, 2) and (1, 3), are not contiguous and the two run at once; with
    and without sequence parallelism, eagerly. Per "dim sp=...": the relative errors of the output
    and every gradient (this rank's shard), whether the placements are torch's, the ops run."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (2, ctx.world_size // 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for dim, other in (("dp", "tp"), ("tp", "dp")):
        sub = mesh[dim]
        torch.manual_seed(4)
        full = MLP(8, 4 * sub.size())
        # one input per group (the other dim's coordinate), its rows split for sequence parallelism
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(9 + mesh[other].get_local_rank()))
        for sp in (False, True):
            act = Shard(0) if sp else Replicate()
            xi = x.chunk(sub.size())[sub.get_local_rank()] if sp else x
            runs = {}
            for name, styles in (("torch", TORCH), ("fo", FO)):
                model = copy.deepcopy(full)
                plan = {"up": styles[0](input_layouts=act), "down": styles[1](output_layouts=act)}
                torch_tp.parallelize_module(model, sub, plan)
                leaf = xi.clone().requires_grad_(True)
                with warnings.catch_warnings(), recorded_collectives() as ops:
                    warnings.simplefilter("ignore")
                    y = model(leaf)
                    y.sum().backward()
                grads = {n: p.grad for n, p in model.named_parameters()}
                runs[name] = (y.detach(), leaf.grad, grads, _placements(model), sorted(set(ops)))
            (y_t, dx_t, g_t, p_t, _), (y_f, dx_f, g_f, p_f, ops_f) = runs["torch"], runs["fo"]
            errs = {"y": rel(y_f, y_t), "dx": rel(dx_f, dx_t), **{n: rel(g_f[n], g) for n, g in g_t.items()}}
            out[f"{dim} sp={sp}"] = {"errs": errs, "placements_equal": p_f == p_t, "ops": ops_f}
    return out


def _fsdp2_blocks(styles: tuple[type, type], mesh: DeviceMesh, seed: int) -> nn.Module:
    """Two ``Block``s with torchtitan's sequence-parallel plan on mesh["tp"] (the norm on the
    Shard(1) sequence, the FFN fed the gathered activation, w2 reduce-scattered back to Shard(1)),
    the first activation-checkpointed (non-reentrant), each block and the root ``fully_shard`` over
    mesh["dp"], the second not resharded after its forward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    hidden = FSDP_SHAPE[-1]
    model = nn.Sequential(*(Block(hidden, 4 * mesh["tp"].size()) for _ in range(2)))
    for block in model:
        gathered = torch_tp.PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        torch_tp.parallelize_module(block, mesh["tp"], {
            "norm": torch_tp.SequenceParallel(), "ffn": gathered,
            "ffn.w1": styles[0](), "ffn.w3": styles[0](), "ffn.w2": styles[1](output_layouts=Shard(1)),
        })  # fmt: skip
    model[0] = checkpoint_wrapper(model[0])
    for i, block in enumerate(model):
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=i == 0)
    return fully_shard(model, mesh=mesh["dp"])


def _fsdp2_batch(mesh: DeviceMesh, seed: int, seq: int = FSDP_SHAPE[1]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target): this rank's sequence shard of its dp rank's batch."""
    gen = torch.Generator().manual_seed(seed * 7 + mesh["dp"].get_local_rank())
    x, target = (torch.randn(FSDP_SHAPE[0], seq, FSDP_SHAPE[2], generator=gen) for _ in range(2))
    tp, tp_rank = mesh["tp"].size(), mesh["tp"].get_local_rank()
    return x.chunk(tp, dim=1)[tp_rank], target.chunk(tp, dim=1)[tp_rank]


def _fsdp2_train(model: nn.Module, mesh: DeviceMesh) -> list[float]:
    """AdamW steps of accumulated micro-batches, the gradients clipped by ``clip_grad_norm_`` over
    the 2-D DTensors: every micro-batch's loss and every step's total norm."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []
    for step in range(FSDP_STEPS):
        for micro in range(FSDP_MICRO):
            x, target = _fsdp2_batch(mesh, step * FSDP_MICRO + micro)
            loss = F.mse_loss(model(x), target)
            loss.backward()
            seen.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), FSDP_CLIP)
        seen.append(norm.full_tensor().item())
        opt.step()
        opt.zero_grad()
    return seen


def _fsdp2_eval(model: nn.Module, mesh: DeviceMesh) -> list[torch.Tensor]:
    """``model.eval()`` outputs under ``torch.no_grad()`` for sequences of changing lengths."""
    model.eval()
    with torch.no_grad():
        return [model(_fsdp2_batch(mesh, 99, seq * mesh["tp"].size())[0]) for seq in EVAL_SEQS]


def _fsdp2_training(mesh: DeviceMesh, checkpoint_dir: str) -> dict[str, object]:
    """torchtitan's composition (``_fsdp2_blocks``) trained with torch's styles and with fo-tune's:
    the relative errors of the losses and norms and of the final parameters; then torch's model
    saved with ``torch.distributed.checkpoint`` and loaded into a fresh fo-tune model: the errors of
    its eval-mode outputs against torch's model; and the collectives fo-tune's ops ran."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = _fsdp2_blocks(TORCH, mesh, seed=6)
        want = _fsdp2_train(ref, mesh)
        ours = _fsdp2_blocks(FO, mesh, seed=6)
        with recorded_collectives() as ops:
            got = _fsdp2_train(ours, mesh)
        errs = {"losses": rel(torch.tensor(got), torch.tensor(want))}
        for (n, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
            errs[n] = rel(q.full_tensor(), p.full_tensor())
        dcp.save(ref.state_dict(), checkpoint_id=checkpoint_dir)
        loaded = _fsdp2_blocks(FO, mesh, seed=7)
        state = loaded.state_dict()
        dcp.load(state, checkpoint_id=checkpoint_dir)
        loaded.load_state_dict(state)
        for i, (y, y_ref) in enumerate(zip(_fsdp2_eval(loaded, mesh), _fsdp2_eval(ref, mesh), strict=True)):
            errs[f"loaded eval {EVAL_SEQS[i]}"] = rel(y, y_ref)
    return {"errs": errs, "ops": sorted(set(ops))}
