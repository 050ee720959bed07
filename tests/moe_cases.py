"""Rank functions for the expert-parallel FFN tests (spawned gloo processes import this by name).

Every rank draws every rank's tokens, routing and output cotangent from seeds, and the global
experts from one seed, so each rank builds the unsharded float64 reference (forward, and the
gradients of sum over ranks of <y_r, g_r>) with no collective of its own.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fo_kernels import MoeProblem, MoeSchedule, expert_parallel_ffn
from fo_kernels.schedule import torch_dtype

ROOT = Path(__file__).resolve().parents[1]  # this checkout
# Relative error bounds against the float64 reference, per dtype (fp32: the 1e-4).
TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}
ROUTINGS = ("random", "distinct", "skewed", "duplicates")
# ``_tiny_call``'s x, w13 and w2 shapes (the float8 bad call makes all three float8).
FP8_OPERANDS = {"x": (3, 8), "w13": (2, 8, 6), "w2": (2, 3, 8)}


@dataclass(frozen=True)
class MoeCase:
    """One call on every rank: ``tokens[r]`` tokens on rank r."""

    tokens: tuple[int, ...]
    hidden: int
    inter: int
    experts: int  # E_local
    top_k: int
    dtype: str = "float32"
    routing: str = "random"
    seed: int = 0
    backward: bool = True
    compiled: bool = False
    schedule: dict | None = None


def global_ids(case: MoeCase, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s (T, k) expert ids: ``random`` draws with repeats, ``distinct`` k different
    experts per token (as topk), ``skewed`` only the first rank's experts and one other,
    ``duplicates`` every token's slots on one expert of a few."""
    gen = torch.Generator().manual_seed(case.seed * 7919 + rank * 31 + 1)
    t, k, e = case.tokens[rank], case.top_k, world * case.experts
    if case.routing == "random":
        return torch.randint(0, e, (t, k), generator=gen)
    if case.routing == "distinct":
        return torch.rand(t, e, generator=gen).topk(min(k, e), dim=1).indices[:, :k]
    if case.routing == "skewed":
        pool = torch.tensor([0, e - 1])
        return pool[torch.randint(0, 2, (t, k), generator=gen)]
    pick = torch.randint(0, min(e, 3), (t, 1), generator=gen) * (e // 3 or 1)
    return pick.clamp(max=e - 1).expand(t, k).contiguous()


def inputs(case: MoeCase, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s x, ids, weights, cotangent g (float64), and the global w13, w2."""
    gen = torch.Generator().manual_seed(case.seed * 104729 + rank)
    t, h, k = case.tokens[rank], case.hidden, case.top_k
    x = torch.randn(t, h, generator=gen, dtype=torch.float64)
    w = torch.rand(t, k, generator=gen, dtype=torch.float64) + 0.1
    g = torch.randn(t, h, generator=gen, dtype=torch.float64)
    wgen = torch.Generator().manual_seed(case.seed * 15485863 + 7)
    e = world * case.experts
    w13 = torch.randn(e, h, 2 * case.inter, generator=wgen, dtype=torch.float64) / h**0.5
    w2 = torch.randn(e, case.inter, h, generator=wgen, dtype=torch.float64) / case.inter**0.5
    return dict(x=x, ids=global_ids(case, rank, world), w=w, g=g, w13=w13, w2=w2)


def reference_ffn(x, ids, w, w13, w2) -> torch.Tensor:
    """The unsharded FFN, a loop over tokens and slots (the issue's formula, term by term)."""
    inter = w13.shape[2] // 2
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = x[t] @ w13[e]
            acc = acc + w[t, j] * ((F.silu(gu[:inter]) * gu[inter:]) @ w2[e])
        rows.append(acc)
    return torch.stack(rows) if rows else x.new_zeros(x.shape)


def reference(case: MoeCase, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s y, dx, dw and its shard of dw13, dw2, in float64."""
    w13 = w2 = None
    total = 0.0
    mine = {}
    for r in range(world):
        d = inputs(case, r, world)
        if w13 is None:
            w13, w2 = d["w13"].requires_grad_(), d["w2"].requires_grad_()
        x, w = d["x"].requires_grad_(), d["w"].requires_grad_()
        y = reference_ffn(x, d["ids"], w, w13, w2)
        total = total + (y * d["g"]).sum()
        if r == rank:
            mine = dict(y=y.detach(), x=x, w=w)
    if isinstance(total, torch.Tensor) and total.requires_grad:
        total.backward()
    lo, hi = rank * case.experts, (rank + 1) * case.experts
    x, w = mine["x"], mine["w"]
    return dict(
        y=mine["y"],
        dx=x.grad if x.grad is not None else torch.zeros_like(x),  # (no tokens: no graph)
        dw=w.grad if w.grad is not None else torch.zeros_like(w),
        dw13=w13.grad[lo:hi] if w13.grad is not None else torch.zeros_like(w13[lo:hi]),
        dw2=w2.grad[lo:hi] if w2.grad is not None else torch.zeros_like(w2[lo:hi]),
    )


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if got.shape != ref.shape:
        return float("inf")
    diff = (got.double() - ref).norm().item()
    err = diff / max(ref.norm().item(), 1e-30) if ref.numel() else 0.0
    return err if err == err else float("inf")  # NaN is a failure


def ffn_call(case: MoeCase, group=None):
    schedule = MoeSchedule.from_dict(case.schedule) if case.schedule is not None else None

    def call(x, ids, w, w13, w2):
        return expert_parallel_ffn(x, ids, w, w13, w2, group=group, schedule=schedule)

    if case.compiled:
        return torch.compile(call, fullgraph=True, backend="aot_eager", dynamic=False)
    return call


def run_case(case: MoeCase, rank: int, world: int, group=None, device: str = "cpu") -> dict[str, float]:
    """This rank's relative errors of y (and the gradients) against the float64 reference."""
    d = inputs(case, rank, world)
    dtype = torch_dtype(case.dtype)
    lo, hi = rank * case.experts, (rank + 1) * case.experts

    def leaf(t: torch.Tensor, to: torch.dtype) -> torch.Tensor:
        return t.to(device=device, dtype=to).requires_grad_(case.backward)

    x, w = leaf(d["x"], dtype), leaf(d["w"], torch.float32)
    w13, w2 = leaf(d["w13"][lo:hi], dtype), leaf(d["w2"][lo:hi], dtype)
    y = ffn_call(case, group)(x, d["ids"].to(device), w, w13, w2)
    ref = reference(case, rank, world)
    errs = {"y": rel_err(y.cpu(), ref["y"]), "y_dtype": float(y.dtype != dtype)}
    if case.backward:
        (y.double() * d["g"].to(device)).sum().backward()
        for name, t in (("dx", x), ("dw", w), ("dw13", w13), ("dw2", w2)):
            errs[name] = rel_err(t.grad.cpu(), ref[name]) if t.grad is not None else float("inf")
    return errs


def run_cases(ctx, cases: list[MoeCase]) -> list[dict[str, float]]:
    """Every case on this rank of the default group, on its device."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [run_case(c, ctx.rank, ctx.world_size, device=ctx.device) for c in cases]


def run_groups(
    ctx, payload: tuple[list[tuple[tuple[int, ...], list[MoeCase]]], tuple[str, ...]]
) -> list[dict]:
    """For each (ranks, cases) of ``payload[0]``: a process group of those ranks; its members run
    the cases (results tagged with the group), then the bad calls (``bad_inputs``); a rank
    outside calls with the group, eagerly and compiled, and must get a ``GroupError``. Then
    ``examples/moe_block.py``'s check of each model in ``payload[1]`` on every rank (the default
    group)."""
    import torch.distributed as dist

    groups, models = payload
    out = []
    for ranks, cases in groups:
        group = dist.new_group(list(ranks))
        if ctx.rank not in ranks:
            out.append({"ranks": ranks, "outside": _message(lambda g=group: _tiny_call(g))})
            compiled = torch.compile(_tiny_call, fullgraph=True, backend="aot_eager")
            out.append({"ranks": ranks, "outside": _message(lambda g=group, c=compiled: c(g))})
            continue
        rank, world = ranks.index(ctx.rank), len(ranks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for c in cases:
                out.append({"ranks": ranks, "case": c, "errs": run_case(c, rank, world, group)})
            out.append({"ranks": ranks, "bad": bad_inputs(group, rank, world)})
            out.append({"ranks": ranks, "copied": copied_module(group, rank)})
            if world == SHARED_GROUP_SIZE:
                out.append({"ranks": ranks, "shared": shared_tokens_model(group)})
    example = _example()
    for kind in models:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out.append({"example": kind, "errors": example.check(kind, ctx.rank, ctx.world_size, ctx.device)})
    return out


def copied_module(group, rank: int) -> float | str:
    """``copy.deepcopy`` of an ``ExpertParallelExperts`` over ``group`` (a process group cannot be
    copied), and the module saved whole with torch.save and loaded again (nor pickled): each copy
    runs over the same group, its weights its own; the larger relative difference of a copy's
    output from the module's (0 when the copies are right), else what went wrong."""
    import copy
    import io

    from fo_kernels import ExpertParallelExperts

    world = dist.get_world_size(group)
    gen = torch.Generator().manual_seed(rank)
    module = ExpertParallelExperts(
        torch.randn(2, 8, 6, generator=gen),
        torch.randn(2, 3, 8, generator=gen),
        num_experts=2 * world,
        group=group,
    )
    buffer = io.BytesIO()
    try:
        copies = [copy.deepcopy(module)]
        torch.save(module, buffer)
        buffer.seek(0)
        copies.append(torch.load(buffer, weights_only=False))
    except TypeError as exc:  # (reported: raised alike on every rank, before any collective)
        return f"{type(exc).__name__}: {exc}"
    if any(c.group is not group or c.w13.data_ptr() == module.w13.data_ptr() for c in copies):
        return "a copy has another group, or shares the module's weights"
    x, ids, w = (
        torch.randn(3, 8, generator=gen),
        torch.randint(0, 2 * world, (3, 2), generator=gen),
        torch.rand(3, 2),
    )
    with torch.no_grad():
        want = module(x, ids, w).double()
        return max(rel_err(c(x, ids, w), want) for c in copies)


def import_transformers() -> None:
    """Import transformers with this checkout's root off ``sys.path``: under ``python -m pytest``
    from the root, its ``kernels/`` folder (fo_kernels' source) would shadow the PyPI package
    ``kernels`` that transformers (>= 5) imports, the name clash that makes the runtime
    ``fo_kernels`` (README, "Using the runtime")."""
    import os
    import sys

    root = str(ROOT)
    shadow = sys.modules.get("kernels")
    if shadow is not None and str(getattr(shadow, "__file__", "")).startswith(root):
        for name in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
            del sys.modules[name]
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != root]
    try:
        import transformers.integrations.hub_kernels  # noqa: F401 - (imports kernels while it can)
    finally:
        sys.path[:] = saved


def _example():
    """``examples/moe_block.py`` as a module (transformers imported first, ``import_transformers``)."""
    from cli_checks import load_example

    import_transformers()
    return load_example(ROOT / "examples" / "moe_block.py")


# The group size whose ranks run the shared-tokens check (one group of the job: CI time).
SHARED_GROUP_SIZE = 3
# Token counts every rank of the shared-tokens check holds alike: one that does not divide by its 3
# ranks (the last rank's slice is shorter), and one below them (a rank holds no slice).
SHARED_TOKENS = (7, 2)


def shared_tokens_model(group) -> dict[str, float]:
    """``parallelize_experts(..., shared_tokens=True)`` of examples/moe_block.py's Mixtral over
    ``group``, every rank holding the same tokens as the ranks of a tensor-parallel group do: the
    largest relative error of the logits, the loss, the replicated parameters' gradients and the
    experts' (every rank's shard gathered) against the unsharded model's (without the option each
    expert's gradient is the group's size times the model's)."""
    import copy

    from fo_kernels import ExpertParallelExperts, parallelize_experts

    example = _example()
    world = dist.get_world_size(group)
    full = example.build_model("mixtral", world, seed=0)
    sharded = copy.deepcopy(full)
    parallelize_experts(sharded, group=group, shared_tokens=True)
    worst: dict[str, float] = {}

    def note(name: str, err: float) -> None:
        worst[name] = max(worst.get(name, 0.0), err)

    full_modules = dict(full.named_modules())
    for seq in SHARED_TOKENS:
        tokens = torch.randint(0, example.VOCAB, (1, seq), generator=torch.Generator().manual_seed(seq))
        outs = {}
        for name, model in (("full", full), ("sharded", sharded)):
            model.zero_grad(set_to_none=True)
            outs[name] = model(input_ids=tokens, labels=tokens)
            outs[name].loss.backward()
        note("logits", rel_err(outs["sharded"].logits, outs["full"].logits))
        note("loss", rel_err(outs["sharded"].loss, outs["full"].loss))
        for name, module in sharded.named_modules():
            if isinstance(module, ExpertParallelExperts):
                ref = full_modules[name]
                for got, want in ((module.w13, ref.gate_up_proj), (module.w2, ref.down_proj)):
                    parts = [torch.empty_like(got.grad) for _ in range(world)]
                    dist.all_gather(parts, got.grad, group=group)
                    note("expert weights", rel_err(torch.cat(parts), want.grad.transpose(1, 2)))
            elif not any(True for _ in module.children()) and "experts" not in name:
                for n, p in module.named_parameters():
                    want = dict(full_modules[name].named_parameters())[n].grad
                    note("other parameters", rel_err(p.grad, want))
    return worst


def _tiny_call(group, **changes):
    """One small call with ``changes`` to its arguments (x, ids, w, w13, w2, schedule)."""
    args = dict(
        x=torch.randn(3, 8),
        ids=torch.zeros(3, 2, dtype=torch.int64),
        w=torch.rand(3, 2),
        w13=torch.randn(2, 8, 6),
        w2=torch.randn(2, 3, 8),
        schedule=None,
    )
    args.update(changes)
    schedule = args.pop("schedule")
    return expert_parallel_ffn(*args.values(), group=group, schedule=schedule)


def _message(call) -> str:
    """The ValueError's message of ``call`` (its type first), or why it is not one."""
    try:
        call()
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # (reported: the test fails on it)
        return f"NOT A ValueError {type(exc).__name__}: {exc}"
    return "NO ERROR"


def _uneven_experts(group, experts: int):
    """``ExpertParallelExperts.from_experts`` of a fused (transformers-layout) block of ``experts``
    experts, which must split evenly over ``group``."""
    from torch import nn

    from fo_kernels import ExpertParallelExperts

    block = nn.Module()
    block.gate_up_proj = nn.Parameter(torch.randn(experts, 6, 8))
    block.down_proj = nn.Parameter(torch.randn(experts, 8, 3))
    block.act_fn = nn.SiLU()
    return ExpertParallelExperts.from_experts(block, group=group)


def bad_inputs(group, rank: int, world: int) -> dict[str, str]:
    """Every bad call's message (each must raise a ValueError before any collective: the good
    call after them checks that no collective was left half done), and the good call's error.
    The last bad call differs between the ranks (H), which only the counts exchange can see."""
    e = 2 * world
    bad = {
        "id_too_big": dict(ids=torch.full((3, 2), e, dtype=torch.int64)),
        "id_negative": dict(ids=torch.full((3, 2), -1, dtype=torch.int64)),
        "ids_float": dict(ids=torch.zeros(3, 2)),
        "weights_shape": dict(w=torch.rand(3, 3)),
        "tokens_disagree": dict(ids=torch.zeros(4, 2, dtype=torch.int64), w=torch.rand(4, 2)),
        "w13_hidden": dict(w13=torch.randn(2, 9, 6)),
        "w13_odd": dict(w13=torch.randn(2, 8, 5)),
        "w2_shape": dict(w2=torch.randn(2, 4, 8)),
        "no_experts": dict(w13=torch.randn(0, 8, 6), w2=torch.randn(0, 3, 8)),
        "dtype_mixed": dict(w13=torch.randn(2, 8, 6, dtype=torch.float64)),
        "x_int": dict(x=torch.zeros(3, 8, dtype=torch.int32)),
        "x_3d": dict(x=torch.randn(3, 8, 1)),
        "x_no_width": dict(x=torch.randn(3, 0), w13=torch.randn(2, 0, 6), w2=torch.randn(2, 3, 0)),
        "x_fp8": {n: torch.randn(*shape).to(torch.float8_e4m3fn) for n, shape in FP8_OPERANDS.items()},
        "schedule_type": dict(schedule="fast"),
    }
    out = {name: _message(lambda c=c: _tiny_call(group, **c)) for name, c in bad.items()}
    sched = MoeSchedule(
        dtype="float32",
        world_size=world,
        problem=MoeProblem(hidden=8, intermediate=3, experts=2, top_k=2, tokens_max=2),
    )
    out["schedule_tokens"] = _message(lambda: _tiny_call(group, schedule=sched))
    problem = MoeProblem(hidden=8, intermediate=3, experts=2, top_k=2, tokens_max=3)
    copies = MoeSchedule(dtype="float32", world_size=world, problem=problem, engine="copy_engine")
    out["copy_engine_on_cpu"] = _message(lambda: _tiny_call(group, schedule=copies))
    # H differs on the last rank only: every rank must raise at the counts exchange
    h = 8 if rank < world - 1 else 4
    mixed = dict(x=torch.randn(3, h), w13=torch.randn(2, h, 6), w2=torch.randn(2, 3, h))
    out["ranks_disagree"] = _message(lambda: _tiny_call(group, **mixed))
    out["experts_split"] = _message(lambda: _uneven_experts(group, 2 * world + 1))
    x = torch.randn(3, 8, dtype=torch.float64)
    ids = torch.tensor([[0, e - 1], [1, 1], [e - 1, 0]])
    w = torch.rand(3, 2, dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    w13 = torch.randn(e, 8, 6, generator=gen, dtype=torch.float64)
    w2 = torch.randn(e, 3, 8, generator=gen, dtype=torch.float64)
    lo = rank * 2
    got = expert_parallel_ffn(
        x.float(), ids, w.float(), w13[lo : lo + 2].float(), w2[lo : lo + 2].float(), group=group
    )
    out["good_after"] = rel_err(got, reference_ffn(x, ids, w, w13, w2))
    return out


def disagreeing_calls(ctx, _payload=None) -> dict[str, object]:
    """Calls whose ranks differ in what only the counts exchange can compare (each must raise on every
    rank, none may hang or abort a rank), then calls a schedule covers only by the most tokens any
    rank holds (which must run): the last rank holds more experts than the others; the last rank
    routes each token to one expert more (k), without a schedule and with one; the last rank is
    given another schedule than the others; the last rank holds more tokens than the schedule's
    bound (the no-overlap path's and the Triton engine's schedule); rank 0 holds fewer than the
    bound's minimum while another is in range (the relative error against the reference)."""
    rank, world = ctx.rank, ctx.world_size
    last = rank == world - 1
    e_local = 3 if last else 2
    out: dict[str, object] = {}
    out["experts_disagree"] = _message(
        lambda: _tiny_call(None, w13=torch.randn(e_local, 8, 6), w2=torch.randn(e_local, 3, 8))
    )
    # k: the last rank routes each token to 3 experts, the others to 2; with no schedule (the
    # table's key has k) and with a schedule for k = 2 (which only the last rank's k misses)
    k = 3 if last else 2
    top_k = dict(ids=torch.zeros(3, k, dtype=torch.int64), w=torch.rand(3, k))
    out["top_k_disagree"] = _message(lambda: _tiny_call(None, **top_k))
    problem = MoeProblem(hidden=8, intermediate=3, experts=2, top_k=2, tokens_max=4)
    for_k2 = MoeSchedule(dtype="float32", world_size=world, problem=problem)
    out["top_k_disagree_schedule"] = _message(lambda: _tiny_call(None, schedule=for_k2, **top_k))

    def tokens(t: int, schedule: MoeSchedule):
        x, ids, w = torch.randn(t, 8), torch.zeros(t, 2, dtype=torch.int64), torch.rand(t, 2)
        return _tiny_call(None, x=x, ids=ids, w=w, schedule=schedule)

    tile = {"block_m": 16, "block_n": 32, "block_k": 16, "group_m": 2, "num_warps": 4, "num_stages": 1}
    # the last rank is given the Triton engine's schedule, the others the no-overlap path's: the
    # ranks would run different paths (their collectives never meet)
    problem = MoeProblem(hidden=8, intermediate=3, experts=2, top_k=2, tokens_max=4)
    ring = {"engine": "triton", "tile": tile} if last else {}
    mixed = MoeSchedule.from_dict(
        {"dtype": "float32", "world_size": world, "problem": problem.to_dict()} | ring
    )
    out["schedules_disagree"] = _message(lambda: tokens(3, mixed))
    for engine in (None, "triton"):
        problem = MoeProblem(hidden=8, intermediate=3, experts=2, top_k=2, tokens_max=4)
        bound = MoeSchedule.from_dict(
            {"dtype": "float32", "world_size": world, "problem": problem.to_dict(), "engine": engine}
            | ({"tile": tile} if engine else {})
        )
        out[f"over_bound_{engine}"] = _message(lambda b=bound: tokens(6 if last else 3, b))
    # the schedule covers 4 .. 8 tokens a rank: rank 0's 1 token is the call's 5
    problem = MoeProblem(hidden=8, intermediate=3, experts=2, top_k=2, tokens_min=4, tokens_max=8)
    schedule = MoeSchedule(dtype="float32", world_size=world, problem=problem)
    t, e = (1 if rank == 0 else 5), 2 * world
    gen = torch.Generator().manual_seed(11)
    w13 = torch.randn(e, 8, 6, generator=gen, dtype=torch.float64)
    w2 = torch.randn(e, 3, 8, generator=gen, dtype=torch.float64)
    gen.manual_seed(rank)
    x, w = torch.randn(t, 8, generator=gen, dtype=torch.float64), torch.rand(t, 2, generator=gen)
    ids = torch.randint(0, e, (t, 2), generator=gen)
    lo = rank * 2
    got = expert_parallel_ffn(
        x.float(), ids, w, w13[lo : lo + 2].float(), w2[lo : lo + 2].float(), schedule=schedule
    )
    out["under_min_on_one_rank"] = rel_err(got, reference_ffn(x, ids, w.double(), w13, w2))
    return out


# ----------------------------------------------------------------------------- thread-ranks
def thread_stage(case: MoeCase, rank: int, world: int, backward: bool):
    """Rank ``rank``'s stage of ``case`` for the copy engine's CPU executor, its layout from every
    rank's routing (what the counts exchange would give), in float32."""
    from fo_kernels.moe.exchange import Layout
    from fo_kernels.moe.routing import check_call, route
    from fo_kernels.moe.stages import BackwardStage, ForwardStage

    routings = []
    for r in range(world):
        d = inputs(case, r, world)
        lo, hi = r * case.experts, (r + 1) * case.experts
        args = (d["x"].float(), d["ids"], d["w"].float(), d["w13"][lo:hi].float(), d["w2"][lo:hi].float())
        shape = check_call(*args, world)
        routings.append((args, shape, route(d["ids"], shape), d["g"].float()))
    (x, _ids, w, w13, w2), shape, routing, g = routings[rank]
    layout = Layout(rank, routing.host_counts, tuple(rt[2].host_counts[rank] for rt in routings))
    if backward:
        return BackwardStage(g, x, w, shape, routing, layout, w13, w2)
    return ForwardStage(x, w, shape, routing, layout, w13, w2)


# ----------------------------------------------------------------------------- virtual ranks
def ffn_by_expert(x, ids, w, w13, w2) -> torch.Tensor:
    """``reference_ffn``'s formula one expert at a time (its rows gathered): the float64 reference
    of the larger cases, on the CPU or a GPU (``tests/test_gpu_moe.py`` checks it against the loop).
    Every expert's term is added, empty ones too, so ``y`` is in the weights' graph even at 0 tokens
    (a backward through it then gives zero gradients rather than failing)."""
    inter = w13.shape[2] // 2
    y = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        t, j = (ids == e).nonzero(as_tuple=True)
        gu = x[t] @ w13[e]
        y = y.index_add(0, t, w[t, j].unsqueeze(1) * ((F.silu(gu[:, :inter]) * gu[:, inter:]) @ w2[e]))
    return y


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)  # (no rows: no graph)


def all_references(case: MoeCase, world: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's ``reference`` (y, dx, dw, its shard of dw13 and dw2), from one float64 graph."""
    data = [inputs(case, r, world) for r in range(world)]
    w13, w2 = data[0]["w13"].requires_grad_(), data[0]["w2"].requires_grad_()
    mine = []
    total = 0.0
    for d in data:
        x, w = d["x"].requires_grad_(), d["w"].requires_grad_()
        y = ffn_by_expert(x, d["ids"], w, w13, w2)
        total = total + (y * d["g"]).sum()
        mine.append((x, w, y.detach()))
    total.backward()
    out = []
    for r, (x, w, y) in enumerate(mine):
        lo, hi = r * case.experts, (r + 1) * case.experts
        out.append(dict(y=y, dx=_grad(x), dw=_grad(w), dw13=_grad(w13)[lo:hi], dw2=_grad(w2)[lo:hi]))
    return out


def virtual_errors(ranks, case: MoeCase, device: str | torch.device = "cpu") -> dict[str, float]:
    """``case`` forward and backward on ``ranks`` (a ``MoeVirtualRanks``): the largest relative
    error over the ranks of y and of each gradient against float64 (NaN is infinite)."""
    world = ranks.world
    dtype = torch_dtype(case.dtype)
    schedule = MoeSchedule.from_dict(case.schedule)
    data = [inputs(case, r, world) for r in range(world)]

    def each(name: str, to: torch.dtype, shard: bool = False) -> list[torch.Tensor]:
        got = []
        for r, d in enumerate(data):
            t = d[name][r * case.experts : (r + 1) * case.experts] if shard else d[name]
            got.append(t.to(device=device, dtype=to))
        return got

    args = (
        each("x", dtype),
        each("ids", torch.int64),
        each("w", torch.float32),
        each("w13", dtype, True),
        each("w2", dtype, True),
    )
    refs = all_references(case, world)
    ys = ranks.forward(*args, schedule)
    errs = {"y": max(rel_err(y.cpu(), ref["y"]) for y, ref in zip(ys, refs, strict=True))}
    grads = ranks.backward(each("g", dtype), *args, schedule)
    for i, name in enumerate(("dx", "dw", "dw13", "dw2")):
        errs[name] = max(rel_err(g[i].cpu(), ref[name]) for g, ref in zip(grads, refs, strict=True))
    return errs
