"""The custom ops (``fo_kernels.ops``): schemas, fake implementations, autograd, torch.compile, the
direct (dispatcher-free) path, and AllGather + GEMM; in this process at world size 1 and on gloo
CPU ranks (2 and 3) against float64 references."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from test_overlap_dist import make_schedule
from torch.distributed.device_mesh import init_device_mesh

import fo_kernels
from fo_kernels import GroupError, Problem, Schedule, ScheduleError, all_gather_gemm, gemm_all_reduce
from fo_kernels import groups as groups_mod
from fo_kernels import ops as ops_mod
from fo_kernels.errors import FoTuneError, ScaleError, ShapeError, SignatureError
from fo_tune.ranks.launch import run_ranks
from tp_cases import SUBGROUP, TOL, OpCase, gather_schedule, suite

ARGS = (
    "(Tensor a, Tensor b, str group_name, str schedule, Tensor? scale_a=None, Tensor? scale_b=None, "
    "ScalarType? out_dtype=None)"
)
FP8 = torch.float8_e4m3fn
SCHEMAS = {
    "all_reduce": f"fo_kernels::gemm_all_reduce{ARGS} -> Tensor",
    "reduce_scatter": f"fo_kernels::gemm_reduce_scatter{ARGS} -> Tensor",
    "all_gather": f"fo_kernels::all_gather_gemm{ARGS} -> (Tensor, Tensor)",
}


@pytest.fixture(autouse=True)
def _isolated_tables(tmp_path, monkeypatch):
    """No table anywhere: lookups fall back to the heuristic (ranks inherit the environment)."""
    monkeypatch.setenv("FO_TUNE_TABLE_DIR", str(tmp_path / "tables"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the heuristic schedule's warning
            yield
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


@pytest.mark.parametrize("collective", sorted(SCHEMAS))
def test_ops_registered_with_schema_fake_and_autograd(one_rank, collective):
    """torch.library's own check of each op: schema, fake implementation (against the real one),
    autograd registration, and AOT dispatch with dynamic shapes."""
    op = ops_mod.op(collective)
    assert str(op._schema) == SCHEMAS[collective]
    a = torch.randn(16, 8, requires_grad=True)
    b = torch.randn(12, 8).t().requires_grad_(True)
    result = torch.library.opcheck(op, (a, b, "", ""))
    assert set(result.values()) == {"SUCCESS"}, result


def test_schedule_and_group_arguments(one_rank):
    """A schedule reaches the op as its JSON text (provenance left out); a group as its name."""
    sched = Schedule(
        collective="all_gather",
        dtype="float32",
        world_size=1,
        problem=Problem(m=8, n=4, k=6),
        provenance={"source": "test"},
    )
    text = ops_mod.schedule_text(sched)
    assert "provenance" not in text and ops_mod.schedule_text(None) == ""
    assert ops_mod.parse_schedule(text) == Schedule.from_dict({**sched.to_dict(), "provenance": {}})
    assert ops_mod.parse_schedule("") is None
    with pytest.raises(ScheduleError, match="JSON"):
        ops_mod.parse_schedule("{not json")
    with pytest.raises(ScheduleError, match=r"expected a fo_kernels\.Schedule"):
        ops_mod.schedule_text({"collective": "all_gather"})
    world = dist.group.WORLD
    assert groups_mod.group_name(None) == "" and groups_mod.group_name(world) == world.group_name
    assert groups_mod.resolve_group(world.group_name) is world and groups_mod.resolve_group("") is None
    with pytest.raises(GroupError, match="no process group named 'nope'"):
        groups_mod.resolve_group("nope")
    with pytest.raises(GroupError, match="not a member"):
        gemm_all_reduce(torch.randn(2, 3), torch.randn(3, 4), group=dist.GroupMember.NON_GROUP_MEMBER)
    # an operand that is not a tensor: the op's ShapeError, not the dispatcher's RuntimeError
    with pytest.raises(ShapeError, match=r"a must be a torch\.Tensor .* got a list"):
        all_gather_gemm([[1.0, 2.0]], torch.randn(2, 4))
    with pytest.raises(ShapeError, match=r"b must be a torch\.Tensor .* got a ndarray"):
        gemm_all_reduce(torch.randn(2, 3), torch.randn(3, 4).numpy())


def test_plain_no_grad_calls_skip_the_dispatcher(one_rank, monkeypatch):
    """Plain tensors with nothing for autograd to record run the op's body directly (no
    dispatcher, no autograd node); a gradient to record goes through the registered op."""
    a, b = torch.randn(8, 6), torch.randn(6, 5)

    def no_dispatch(collective):
        raise AssertionError(f"{collective} went through the dispatcher")

    monkeypatch.setattr(ops_mod, "op", no_dispatch)
    torch.testing.assert_close(gemm_all_reduce(a, b), a @ b)
    torch.testing.assert_close(all_gather_gemm(a, b), a @ b)
    w = b.clone().requires_grad_(True)
    with torch.no_grad():
        assert gemm_all_reduce(a, w).grad_fn is None
    with pytest.raises(AssertionError, match="dispatcher"):
        gemm_all_reduce(a, w)


def test_a_table_miss_at_world_size_one_warns_nothing(one_rank):
    """One rank's call is the GEMM alone and `fo-tune search` refuses --world-size 1, so a miss
    there gives ``overlap: false`` without a HeuristicScheduleWarning naming that search."""
    a, b = torch.randn(8, 6), torch.randn(6, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fo_kernels.HeuristicScheduleWarning)
        for op in (gemm_all_reduce, fo_kernels.gemm_reduce_scatter, all_gather_gemm):
            torch.testing.assert_close(op(a, b), a @ b)
        found = fo_kernels.lookup_schedule("all_reduce", 8, 5, 6, dtype=torch.float32, world_size=1)
    assert not found.overlap


def test_compiled_block_at_world_size_one(one_rank):
    """torch.compile(fullgraph=True) of all three ops with a caller's (M-range) schedule and
    dynamic shapes: compiled equals eager, forward and backward."""
    settings = gather_schedule(1, 24, 20, 12, "float32", groups=2).settings
    sched = Schedule(
        collective="all_gather",
        dtype="float32",
        world_size=1,
        problem=Problem(m_min=1, m_max=64, n=20, k=12),
        settings=settings,
    )

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = fo_kernels.all_gather_gemm(x, w.t(), schedule=sched)
        y = fo_kernels.gemm_reduce_scatter(h.relu(), w, group=dist.group.WORLD)
        return y + gemm_all_reduce(x, w.t() @ w)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=True)
    for rows in (24, 40):
        x = torch.randn(rows, 12, requires_grad=True)
        w = torch.randn(20, 12, requires_grad=True)
        results = []
        for fn in (block, compiled):
            x.grad = w.grad = None
            y = fn(x, w)
            (y * y).sum().backward()
            results.append((y.detach(), x.grad, w.grad))
        for got, want in zip(results[1], results[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def second_order_grads(op, a0: torch.Tensor, b0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``|da|^2 + |db|^2`` in a and b, where (da, db) are the gradients of
    ``sum(y^3)``, ``y = op(a, b)``, taken with ``create_graph=True`` (a gradient penalty)."""
    a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    da, db = torch.autograd.grad((op(a, b) ** 3).sum(), (a, b), create_graph=True)
    ((da**2).sum() + (db**2).sum()).backward()
    return a.grad, b.grad


def test_double_backward_matches_matmul(one_rank):
    """A gradient of a gradient through each op (``create_graph=True``) is the plain GEMM's: the
    gathered operands a backward uses are differentiable there, not the forward's saved copies."""
    a0, b0 = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    want = second_order_grads(torch.matmul, a0, b0)
    for op in (gemm_all_reduce, fo_kernels.gemm_reduce_scatter, all_gather_gemm):
        got = second_order_grads(lambda a, b, op=op: op(a.float(), b.float()).double(), a0, b0)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m, op=op: f"{op.__name__}: {m}")


def test_float32_calls_inside_autocast_keep_float32(one_rank):
    """Inside ``torch.autocast("cpu", bfloat16)`` each op's output and both gradients (the forward
    and backward inside it, as the fake implementation and a compiled call give them) stay float32
    at float32's precision: autocast casts no custom op's arguments, and the op's local GEMMs do
    not lower the product either."""
    a0, b0, dy = torch.randn(5, 24), torch.randn(40, 24).t(), torch.randn(5, 40)
    want_y = a0.double() @ b0.double()
    want = (want_y, dy.double() @ b0.double().t(), a0.double().t() @ dy.double())
    for op in (gemm_all_reduce, fo_kernels.gemm_reduce_scatter, all_gather_gemm):
        a, b = a0.clone().requires_grad_(), b0.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                plain = op(a, b)
            y = op(a, b)
            (y * dy).sum().backward()
        got_all = (plain, y, a.grad, b.grad)
        for name, got, ref in zip(("no_grad", "y", "da", "db"), got_all, (want_y, *want), strict=True):
            assert got.dtype == torch.float32, (op.__name__, name, got.dtype)
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5, msg=f"{op.__name__} {name}")


def _bad_inputs() -> dict[str, tuple[dict, type[Exception]]]:
    """name -> (a public op's arguments, the error an eager call raises): each a ValueError
    subclass raised before any collective."""
    a, b, one, rows = torch.randn(4, 16), torch.randn(16, 32), torch.tensor(1.0), torch.ones(4, 1)
    a8, b8 = a.to(FP8), b.to(FP8)
    e5m2 = dict(a=a.to(torch.float8_e5m2), b=b.to(torch.float8_e5m2), scale_a=one, scale_b=one)
    other = Schedule(collective="all_gather", dtype="float16", world_size=1, problem=Problem(m=4, n=32, k=16))
    return {
        "k mismatch": (dict(a=a, b=torch.randn(8, 32)), ShapeError),
        "a 3-D": (dict(a=torch.randn(2, 4, 16), b=b), ShapeError),
        "a 1-D": (dict(a=torch.randn(16), b=b), ShapeError),
        "b 1-D": (dict(a=a, b=torch.randn(16)), ShapeError),
        "mixed dtypes": (dict(a=a, b=b.double()), ShapeError),
        "int32": (dict(a=a.int(), b=b.int()), ShapeError),
        "empty": (dict(a=torch.randn(0, 16), b=b), ShapeError),
        "b strided": (dict(a=a, b=torch.randn(16, 64)[:, ::2]), ShapeError),
        "scales on fp32": (dict(a=a, b=b, scale_a=one, scale_b=one), ScaleError),
        "out_dtype on fp32": (dict(a=a, b=b, out_dtype=torch.float16), ScaleError),
        "fp8 without scales": (dict(a=a8, b=b8), ScaleError),
        "fp8 and fp32": (dict(a=a8, b=b, scale_a=one, scale_b=one), ScaleError),
        "fp8 e5m2": (e5m2, ScaleError),
        "fp8 float64 scale": (dict(a=a8, b=b8, scale_a=one.double(), scale_b=one), ScaleError),
        "fp8 scale shapes": (dict(a=a8, b=b8, scale_a=rows[:3], scale_b=torch.ones(1, 32)), ScaleError),
        "fp8 out_dtype": (dict(a=a8, b=b8, scale_a=one, scale_b=one, out_dtype=torch.int32), ScaleError),
        "fp8 K of 8": (dict(a=a8[:, :8], b=b8[:8], scale_a=one, scale_b=one), ShapeError),
        "another op's schedule": (dict(a=a, b=b, schedule=other), ScheduleError),
        "not a member": (dict(a=a, b=b, group=dist.GroupMember.NON_GROUP_MEMBER), GroupError),
        # a mesh where its group goes, and a schedule's dict: refused as the op runs, when traced
        "a DeviceMesh as the group": (dict(a=a, b=b, group=init_device_mesh("cpu", (1,))), GroupError),
        "a dict as the schedule": (dict(a=a, b=b, schedule=other.to_dict()), ScheduleError),
    }


# bad inputs compiled with inductor as well (its first compile costs seconds)
INDUCTOR_TOO = ("k mismatch", "fp8 scale shapes")


def _raised(fn, args: dict) -> BaseException | None:
    args = dict(args)
    try:
        fn(args.pop("a"), args.pop("b"), **args)
    except Exception as exc:  # the test compares what each call raises
        return exc
    return None


def test_compiled_bad_input_raises_the_eager_calls_value_errors(one_rank):
    """Under torch.compile(fullgraph=True) every bad input an eager call refuses raises the eager
    call's ValueError subclass and message, not the RuntimeError Dynamo makes of an exception in
    fake propagation (the fake implementations check nothing; the op checks when the graph runs
    it); good calls, fp8 too, still trace and equal eager's."""
    public = (gemm_all_reduce, fo_kernels.gemm_reduce_scatter, all_gather_gemm)
    for name, (args, error) in _bad_inputs().items():
        for op in public:
            eager = _raised(op, args)
            assert type(eager) is error and isinstance(eager, ValueError), (name, op.__name__, eager)
            if name == "empty":  # (what to do instead)
                assert "skip the call" in str(eager) and "fo_kernels.symm_mem" in str(eager), eager
            for backend in ("aot_eager", "inductor") if name in INDUCTOR_TOO else ("aot_eager",):
                torch._dynamo.reset()  # a case's recompilation is not the test's (recompile_limit)
                compiled = _raised(torch.compile(op, fullgraph=True, backend=backend), args)
                where = (name, op.__name__, backend)
                assert type(compiled) is error and str(compiled) == str(eager), (*where, compiled)
    a, b, one = torch.randn(4, 16), torch.randn(32, 16).t(), torch.tensor(0.5)
    for op in public:
        torch._dynamo.reset()
        compiled = torch.compile(op, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(a, b), op(a, b))
        fp8 = dict(scale_a=one, scale_b=one)
        got = compiled(a.to(FP8), b.to(FP8), **fp8)
        assert got.dtype == torch.bfloat16 and got.shape == (4, 32)
        torch.testing.assert_close(got, op(a.to(FP8), b.to(FP8), **fp8))


def _check_cases(results: list[list[dict]], world: int) -> None:
    assert len(results) == world
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            c = r["case"]
            where = f"rank {rank}: {c.collective} {c.m}x{c.n}x{c.k} {c.dtype} kmajor={c.kmajor} {c.schedule}"
            assert r["shape_ok"], where
            for name, err in r["errs"].items():
                assert err < TOL[c.dtype], f"{where}: {name} relative error {err:.2e}"


def _cases(world: int) -> list[OpCase]:
    """Every op, eager, forward and both gradients: the heuristic schedule, an overlap: false row,
    and for all_gather Triton schedules of 1-3 groups (odd shapes, both B layouts, two dtypes)."""
    cases, seed = [], 0
    for collective in ("all_reduce", "reduce_scatter", "all_gather"):
        m = 6 * world if collective != "all_gather" else 19
        for dtype, kmajor in (("float32", False), ("float16", True)):
            seed += 1
            cases.append(OpCase(collective, m, 33, 20, dtype, kmajor, None, seed))
        problem = Problem(m=m * world if collective == "all_gather" else m, n=33, k=20)
        off = Schedule(collective=collective, dtype="float32", world_size=world, problem=problem)
        cases.append(OpCase(collective, m, 33, 20, "float32", True, off.to_dict(), 50 + seed))
    for i, (m, n, k, groups) in enumerate([(19, 33, 20, 3), (8, 64, 16, 1), (37, 20, 9, 2)]):
        s = gather_schedule(world, m * world, n, k, "float32", groups)
        cases.append(OpCase("all_gather", m, n, k, "float32", i % 2 == 1, s.to_dict(), 100 + i))
    s = gather_schedule(world, 40 * world, 48, 24, "float16", 2)
    cases.append(OpCase("all_gather", 40, 48, 24, "float16", True, s.to_dict(), 200))
    return cases


def _subgroup_cases() -> list[OpCase]:
    """``tp_cases.subgroup_ops``' cases for its group of 2 (M 12, an all_gather's shard 5 rows):
    each op looked up (overlap: false), then reduce_scatter and all_gather on the Triton engine."""
    world = len(SUBGROUP)
    rs = make_schedule("reduce_scatter", world, 12, 33, 20, "float16", "row_band").to_dict()
    ag = gather_schedule(world, 5 * world, 33, 20, "float32", 2).to_dict()
    return [
        OpCase("all_reduce", 12, 33, 20, "float32", False, None, 300),
        OpCase("reduce_scatter", 12, 33, 20, "float16", True, None, 301),
        OpCase("all_gather", 5, 33, 20, "float32", True, None, 302),
        OpCase("reduce_scatter", 12, 33, 20, "float16", False, rs, 303),
        OpCase("all_gather", 5, 33, 20, "float32", False, ag, 304),
    ]


def _check_subgroup(results: list[dict]) -> None:
    """``tp_cases.subgroup_ops``' results, in global rank order."""
    for rank, r in enumerate(results):
        assert r["world_table"] == (15, 8), (rank, r)
        if rank not in SUBGROUP:
            for name, msg in r["outside"].items():
                assert msg.startswith("GroupError: group: this rank is not a member"), (name, msg)
            continue
        _check_cases([r["cases"]], 1)
        assert len(r["cases"]) == 5, r["cases"]
        assert all(err < TOL["float32"] for err in r["views"].values()), (rank, r["views"])
        assert r["group_table"].startswith("EnvironmentMismatchError: engine copy_engine needs CUDA"), r


@pytest.mark.parametrize("world", [2, 3])
def test_ops_on_gloo_ranks(world, tmp_path):
    """On ``world`` gloo ranks (one start of them): every op's forward and gradients against
    float64; a compiled block (fullgraph, aot_eager) equals eager; bad input raises before any
    collective. At 3 ranks the ops also run on a group of ranks 0 and 2 (``_check_subgroup``): its
    ranks' results against float64, a lookup reads the table of the group's size, and rank 1,
    outside it, gets a GroupError from each op."""
    parts = {
        "cases": ("op_cases", _cases(world)),
        "compiled": ("compiled_ops", {"m": 8, "k": 24, "n": 40, "backend": "aot_eager"}),
        "bad": ("op_bad_inputs", str(tmp_path)),
    }
    if world == 3:
        parts["subgroup"] = ("subgroup_ops", {"cases": _subgroup_cases(), "root": str(tmp_path)})
    results = run_ranks(suite, world, parts, backend="gloo")
    _check_cases([r["cases"] for r in results], world)
    if world == 3:
        _check_subgroup([r["subgroup"] for r in results])
    for rank, r in enumerate(results):
        assert all(e < 1e-6 for e in r["compiled"].values()), r["compiled"]
        msgs = r["bad"]
        assert msgs["ag_k_mismatch"].startswith("ShapeError: K mismatch"), msgs
        assert msgs["ag_shard_problem"].startswith("ScheduleError: problem:"), msgs
        assert f"the gathered rows: 6 per rank x {world} ranks" in msgs["ag_shard_problem"], msgs
        for name in ("ag_copy_engine", "rs_backward_engine"):  # before any collective, on every rank
            assert msgs[name].startswith("EnvironmentMismatchError: engine copy_engine needs CUDA"), msgs
        assert msgs["ag_tile_major"].startswith("ScheduleError: layout: all_gather"), msgs
        assert msgs["group_not_a_group"].startswith("GroupError:"), msgs
        if world == 2:
            assert msgs["compiled_grad_rows"].startswith("ShapeError: reduce_scatter needs M divisible"), msgs
        assert msgs["group_destroyed"].startswith("GroupError: group: the process group was destroyed"), msgs
        if rank == 2:
            assert "not a member" in msgs["group_not_member"], msgs


def test_every_collective_entry_point_before_init_process_group_raises_one_error():
    """The dense ops, torch's fused-op signatures, the layers, parallelize_linears and the MoE
    call all refuse a call before ``init_process_group`` with one type and one message, a
    ``ValueError`` that is also the ``ArgumentError`` / ``ScheduleError`` they raised apart."""
    from torch import nn

    from fo_kernels import ArgumentError, NotInitializedError, expert_parallel_ffn, symm_mem
    from fo_kernels import parallel as fo_tp

    assert not dist.is_initialized()
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    calls = {
        "gemm_all_reduce": lambda: gemm_all_reduce(a, b),
        "all_gather_gemm": lambda: all_gather_gemm(a, b),
        "gemm_reduce_scatter": lambda: fo_kernels.gemm_reduce_scatter(a, b),
        "fused_all_gather_matmul": lambda: symm_mem.fused_all_gather_matmul(a, [b], 0, ""),
        "fused_matmul_reduce_scatter": lambda: symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, ""),
        "ColumnParallelLinear": lambda: fo_kernels.ColumnParallelLinear(8, 4),
        "RowParallelLinear": lambda: fo_kernels.RowParallelLinear(8, 4),
        "parallelize_linears": lambda: fo_tp.parallelize_linears(
            nn.Sequential(nn.Linear(8, 4)), {"0": "row"}
        ),
        "expert_parallel_ffn": lambda: expert_parallel_ffn(
            torch.randn(2, 8),
            torch.zeros(2, 1, dtype=torch.int64),
            torch.ones(2, 1),
            torch.randn(1, 8, 4),
            torch.randn(1, 2, 8),
        ),
    }
    messages = set()
    for name, call in calls.items():
        with pytest.raises(NotInitializedError) as info:
            call()
        messages.add(str(info.value))
        assert all(isinstance(info.value, t) for t in (ArgumentError, ScheduleError, GroupError)), name
    (message,) = messages
    assert "torch.distributed.init_process_group" in message and "group" in message


@pytest.mark.parametrize("gather_dim", [0, 1])
def test_fused_all_gather_matmul_gathered_a_is_differentiable(one_rank, gather_dim):
    """The gathered A that ``return_A`` gives carries its gradient back to the shard (an
    AllGather's backward, a ReduceScatter), beside the products'; the reference path's does too."""
    from fo_kernels import symm_mem

    shard, b = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    want = 2 * shard + torch.ones(2, 3, 5, dtype=torch.float64) @ b.t()
    for dtype in (torch.float32, torch.float64):  # the ops' path, torch's reference path
        a = shard.to(dtype).requires_grad_()
        gathered, (y,) = symm_mem.fused_all_gather_matmul(a, [b.to(dtype)], gather_dim, "")
        ((gathered**2).sum() + y.sum()).backward()
        torch.testing.assert_close(a.grad.double(), want, rtol=1e-5, atol=1e-5)


def test_all_gather_gemm_takes_its_shard_as_a_shard_or_as_a(one_rank):
    # the fp8 API names the first operand a in all three ops: all_gather_gemm takes a= as well
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    want = all_gather_gemm(a, b)
    assert torch.equal(all_gather_gemm(a=a, b=b), want)
    assert torch.equal(all_gather_gemm(a_shard=a, b=b), want)
    torch.testing.assert_close(want, a @ b)
    # a fo-tune error (one ``except FoTuneError`` catches every refusal) and a TypeError, as Python's
    with pytest.raises(SignatureError, match=r"as a_shard \(first\) or as a=") as raised:
        all_gather_gemm(a, b, a=a)
    assert isinstance(raised.value, FoTuneError) and isinstance(raised.value, TypeError)
    with pytest.raises(SignatureError, match=r"as a_shard \(first\) or as a="):
        all_gather_gemm(b=b)
    with pytest.raises(SignatureError, match="missing its second operand b"):
        all_gather_gemm(a)


def test_fused_all_gather_matmul_refuses_a_return_a_that_is_not_a_bool(one_rank):
    """torch's op schema takes ``return_A`` as a bool; a string such as "no", which Python reads as
    true, is an ``ArgumentError`` naming it, before any collective."""
    from fo_kernels import symm_mem
    from fo_kernels.errors import ArgumentError

    a, b = torch.randn(2, 3, 4), torch.randn(4, 5)
    for flag in ("no", 0, None):
        with pytest.raises(ArgumentError, match="return_A: expected True or False"):
            symm_mem.fused_all_gather_matmul(a, [b], 0, "", return_A=flag)
    assert symm_mem.fused_all_gather_matmul(a, [b], 0, "", return_A=False)[0] is None


def test_meta_tensors_give_the_output_shapes_and_the_eager_calls_errors(one_rank):
    """A model built on the meta device runs for its shapes, as ``nn.Linear`` and torch's fused
    ops do: every op, the fused signatures and both layers give meta outputs (the backward too),
    with the eager call's ``ShapeError`` for operands an eager call refuses, a meta and a CPU one
    mixed included."""
    from fo_kernels import ColumnParallelLinear, RowParallelLinear, symm_mem

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device="meta")

    for op in (gemm_all_reduce, fo_kernels.gemm_reduce_scatter, all_gather_gemm):
        a = meta(4, 8).requires_grad_()
        y = op(a, meta(6, 8).t())
        assert y.shape == (4, 6) and y.is_meta, op.__name__
        y.sum().backward()
        assert a.grad.shape == (4, 8) and a.grad.is_meta, op.__name__
        with pytest.raises(ShapeError, match="K mismatch"):
            op(meta(4, 8), meta(7, 6))
        for a, b in ((torch.randn(4, 8), meta(8, 6)), (meta(4, 8), torch.randn(8, 6))):
            with pytest.raises(ShapeError, match="a is on"):
                op(a, b)
    gathered, (y,) = symm_mem.fused_all_gather_matmul(meta(2, 4, 8), [meta(8, 6)], 1, "")
    assert gathered.shape == (2, 4, 8) and y.shape == (2, 4, 6) and y.is_meta
    assert symm_mem.fused_matmul_reduce_scatter(meta(2, 4, 8), meta(8, 6), "avg", 1, "").is_meta
    with torch.device("meta"):
        col = ColumnParallelLinear(8, 6, sequence_parallel=True)
        row = RowParallelLinear(6, 8)
    x = meta(3, 5, 8).requires_grad_()
    y = row(col(x))
    assert y.shape == (3, 5, 8) and y.is_meta
    y.sum().backward()
    assert x.grad.is_meta and col.weight.grad.shape == (6, 8)


def test_compiled_fused_ops_and_layers_raise_the_eager_calls_value_errors(one_rank):
    """Under torch.compile(fullgraph=True) bad arguments of torch's fused-op signatures and of
    the layers raise the eager call's ``ValueError`` subclass and message when the graph runs
    (``fo_kernels.refusal``), not Dynamo's ``Unsupported``; the good calls still trace whole."""
    from fo_kernels import ColumnParallelLinear, RowParallelLinear, symm_mem
    from fo_kernels.errors import ArgumentError

    a, b = torch.randn(2, 4, 8), torch.randn(8, 6)
    col, row = ColumnParallelLinear(8, 6), RowParallelLinear(8, 6, sequence_parallel=True)

    def gather(a, b, gather_dim=0, return_a=True):
        gathered, (y,) = symm_mem.fused_all_gather_matmul(a, [b], gather_dim, "", return_A=return_a)
        return y if gathered is None else y.sum() + gathered.sum()

    def scatter(a, b, reduce_op="sum", scatter_dim=0):
        return symm_mem.fused_matmul_reduce_scatter(a, b, reduce_op, scatter_dim, "") * 2

    cases = {
        "ag K": (gather, (a, torch.randn(7, 6)), ShapeError),
        "ag dim": (gather, (a, b, 3), ShapeError),
        "ag return_A": (gather, (a, b, 0, "no"), ArgumentError),
        "rs op": (scatter, (a, b, "max"), ArgumentError),
        "rs dim": (scatter, (a, b, "sum", -4), ShapeError),
        "rs group": (
            lambda a, b: symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, "nope"),
            (a, b),
            GroupError,
        ),
        "col features": (col, (torch.randn(3, 7),), ShapeError),
        "row features": (row, (torch.randn(3, 7).requires_grad_(),), ShapeError),
    }
    # (dynamic shapes: the message's sizes are made ints, which a refused op's text needs)
    runs = [(name, False) for name in cases] + [("ag K", True), ("row features", True)]
    for name, dynamic in runs:
        fn, args, error = cases[name]
        eager = _raised_by(fn, args)
        assert type(eager) is error, (name, eager)
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)
        raised = _raised_by(compiled, args)
        assert type(raised) is error and str(raised) == str(eager), (name, dynamic, raised)
    for fn, args in ((gather, (a, b, 1)), (row, (a,))):  # (test_parallel.py and test_layers.py: the rest)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="aot_eager")(*args), fn(*args))


def _raised_by(fn, args: tuple) -> BaseException | None:
    try:
        fn(*args)
    except Exception as exc:  # the test compares what each call raises
        return exc
    return None


def test_dtensor_operands_are_a_shape_error_naming_to_local(one_rank):
    """The ops and torch's fused signatures take this rank's local tensors: a DTensor operand (a
    parallelized module's weight) is a ``ShapeError`` saying to pass ``.to_local()``, not the
    RuntimeError or NotImplementedError of torch's DTensor dispatch."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from fo_kernels import symm_mem

    mesh = init_device_mesh("cpu", (1,))
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    da, db = (distribute_tensor(t, mesh, [Replicate()]) for t in (a, b))
    calls = [
        lambda op=op, x=x, y=y: op(x, y)
        for op in (gemm_all_reduce, all_gather_gemm)
        for x, y in ((da, b), (a, db))
    ]
    calls += [
        lambda: fo_kernels.gemm_reduce_scatter(da, db),
        lambda: symm_mem.fused_all_gather_matmul(a, [b, db], 0, ""),
        lambda: symm_mem.fused_matmul_reduce_scatter(da, b, "sum", 0, ""),
    ]
    for call in calls:
        with pytest.raises(ShapeError, match=r"is a DTensor .*\.to_local\(\)"):
            call()
