"""The expert-parallel FFN (``fo_kernels.moe``) on gloo process groups of 2, 3 and 4 CPU ranks
against the unsharded float64 reference: forward and backward, eager and compiled, the no-overlap
path and the Triton engine's, random routings and sizes; bad input; the custom op's registration.

One spawned job of 4 ranks runs every world size: groups (0, 2) and (1, 3) (two disjoint pairs
whose calls run at once, each rank's group rank not its global rank), (1, 2, 3) and (0, 1, 2, 3),
so every rank also calls with a group it is not in.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.backends.debugging import aot_eager
from torch.distributed.device_mesh import init_device_mesh

from fo_kernels import GroupError, MoeProblem, MoeSchedule, ScheduleError, ShapeError, expert_parallel_ffn
from fo_kernels.moe import ops as moe_ops
from fo_tune.ranks.launch import run_ranks
from moe_cases import (
    ROUTINGS,
    SHARED_GROUP_SIZE,
    TOL,
    MoeCase,
    disagreeing_calls,
    import_transformers,
    reference_ffn,
    rel_err,
    run_groups,
)

TILE = {"block_m": 16, "block_n": 32, "block_k": 16, "group_m": 2, "num_warps": 4, "num_stages": 1}
DTYPES = ("float32", "bfloat16", "float32", "float16")
CASES = 8  # per group
# The process groups of the 4-rank job and how many random cases each runs: a pair that is not
# contiguous, the disjoint pair beside it (its ranks run its cases while the first pair runs its
# own: two groups' calls at once; a few cases, CI time), three ranks from rank 1, and all four.
GROUPS = {(0, 2): CASES, (1, 3): 3, (1, 2, 3): CASES, (0, 1, 2, 3): CASES}
# Sizes no random case draws (H 24, I 40, E_local 3), added to the first group's: no rank holds
# tokens; k = E (every expert once), one rank without tokens; k = 1, every row on few experts.
ODD = dict(hidden=24, inter=40, experts=3)
ODD_CASES = (
    MoeCase(tokens=(0, 0), top_k=2, seed=71, **ODD),
    MoeCase(tokens=(5, 0), top_k=6, routing="distinct", seed=72, **ODD),
    MoeCase(tokens=(4, 7), top_k=1, routing="duplicates", dtype="bfloat16", seed=73, **ODD),
)
EXAMPLE_MODELS = ("mixtral", "qwen3_moe")
EXAMPLE_CHECKS = {"logits", "loss", "other parameters", "expert weights", "checkpoint load"}
SHARED_CHECKS = EXAMPLE_CHECKS - {"checkpoint load"}
# opcheck's checks but the dynamic-shape AOT dispatch (18 s on a 2-core CPU), which
# test_compiled_with_routing_inside_matches_eager covers (aot_eager, dynamic=True) in ~3 s
FAST_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _cases(world: int, seed: int, count: int) -> list[MoeCase]:
    """``count`` cases of random sizes and routings (k = 1 .. 4, a rank without tokens in most);
    every third on the Triton engine, the fourth compiled."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        tokens = [rng.randint(0, 9) for _ in range(world)]
        if i % 3 != 2:
            tokens[rng.randrange(world)] = 0
        hidden, inter = rng.choice((8, 16, 24)), rng.choice((4, 8, 12))
        experts, top_k = rng.randint(1, 3), 1 + i % 4
        dtype = DTYPES[i % len(DTYPES)]
        schedule = None
        if i % 3 == 1:
            problem = dict(hidden=hidden, intermediate=inter, experts=experts, top_k=top_k, tokens_max=9)
            schedule = dict(dtype=dtype, world_size=world, engine="triton", problem=problem, tile=TILE)
        out.append(
            MoeCase(
                tokens=tuple(tokens),
                hidden=hidden,
                inter=inter,
                experts=experts,
                top_k=top_k,
                dtype=dtype,
                routing=ROUTINGS[i % len(ROUTINGS)],
                seed=seed * 100 + i,
                compiled=i == 3,
                schedule=schedule,
            )
        )
    return out


def test_gloo_groups_of_two_three_and_four_ranks():
    """Forward and every gradient within the dtype's tolerance on every rank of every group (random
    cases, and ``ODD_CASES`` on the first); the bad calls raise ValueErrors naming the problem and
    leave no collective half done; a rank outside a group gets a GroupError, eagerly and compiled;
    a deep copy of an ExpertParallelExperts, and one saved whole and loaded, run over its group;
    on the 3-rank group, a Mixtral's experts sharded with ``shared_tokens=True`` over ranks that
    hold the same tokens (as a tensor-parallel group does) match the unsharded model's gradients;
    examples/moe_block.py's check of a Mixtral and a Qwen3-MoE decoder with their experts over the
    4 ranks (``ExpertParallelExperts``) against the unsharded models, and the unsharded model's
    state_dict loaded into a sharded one (each rank its experts)."""
    groups = [(ranks, _cases(len(ranks), 12 + i, count)) for i, (ranks, count) in enumerate(GROUPS.items())]
    groups[0][1].extend(ODD_CASES)
    per_rank = run_ranks(run_groups, 4, (groups, EXAMPLE_MODELS), backend="gloo")
    checked = shared = 0
    for rank, results in enumerate(per_rank):
        for r in results:
            where = f"rank {rank} of group {r.get('ranks')}"
            if "example" in r:
                assert set(r["errors"]) == EXAMPLE_CHECKS, r
                assert max(r["errors"].values()) < TOL["float32"], f"rank {rank}: {r}"
                checked += 1
            elif "outside" in r:
                assert r["outside"].startswith("GroupError: group: this rank is not a member"), where
            elif "bad" in r:
                _check_bad(r["bad"], where)
            elif "copied" in r:
                assert r["copied"] == 0, (where, r["copied"])
            elif "shared" in r:
                assert set(r["shared"]) == SHARED_CHECKS, (where, r)
                assert max(r["shared"].values()) < TOL["float32"], (where, r)
                shared += 1
            else:
                c, errs = r["case"], r["errs"]
                assert errs.pop("y_dtype") == 0, where
                for name, err in errs.items():
                    assert err < TOL[c.dtype], f"{where}: {name} relative error {err:.2e} in {c}"
                checked += 1
    assert checked == sum(len(ranks) * len(cases) for ranks, cases in groups) + 4 * len(EXAMPLE_MODELS)
    assert shared == SHARED_GROUP_SIZE  # every rank of the one group of that size


def _check_bad(msgs: dict, where: str) -> None:
    good = msgs.pop("good_after")
    split = msgs.pop("experts_split")
    assert split.startswith("PlanError: experts: ") and "do not split over" in split, f"{where}: {split}"
    assert "whose size divides" in split, f"{where}: {split}"
    assert good < TOL["float32"], f"{where}: the good call after the bad ones: {good}"
    for name, msg in msgs.items():
        assert msg.split(":")[0] in ("ShapeError", "ScheduleError"), f"{where}: {name}: {msg}"
    assert "[0, " in msgs["id_too_big"] and "[0, " in msgs["id_negative"]
    assert "int64" in msgs["ids_float"]
    assert "topk_weights" in msgs["weights_shape"] and "T = x.shape[0]" in msgs["tokens_disagree"]
    assert "w13" in msgs["w13_hidden"] and "2I even" in msgs["w13_odd"] and "w2 must be" in msgs["w2_shape"]
    assert "must agree" in msgs["dtype_mixed"] and "bfloat16" in msgs["x_int"]
    assert "(T, H)" in msgs["x_3d"] and "MoeSchedule" in msgs["schedule_type"]
    assert "H >= 1" in msgs["x_no_width"], msgs["x_no_width"]
    assert "holds no experts" in msgs["no_experts"], msgs["no_experts"]
    assert msgs["x_fp8"].startswith("ShapeError: x is torch.float8_e4m3fn"), msgs["x_fp8"]
    assert msgs["schedule_tokens"].startswith("ScheduleError: problem:")
    assert "the ranks' calls disagree" in msgs["ranks_disagree"], msgs["ranks_disagree"]
    assert "engine: copy_engine needs CUDA GPUs" in msgs["copy_engine_on_cpu"], msgs["copy_engine_on_cpu"]


def test_ranks_that_disagree_raise_alike():
    """On 3 gloo ranks: a rank with more local experts than the others, a rank with another k (with no
    schedule, and with a schedule only the other ranks' k fits), a rank given another schedule than
    the others, and a rank with more tokens than the schedule's bound, make every rank raise (none
    hangs, none aborts); a rank with fewer tokens than the bound's minimum runs, the call's tokens
    being the most any rank holds (as the table's lookup takes them)."""
    per_rank = run_ranks(disagreeing_calls, 3, backend="gloo", timeout_s=120)
    for rank, msgs in enumerate(per_rank):
        assert msgs["experts_disagree"].startswith("ShapeError: the ranks' calls disagree"), (rank, msgs)
        assert "'experts': 3" in msgs["experts_disagree"], (rank, msgs)
        for name in ("top_k_disagree", "top_k_disagree_schedule"):
            assert msgs[name].startswith("ShapeError: the ranks' calls disagree"), (rank, name, msgs)
            assert "'top_k': 3" in msgs[name] and "'top_k': 2" in msgs[name], (rank, name, msgs)
        msg = msgs["schedules_disagree"]
        assert msg.startswith("ScheduleError: the ranks' schedules differ") and "ranks [" in msg, (rank, msg)
        for engine in (None, "triton"):
            msg = msgs[f"over_bound_{engine}"]
            assert msg.startswith("ScheduleError: problem:") and "up to 6 tokens (group rank 2)" in msg, msg
        assert msgs["under_min_on_one_rank"] < TOL["float32"], (rank, msgs)


# ----------------------------------------------------------------------------- one process
def test_op_schema_fake_and_autograd_registration(quiet_one_rank):
    """torch.library's own check of both ops (schema, fake against real, autograd registration)."""
    x = torch.randn(5, 8, requires_grad=True)
    ids = torch.tensor([[0, 1], [1, 1], [0, 0], [1, 0], [0, 1]])
    w = torch.rand(5, 2, requires_grad=True)
    w13 = torch.randn(2, 8, 6, requires_grad=True)
    w2 = torch.randn(2, 3, 8, requires_grad=True)
    op = torch.ops.fo_kernels.expert_parallel_ffn.default
    assert str(op._schema) == (
        "fo_kernels::expert_parallel_ffn(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, "
        "Tensor w2, str group_name, str schedule) -> Tensor"
    )
    result = torch.library.opcheck(op, (x, ids, w, w13, w2, "", ""), test_utils=FAST_CHECKS)
    assert set(result.values()) == {"SUCCESS"}, result
    back = torch.ops.fo_kernels.expert_parallel_ffn_backward.default
    plain = [t.detach() for t in (x, ids, w, w13, w2)]  # (it has no backward of its own)
    result = torch.library.opcheck(back, (torch.randn(5, 8), *plain, "", ""), test_utils=FAST_CHECKS)
    assert set(result.values()) == {"SUCCESS"}, result


def test_compiled_with_routing_inside_matches_eager(quiet_one_rank):
    """torch.compile(fullgraph=True) of a router + the op (dynamic token count): the op is one
    node, and compiled equals eager, forward and backward; the schedule goes in as its text."""
    gen = torch.Generator().manual_seed(3)
    w13 = torch.randn(4, 16, 12, generator=gen, requires_grad=True)
    w2 = torch.randn(4, 6, 16, generator=gen, requires_grad=True)
    gate = torch.randn(16, 4, generator=gen)
    problem = MoeProblem(hidden=16, intermediate=6, experts=4, top_k=2, tokens_max=64)
    schedule = MoeSchedule(dtype="float32", world_size=1, problem=problem)

    def block(x):
        w, ids = (x @ gate).softmax(-1).topk(2, dim=-1)
        return expert_parallel_ffn(x, ids, w, w13, w2, schedule=schedule)

    graphs = []

    def recorded(gm: torch.fx.GraphModule, example_inputs):
        """aot_eager, keeping each graph Dynamo hands it."""
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(block, fullgraph=True, backend=recorded, dynamic=True)
    for tokens in (7, 13, 0):
        x = torch.randn(tokens, 16, generator=gen, requires_grad=True)
        got, want = compiled(x), block(x)
        torch.testing.assert_close(got, want)
        if tokens:
            grads = torch.autograd.grad(got.square().sum(), (x, w13, w2))
            ref = torch.autograd.grad(want.square().sum(), (x, w13, w2))
            for g, r in zip(grads, ref, strict=True):
                torch.testing.assert_close(g, r)
    op = torch.ops.fo_kernels.expert_parallel_ffn.default
    assert graphs and all([n.target for n in gm.graph.nodes].count(op) == 1 for gm in graphs), graphs


def test_compiled_call_whose_output_is_unused_still_runs(quiet_one_rank, monkeypatch):
    """Every rank must enter the op's collectives: a compiled call whose output nothing reads
    (inductor's view of a rank with no tokens, whose output has no element) still runs, forward
    and backward, rather than being dropped as dead code while the other ranks wait in it."""
    import fo_kernels.moe.ops as moe_ops

    runs = []
    execute = moe_ops._execute
    monkeypatch.setattr(moe_ops, "_execute", lambda *a, **k: runs.append(1) or execute(*a, **k))
    w13 = torch.randn(2, 8, 6, requires_grad=True)
    w2 = torch.randn(2, 3, 8, requires_grad=True)

    def block(x, ids, w):
        expert_parallel_ffn(x, ids, w, w13, w2)  # (its output dropped)
        return x * 2

    x, ids, w = torch.randn(3, 8), torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1)
    torch.compile(block, fullgraph=True, backend="aot_eager")(x, ids, w)
    assert runs == [1], runs
    for op in (torch.ops.fo_kernels.expert_parallel_ffn, torch.ops.fo_kernels.expert_parallel_ffn_backward):
        assert torch.fx.Node(torch.fx.Graph(), "n", "call_function", op.default, (), {}).is_impure()


def test_compiled_bad_input_raises_the_ops_value_errors(quiet_one_rank):
    """Under torch.compile(fullgraph=True), bad input raises the eager call's ShapeError (a
    ValueError), not the RuntimeError Dynamo makes of an exception in fake propagation; a good
    call then runs."""
    x, ids, w = torch.randn(3, 8), torch.tensor([[0, 1], [1, 1], [0, 0]]), torch.rand(3, 2)
    w13, w2 = torch.randn(2, 8, 6), torch.randn(2, 3, 8)
    compiled = torch.compile(expert_parallel_ffn, fullgraph=True, backend="aot_eager", dynamic=False)
    for bad, match in (
        (dict(w2=torch.randn(2, 4, 8)), "w2 must be"),
        (dict(w13=torch.randn(2, 8, 5)), "2I even"),
        (dict(w=torch.rand(3, 3)), "topk_weights"),
        (dict(w13=w13.double()), "must agree"),
        (dict(x=torch.randn(3, 8, 1)), r"\(T, H\)"),
        (dict(ids=torch.full((3, 2), 2)), r"\[0, 2\)"),
    ):
        args = dict(x=x, ids=ids, w=w, w13=w13, w2=w2) | bad
        with pytest.raises(ShapeError, match=match):
            compiled(*args.values())
    # a DeviceMesh where its group goes, a list of ranks, a schedule's dict: the eager call's error
    # and message (the trace cannot raise them: the op does when the graph runs it)
    problem = MoeProblem(hidden=8, intermediate=3, experts=2, top_k=2, tokens_max=4)
    for bad, error, match in (
        (
            dict(group=init_device_mesh("cpu", (1,))),
            GroupError,
            r"got a DeviceMesh; .* mesh\.get_group\(dim\)",
        ),
        (dict(group=[0]), GroupError, "ProcessGroup or None, got list"),
        (
            dict(schedule=MoeSchedule(dtype="float32", world_size=1, problem=problem).to_dict()),
            ScheduleError,
            "got dict",
        ),
    ):
        torch._dynamo.reset()  # (each case a compile of its own: the recompile limit is not the test's)
        traced = torch.compile(expert_parallel_ffn, fullgraph=True, backend="aot_eager", dynamic=False)
        for call in (expert_parallel_ffn, traced):
            with pytest.raises(error, match=match):
                call(x, ids, w, w13, w2, **bad)
    want = expert_parallel_ffn(x, ids, w, w13, w2)
    torch.testing.assert_close(compiled(x, ids, w, w13, w2), want)


def test_a_float64_call_has_no_schedule(quiet_one_rank):
    """float64 runs the no-overlap path as a reference; a schedule for it is refused, naming x's
    dtype, and the same call without one runs."""
    x, ids, w = (
        torch.randn(3, 8, dtype=torch.float64),
        torch.tensor([[0, 1], [1, 1], [0, 0]]),
        torch.rand(3, 2),
    )
    w13, w2 = torch.randn(2, 8, 6, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)
    problem = MoeProblem(hidden=8, intermediate=3, experts=2, top_k=2, tokens_max=4)
    schedule = MoeSchedule(dtype="float32", world_size=1, problem=problem)
    with pytest.raises(ScheduleError, match="x is float64"):
        expert_parallel_ffn(x, ids, w.double(), w13, w2, schedule=schedule)
    got = expert_parallel_ffn(x, ids, w.double(), w13, w2)
    assert rel_err(got, reference_ffn(x, ids, w.double(), w13, w2)) < 1e-12


def test_world_size_one_duplicates_and_direct_call(quiet_one_rank):
    """At world size 1 nothing moves; a token naming one expert twice counts twice; a call without
    gradients skips the dispatcher and equals the op's; int32 ids are taken; meta tensors are
    refused."""
    x = torch.randn(6, 8, dtype=torch.float64)
    ids = torch.tensor([[1, 1], [0, 2], [2, 2], [1, 0], [0, 0], [2, 1]])
    w = torch.rand(6, 2, dtype=torch.float64)
    w13, w2 = torch.randn(3, 8, 10, dtype=torch.float64), torch.randn(3, 5, 8, dtype=torch.float64)
    want = reference_ffn(x, ids, w, w13, w2)
    got = expert_parallel_ffn(x.float(), ids, w.float(), w13.float(), w2.float())
    assert rel_err(got, want) < TOL["float32"]
    via_op = moe_ops._ffn(x.float(), ids, w.float(), w13.float(), w2.float(), "", "")
    torch.testing.assert_close(got, via_op)
    # int32 ids (some routers store them) route as int64 ones; other index dtypes are refused
    torch.testing.assert_close(
        expert_parallel_ffn(x.float(), ids.int(), w.float(), w13.float(), w2.float()), got
    )
    with pytest.raises(ShapeError, match=r"topk_ids is torch\.int16; expert ids are int64 \(or int32\)"):
        expert_parallel_ffn(x.float(), ids.short(), w.float(), w13.float(), w2.float())
    # meta tensors hold no ids: a ShapeError naming the device, not torch's RuntimeError of .item()
    meta = [t.float().to("meta") for t in (x, w, w13, w2)]
    with pytest.raises(ShapeError, match="on the meta device"):
        expert_parallel_ffn(meta[0], ids.to("meta"), *meta[1:])
    # the same where they need gradients (a model made on meta: its parameters do), which the
    # dispatcher would otherwise answer with the fake implementation's empty output
    meta[2].requires_grad_()
    with pytest.raises(ShapeError, match="on the meta device"):
        expert_parallel_ffn(meta[0], ids.to("meta"), *meta[1:])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (0, 2)])
def test_backward_of_an_odd_width_with_one_row_or_none(quiet_one_rank, dtype, tokens, top_k):
    """An odd H in a 2-byte dtype puts the float32 routing weight of a row sent back at a byte
    offset that is not a multiple of 4: a call of one row (T = 1, k = 1) or none still unpacks it
    (gradients within the dtype's tolerance of the float64 reference)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, 13, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 2, (tokens, top_k), generator=gen)
    w = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64)
    w13 = torch.randn(2, 13, 14, generator=gen, dtype=torch.float64) / 13**0.5
    w2 = torch.randn(2, 7, 13, generator=gen, dtype=torch.float64) / 7**0.5
    want = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
    touch = sum(0 * t.sum() for t in want)  # (no tokens: the reference has no graph of its own)
    (reference_ffn(want[0], ids, want[1], want[2], want[3]).sum() + touch).backward()
    to = getattr(torch, dtype)
    got = [x.to(to), w.float(), w13.to(to), w2.to(to)]
    got = [t.requires_grad_() for t in got]
    expert_parallel_ffn(got[0], ids, got[1], got[2], got[3]).float().sum().backward()
    for g, r in zip(got, want, strict=True):
        assert rel_err(g.grad, r.grad) < TOL[dtype]


def test_gradcheck_in_float64(quiet_one_rank):
    """Every gradient (x, topk_weights, w13, w2) against finite differences, in float64 (which the
    no-overlap path takes, for references like this one); a token naming one expert twice."""
    gen = torch.Generator().manual_seed(8)
    ids = torch.tensor([[2, 2], [0, 1], [1, 2], [2, 0], [0, 0]])
    leaves = [
        torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
        for shape in ((5, 6), (5, 2), (3, 6, 8), (3, 4, 6))
    ]
    assert torch.autograd.gradcheck(lambda x, w, w13, w2: expert_parallel_ffn(x, ids, w, w13, w2), leaves)


def test_autocast_casts_x_and_the_experts_as_f_linear(quiet_one_rank):
    """Inside torch.autocast the op takes x, w13 and w2 in its dtype, as F.linear takes its
    operands (mixed float32 and bfloat16 operands included), eager and compiled: the output in that
    dtype, equal to a call with the operands cast by hand; the float32 leaves get float32 gradients."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.tensor([[0, 1], [1, 1], [0, 0], [1, 0]])
    leaves = [
        torch.randn(*s, generator=gen, requires_grad=True) for s in ((4, 8), (4, 2), (2, 8, 6), (2, 3, 8))
    ]
    x, w, w13, w2 = leaves
    want = expert_parallel_ffn(x.bfloat16(), ids, w, w13.bfloat16(), w2.bfloat16())
    compiled = torch.compile(expert_parallel_ffn, fullgraph=True, backend="aot_eager", dynamic=False)
    for call in (expert_parallel_ffn, compiled):
        for operand in (x, x.bfloat16()):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = call(operand, ids, w, w13, w2)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, want)
    got.float().sum().backward()
    assert [t.grad.dtype for t in leaves] == [torch.float32] * 4


def test_double_backward_raises_a_clear_error(quiet_one_rank):
    """Gradients taken with create_graph=True are the plain backward's; a backward through them
    raises DoubleBackwardError (a NotImplementedError) naming the limitation, not torch's error of
    an op without an autograd formula."""
    from fo_kernels import DoubleBackwardError

    gen = torch.Generator().manual_seed(6)
    ids = torch.tensor([[0, 1], [1, 1], [0, 0]])
    x, w = torch.randn(3, 8, generator=gen, requires_grad=True), torch.rand(3, 2, generator=gen)
    w13, w2 = torch.randn(2, 8, 6, generator=gen, requires_grad=True), torch.randn(2, 3, 8, generator=gen)
    plain = torch.autograd.grad(expert_parallel_ffn(x, ids, w, w13, w2).square().sum(), (x, w13))
    grads = torch.autograd.grad(
        expert_parallel_ffn(x, ids, w, w13, w2).square().sum(), (x, w13), create_graph=True
    )
    for g, p in zip(grads, plain, strict=True):
        torch.testing.assert_close(g, p)
    assert issubclass(DoubleBackwardError, NotImplementedError)
    with pytest.raises(DoubleBackwardError, match="expert_parallel_ffn has no double backward"):
        grads[0].square().sum().backward()


def test_schedule_fields_round_trip_and_errors_name_the_field():
    problem = MoeProblem(hidden=4096, intermediate=1536, experts=16, top_k=8, tokens_min=512, tokens_max=1024)
    s = MoeSchedule(dtype="bfloat16", world_size=8, problem=problem, engine="copy_engine", chunks=4)
    assert MoeSchedule.from_dict(s.to_dict()) == s
    assert moe_ops.parse_schedule(s.op_text) == s
    tile = {"block_m": 128, "block_n": 128, "block_k": 64}
    t = MoeSchedule.from_dict({**s.to_dict(), "engine": "triton", "tile": tile, "chunks": 1})
    assert t.tile.block_m == 128 and MoeSchedule.from_dict(t.to_dict()) == t
    for bad, field in (
        ({"engine": "nccl"}, "engine:"),
        ({"engine": "triton"}, "tile:"),
        ({"chunks": 0}, "chunks:"),
        ({"dtype": "int8"}, "dtype:"),
        ({"dtype": "float8_e4m3fn"}, "dtype:"),
        ({"problem": {**problem.to_dict(), "tokens_min": 2048}}, "problem.tokens_min:"),
        ({"sms": 3}, "schedule: unknown key"),
    ):
        with pytest.raises(ScheduleError, match=field):
            MoeSchedule.from_dict({**s.to_dict(), **bad})
    # the README's MoeSchedule(dtype=..., world_size=..., problem=...) given a mapping says what to pass
    with pytest.raises(ScheduleError, match=r"fo_kernels\.MoeProblem\(hidden=H.*got dict"):
        MoeSchedule(dtype="bfloat16", world_size=8, problem=problem.to_dict())


def test_without_a_process_group_it_says_so():
    assert not dist.is_initialized()
    with pytest.raises(ScheduleError, match="not initialized"):
        expert_parallel_ffn(
            torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1),
            torch.randn(1, 8, 4), torch.randn(1, 2, 8),
        )  # fmt: skip
    assert issubclass(GroupError, ValueError) and issubclass(ShapeError, ValueError)


# ----------------------------------------------------------------------------- the module
def _mixtral_experts(experts: int = 4):
    import_transformers()
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=experts)
    block = MixtralExperts(config)
    with torch.no_grad():
        block.gate_up_proj.normal_(0, 0.3)
        block.down_proj.normal_(0, 0.3)
    return block


class _Mlp(torch.nn.Module):
    """A transformers-4 style expert MLP (Mixtral's w1 / w3 / w2)."""

    def __init__(self, act) -> None:
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(16, 8, bias=False)
        self.w2, self.act_fn = torch.nn.Linear(8, 16, bias=False), act

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


def test_module_from_both_hf_layouts_matches_the_block(quiet_one_rank):
    """``ExpertParallelExperts.from_experts`` of transformers' fused block (and its transposed and
    interleaved variants) and of a ModuleList of MLPs computes what the block computes, its
    weight gradients are the block's, and its weights train where the block's do."""
    from fo_kernels import ExpertParallelExperts

    block = _mixtral_experts()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 16, generator=gen)
    ids = torch.randint(0, 4, (9, 2), generator=gen)
    w = torch.rand(9, 2, generator=gen)
    want = block(x, ids, w)
    ep = ExpertParallelExperts.from_experts(block)
    got = ep(x, ids, w)
    torch.testing.assert_close(got, want)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(ep.w13.grad, block.gate_up_proj.grad.transpose(1, 2))
    torch.testing.assert_close(ep.w2.grad, block.down_proj.grad.transpose(1, 2))
    # the transposed and the interleaved fused layouts hold the same experts
    with torch.no_grad():
        block.is_transposed = True
        block.gate_up_proj = torch.nn.Parameter(block.gate_up_proj.transpose(1, 2).contiguous())
        block.down_proj = torch.nn.Parameter(block.down_proj.transpose(1, 2).contiguous())
        torch.testing.assert_close(ExpertParallelExperts.from_experts(block)(x, ids, w), want)
        g, u = block.gate_up_proj.chunk(2, dim=-1)
        block.gate_up_proj = torch.nn.Parameter(torch.stack([g, u], dim=-1).flatten(-2))
        block.is_concatenated = False
        torch.testing.assert_close(ExpertParallelExperts.from_experts(block)(x, ids, w), want)
    mlps = torch.nn.ModuleList(_Mlp(torch.nn.SiLU()) for _ in range(3))
    per_token = torch.stack(
        [sum(w[t, j] * mlps[int(ids[t, j]) % 3](x[t]) for j in range(2)) for t in range(9)]
    )
    torch.testing.assert_close(ExpertParallelExperts.from_experts(mlps)(x, ids % 3, w), per_token)
    # frozen experts stay frozen (a fine-tune of the rest), in either layout; trained ones train
    assert ep.w13.requires_grad and ep.w2.requires_grad
    block.gate_up_proj.requires_grad_(False)
    frozen = ExpertParallelExperts.from_experts(block)
    assert (frozen.w13.requires_grad, frozen.w2.requires_grad) == (False, True)
    for mlp in mlps:
        mlp.requires_grad_(False)
    frozen = ExpertParallelExperts.from_experts(mlps)
    assert (frozen.w13.requires_grad, frozen.w2.requires_grad) == (False, False)


def test_module_loads_a_state_dict_of_the_block_it_was_built_from(quiet_one_rank):
    """A state_dict of the experts block (a Hugging Face checkpoint's keys: fused, transposed,
    interleaved, or per-expert Linears) loads into the module built from such a block as the
    module built from the checkpoint's block; its own state_dict round-trips; a block of another
    size or one missing an expert is refused naming the key."""
    from fo_kernels import ExpertParallelExperts, PlanError

    def variants(block):
        """The block, transposed, and transposed with gate and up interleaved."""
        with torch.no_grad():  # (a list, not a generator: a yield here would leave grad mode off)
            t = copy.deepcopy(block)
            t.is_transposed = True
            t.gate_up_proj = torch.nn.Parameter(block.gate_up_proj.transpose(1, 2).contiguous())
            t.down_proj = torch.nn.Parameter(block.down_proj.transpose(1, 2).contiguous())
            i = copy.deepcopy(t)
            g, u = t.gate_up_proj.chunk(2, dim=-1)
            i.gate_up_proj = torch.nn.Parameter(torch.stack([g, u], dim=-1).flatten(-2))
            i.is_concatenated = False
        return [block, t, i]

    torch.manual_seed(3)
    mlps = [torch.nn.ModuleList(_Mlp(torch.nn.SiLU()) for _ in range(4)) for _ in range(2)]
    pairs = list(zip(variants(_mixtral_experts()), variants(_mixtral_experts()), strict=True))
    for built_from, checkpoint in [*pairs, tuple(mlps)]:
        module = ExpertParallelExperts.from_experts(built_from)
        want = ExpertParallelExperts.from_experts(checkpoint)
        assert not torch.equal(module.w13, want.w13)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), module)
        model.load_state_dict(torch.nn.Sequential(torch.nn.Linear(16, 16), checkpoint).state_dict())
        torch.testing.assert_close(module.w13, want.w13, rtol=0, atol=0)
        torch.testing.assert_close(module.w2, want.w2, rtol=0, atol=0)
        assert set(model.state_dict()) == {"0.weight", "0.bias", "1.w13", "1.w2"}
        module.load_state_dict(ExpertParallelExperts.from_experts(built_from).state_dict())
        assert not torch.equal(module.w13, want.w13)
    # built on the meta device (no memory), then given the checkpoint's tensors
    real = _mixtral_experts()
    with torch.device("meta"):
        on_meta = ExpertParallelExperts.from_experts(type(real)(real.config))
    on_meta.load_state_dict(real.state_dict(), assign=True)
    torch.testing.assert_close(on_meta.w13, ExpertParallelExperts.from_experts(real).w13, rtol=0, atol=0)
    assert on_meta.w13.is_contiguous() and on_meta.w2.device.type == "cpu"
    module = ExpertParallelExperts.from_experts(_mixtral_experts())
    with pytest.raises(PlanError, match=r"are \(6, 16, 16\) as \(E, H, 2I\); this module holds 4 experts"):
        module.load_state_dict(_mixtral_experts(experts=6).state_dict())
    per_expert = ExpertParallelExperts.from_experts(mlps[0])
    partial = {k: v for k, v in mlps[1].state_dict().items() if not k.startswith("3.")}
    with pytest.raises(PlanError, match=r"lacks 3\.w1\.weight \(and 2 more\)"):
        per_expert.load_state_dict(partial)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(num_experts=0), "ShapeError", "num_experts: must be >= 1, got 0"),
        (dict(num_experts="4"), "ShapeError", "num_experts: expected an integer, got '4'"),
        (dict(num_experts=8), "ShapeError", r"num_experts: 8 is not this rank's 4 experts .* = 4"),
        (dict(w13=[1.0]), "ShapeError", r"w13: expected a 3-dim tensor \(E_local, H, 2I\).*got list"),
        (dict(w13=torch.zeros(16, 16)), "ShapeError", r"w13: expected a 3-dim tensor.*got \(16, 16\)"),
        (dict(w2=torch.zeros(4, 8, 8)), "ShapeError", r"w2 must be \(E_local, I, H\) = \(4, 8, 16\)"),
        (dict(w2=torch.zeros(4, 8, 16, dtype=torch.long)), "ShapeError", r"w2: .*torch.int64"),
        (dict(schedule="auto"), "ScheduleError", "schedule: expected a fo_kernels.MoeSchedule or None"),
    ],
)
def test_module_refuses_bad_arguments_on_construction(quiet_one_rank, change, error, match):
    """What the op would refuse at the first call (or never check: num_experts) is refused when
    the module is made, naming the argument."""
    import fo_kernels
    from fo_kernels import ExpertParallelExperts

    args = dict(w13=torch.zeros(4, 16, 16), w2=torch.zeros(4, 8, 16), num_experts=4) | change
    with pytest.raises(getattr(fo_kernels, error), match=match):
        ExpertParallelExperts(args.pop("w13"), args.pop("w2"), **args)


@pytest.mark.parametrize(
    "ids_shape, weights_shape",
    [((2, 1), (2, 1)), ((8, 1), (8, 1)), ((4, 2), (4, 1)), ((3, 2, 1), (3, 2, 1))],
)
def test_module_forward_refuses_a_routing_of_other_tokens(quiet_one_rank, ids_shape, weights_shape):
    """top_k_index / top_k_weights that do not route hidden_states' tokens (another number of
    rows, shapes that differ) raise a ShapeError naming them, not a reshape's RuntimeError; leading
    dims that hold the same tokens are taken."""
    from fo_kernels import ExpertParallelExperts

    ep = ExpertParallelExperts(torch.randn(2, 8, 6), torch.randn(2, 3, 8), num_experts=2)
    x = torch.randn(4, 8)
    ids, w = torch.zeros(ids_shape, dtype=torch.int64), torch.rand(weights_shape)
    with pytest.raises(ShapeError, match=r"top_k_index and top_k_weights must both be .* over the 4 tokens"):
        ep(x, ids, w)
    ids, w = torch.zeros(2, 2, 1, dtype=torch.int64), torch.rand(2, 2, 1)
    assert ep(x.view(2, 2, 8), ids, w).shape == (2, 2, 8)


def test_module_takes_experts_whose_silu_works_in_place(quiet_one_rank):
    """An expert MLP's ``nn.SiLU(inplace=True)`` is a SiLU: the module is built, and computes what
    the experts compute."""
    from fo_kernels import ExpertParallelExperts

    torch.manual_seed(5)
    mlps = torch.nn.ModuleList(_Mlp(torch.nn.SiLU(inplace=True)) for _ in range(3))
    x, ids, w = torch.randn(5, 16), torch.randint(0, 3, (5, 2)), torch.rand(5, 2)
    want = torch.stack([sum(w[t, j] * mlps[int(ids[t, j])](x[t]) for j in range(2)) for t in range(5)])
    torch.testing.assert_close(ExpertParallelExperts.from_experts(mlps)(x, ids, w), want)


class _BareMlp(_Mlp):
    """A hand-written expert MLP that names no act_fn: its forward calls ``act`` itself."""

    def __init__(self, act) -> None:
        super().__init__(act)
        del self.act_fn
        self.activation = act

    def forward(self, x):
        return self.w2(self.activation(self.w1(x)) * self.w3(x))


class _BareFused(torch.nn.Module):
    """A hand-written fused experts block (transformers' layout and call, 4 experts, H 16, I 8)
    that names no act_fn: its forward calls F.silu itself."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 16, 16) * 0.3)
        self.down_proj = torch.nn.Parameter(torch.randn(4, 16, 8) * 0.3)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for j in range(top_k_index.shape[1]):
            e = top_k_index[:, j]
            gate, up = torch.einsum("th,tih->ti", hidden_states, self.gate_up_proj[e]).chunk(2, dim=-1)
            down = torch.einsum("ti,thi->th", torch.nn.functional.silu(gate) * up, self.down_proj[e])
            out = out + top_k_weights[:, j, None] * down
        return out


def test_module_probes_the_forward_of_experts_that_name_no_act_fn(quiet_one_rank):
    """Hand-written experts whose forward calls F.silu, naming no act_fn (a ModuleList of MLPs, a
    fused block), are taken and compute what they compute; their forward probed, one with another
    activation, or one transformers' call cannot run, is refused saying so."""
    from fo_kernels import ExpertParallelExperts, PlanError

    torch.manual_seed(6)
    x, ids, w = torch.randn(5, 16), torch.randint(0, 3, (5, 2)), torch.rand(5, 2)
    mlps = torch.nn.ModuleList(_BareMlp(torch.nn.functional.silu) for _ in range(3))
    want = torch.stack([sum(w[t, j] * mlps[int(ids[t, j])](x[t]) for j in range(2)) for t in range(5)])
    torch.testing.assert_close(ExpertParallelExperts.from_experts(mlps)(x, ids, w), want)
    fused = _BareFused()
    torch.testing.assert_close(ExpertParallelExperts.from_experts(fused)(x, ids, w), fused(x, ids, w))
    mlps[2] = _BareMlp(torch.nn.functional.gelu)
    with pytest.raises(
        PlanError, match=r"^experts: it names no act_fn, so its forward was probed, and expert 2"
    ):
        ExpertParallelExperts.from_experts(mlps)
    fused.forward = lambda hidden_states: hidden_states
    with pytest.raises(PlanError, match=r"its forward could not be probed on expert 0's rows \(TypeError"):
        ExpertParallelExperts.from_experts(fused)


def test_module_refuses_what_the_op_does_not_compute(quiet_one_rank):
    from fo_kernels import ExpertParallelExperts, PlanError, parallelize_experts

    gelu = torch.nn.ModuleList(_Mlp(torch.nn.GELU()) for _ in range(2))
    with pytest.raises(PlanError, match="not SiLU"):
        ExpertParallelExperts.from_experts(gelu)
    block = _mixtral_experts()
    block.has_bias = True
    with pytest.raises(PlanError, match="has_bias"):
        ExpertParallelExperts.from_experts(block)
    with pytest.raises(PlanError, match="neither a fused"):
        ExpertParallelExperts.from_experts(torch.nn.Linear(2, 2))
    # a SiLU act_fn under a clamped gate (DeepSeek-V4's _apply_gate, limit 10): the gate decides
    block = _mixtral_experts()
    block._apply_gate = lambda gu: block.act_fn(gu.chunk(2, -1)[0].clamp(max=10)) * gu.chunk(2, -1)[1]
    with pytest.raises(PlanError, match=r"_apply_gate\) is not silu\(gate\) \* up"):
        ExpertParallelExperts.from_experts(block)
    from transformers import GptOssConfig, Llama4TextConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    tiny = dict(hidden_size=16, intermediate_size=8, num_local_experts=4)
    with pytest.raises(PlanError, match="has_bias=True"):
        ExpertParallelExperts.from_experts(GptOssExperts(GptOssConfig(**tiny)))
    # Llama 4's experts: (E, H, 2I) weights without transformers' layout flags, called with
    # pre-weighted rows and no routing
    with pytest.raises(PlanError, match=r"gate_up_proj \(4, 16, 16\) and down_proj \(4, 8, 16\)"):
        ExpertParallelExperts.from_experts(Llama4TextExperts(Llama4TextConfig(**tiny)))
    with pytest.raises(PlanError, match="no fused experts block"):
        parallelize_experts(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    # a bad group is a GroupError whatever the model holds (checked before its blocks)
    from fo_kernels.errors import GroupError

    gone = torch.distributed.new_group([0])
    torch.distributed.destroy_process_group(gone)
    for group in (gone, 3):
        with pytest.raises(GroupError):
            parallelize_experts(torch.nn.Sequential(torch.nn.Linear(2, 2)), group=group)
    # a model whose experts blocks are all in another layout is refused naming the block and what
    # it holds: an ungated block (NemotronH's, Ergo's: up_proj, down_proj), a ModuleList of MLPs
    ungated = torch.nn.Module()
    ungated.up_proj = torch.nn.Parameter(torch.zeros(4, 16, 8))
    ungated.down_proj = torch.nn.Parameter(torch.zeros(4, 8, 16))
    model = torch.nn.ModuleDict({"mixer": torch.nn.Module()})
    model.mixer.experts = ungated
    with pytest.raises(
        PlanError, match=r"^mixer\.experts: experts: a Module holds up_proj and down_proj without a gate"
    ):
        parallelize_experts(model)
    with pytest.raises(PlanError, match=r"has_gate=False: act\(x @ up\) @ down\), not the SwiGLU"):
        ExpertParallelExperts.from_experts(ungated)
    model.mixer.experts = torch.nn.ModuleList(_Mlp(torch.nn.SiLU()) for _ in range(2))
    with pytest.raises(PlanError, match=r"^mixer\.experts: a ModuleList of expert MLPs.*from_experts"):
        parallelize_experts(model)
    with pytest.raises(PlanError, match=r"neither a fused .* it holds weight, bias"):
        ExpertParallelExperts.from_experts(torch.nn.Linear(2, 2))
    # an empty ModuleList, and an experts block passed as the model (nothing can hold its replacement)
    with pytest.raises(PlanError, match="an empty ModuleList"):
        ExpertParallelExperts.from_experts(torch.nn.ModuleList())
    with pytest.raises(PlanError, match=r"the model is itself an experts block \(MixtralExperts\)"):
        parallelize_experts(_mixtral_experts())
    # a block refused after another was taken: the model is left as it was, the error names it
    model = torch.nn.ModuleDict({"a": torch.nn.Module(), "b": torch.nn.Module()})
    model.a.experts, model.b.experts = _mixtral_experts(), _mixtral_experts()
    model.b.experts.has_bias = True
    with pytest.raises(PlanError, match=r"^b\.experts: experts: has_bias=True"):
        parallelize_experts(model)
    assert type(model.a.experts).__name__ == "MixtralExperts"


def _fused_block(gate_up: tuple[int, ...] = (4, 16, 16), down: tuple[int, ...] = (4, 16, 8)):
    """A transformers-layout fused experts block of these gate_up_proj / down_proj shapes."""
    block = torch.nn.Module()
    block.gate_up_proj = torch.nn.Parameter(torch.randn(gate_up))
    block.down_proj = torch.nn.Parameter(torch.randn(down))
    block.act_fn = torch.nn.SiLU()
    return block


def _mixed_dtypes_block():
    block = _fused_block()
    block.gate_up_proj.data = block.gate_up_proj.data.double()
    return block


def _mlps(*inters: int, weightless: bool = False) -> torch.nn.ModuleList:
    """Mixtral-style expert MLPs (w1 / w3 / w2, H 16) of these intermediate sizes; ``weightless``:
    the last one's w3 an ``nn.Identity``."""
    mlps = torch.nn.ModuleList(_Mlp(torch.nn.SiLU()) for _ in inters)
    for mlp, inter in zip(mlps, inters, strict=True):
        mlp.w1, mlp.w3 = torch.nn.Linear(16, inter, bias=False), torch.nn.Linear(16, inter, bias=False)
        mlp.w2 = torch.nn.Linear(inter, 16, bias=False)
    if weightless:
        mlps[-1].w3 = torch.nn.Identity()
    return mlps


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: None, "PlanError", r"^experts: expected an experts block \(an nn.Module\), got NoneType"),
        (lambda: torch.zeros(4, 16, 16), "PlanError", r"an nn.Module\), got Tensor"),
        (lambda: _fused_block(down=(4, 16)), "PlanError", r"down_proj \(4, 16\) are not the \(E, 2I, H\)"),
        (lambda: _fused_block(gate_up=(4, 16)), "PlanError", r"gate_up_proj \(4, 16\) and down_proj"),
        (lambda: _mlps(8, 4), "PlanError", r"^experts\[1\]: its w1 / w3 / w2 weights are \(4, 16\)"),
        (
            lambda: _mlps(8, 8, weightless=True),
            "PlanError",
            r"^experts\[1\]\.w3: expected an nn.Linear, got a layer without a weight \(Identity\)",
        ),
        (
            _mixed_dtypes_block,
            "ShapeError",
            r"^w13 is torch.float64 but w2 is torch.float32: the experts' weights must share one dtype",
        ),
    ],
)
def test_module_refuses_malformed_blocks_naming_them(quiet_one_rank, build, error, match):
    """A block that is no module, fused weights that are not 3-dim, expert MLPs of different shapes
    or without weights, and weights of two dtypes raise a ValueError naming what is wrong (not an
    AttributeError, an IndexError, torch.stack's RuntimeError or a message about an x never given)."""
    import fo_kernels
    from fo_kernels import ExpertParallelExperts

    with pytest.raises(getattr(fo_kernels, error), match=match):
        ExpertParallelExperts.from_experts(build())


def test_module_refuses_a_malformed_checkpoint_and_a_second_sharding(quiet_one_rank):
    """A checkpoint whose gate_up_proj is not 3-dim raises PlanError (not an IndexError); a model
    whose experts are sharded already, sharded again, raises AlreadyParallelizedError naming the
    block, as does from_experts of a shard; a model that is no module raises PlanError."""
    from fo_kernels import AlreadyParallelizedError, ExpertParallelExperts, PlanError, parallelize_experts

    sharded = ExpertParallelExperts.from_experts(_fused_block())
    with pytest.raises(PlanError, match=r"checkpoint's gate_up_proj \(16, 16\) and down_proj"):
        sharded.load_state_dict({"gate_up_proj": torch.zeros(16, 16), "down_proj": torch.zeros(4, 16, 8)})
    model = torch.nn.ModuleDict({"layer": torch.nn.Module()})
    model.layer.experts = _fused_block()
    assert parallelize_experts(model) == ["layer.experts"]
    with pytest.raises(
        AlreadyParallelizedError, match=r"^layer\.experts: .*already an ExpertParallelExperts"
    ):
        parallelize_experts(model)
    with pytest.raises(AlreadyParallelizedError, match=r"^experts: .*already an ExpertParallelExperts"):
        ExpertParallelExperts.from_experts(model.layer.experts)
    with pytest.raises(
        PlanError, match=r"^parallelize_experts: expected a model \(an nn.Module\), got NoneType"
    ):
        parallelize_experts(None)


def test_module_from_a_whole_moe_block_says_to_pass_its_experts(quiet_one_rank):
    """from_experts of the sparse MoE block (router and experts) rather than its experts block
    says to pass ``block.experts`` or to call parallelize_experts on the block."""
    from fo_kernels import ExpertParallelExperts, PlanError

    block = torch.nn.Module()
    block.gate, block.experts = torch.nn.Linear(16, 4, bias=False), _fused_block()
    with pytest.raises(
        PlanError, match=r"holds its experts block as \.experts: pass that \(from_experts\(blo"
    ):
        ExpertParallelExperts.from_experts(block)
