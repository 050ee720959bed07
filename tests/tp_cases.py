"""Rank functions for the custom-op and tensor-parallel tests (spawned processes import this module).

Every rank draws the operands of every rank from seeds all ranks share, so each rank builds its own
float64 reference of the unsharded computation (forward and gradients) without a collective.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from dist_cases import Case
from fo_kernels import (
    ColumnParallelLinear,
    EnvironmentMismatchError,
    FoTuneError,
    GroupError,
    Problem,
    RowParallelLinear,
    Schedule,
    ScheduleError,
    ShapeError,
    TritonSettings,
    all_gather_gemm,
    gemm_all_reduce,
    gemm_reduce_scatter,
)
from fo_kernels.plan import cdiv
from fo_kernels.tile import Tile
from fo_tune.engines.triton.defaults import split_decreasing

DTYPES = {"float32": torch.float32, "float16": torch.float16}
TOL = {"float32": 1e-5, "float16": 5e-3}
TILE = Tile(block_m=16, block_n=32, block_k=16, group_m=1, num_warps=4, num_stages=1)
OPS = {"all_reduce": gemm_all_reduce, "reduce_scatter": gemm_reduce_scatter, "all_gather": all_gather_gemm}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def gather_schedule(world: int, m: int, n: int, k: int, dtype: str, groups: int) -> Schedule:
    """A Triton all_gather schedule for a gathered (m, n, k): one band of tile rows per unit."""
    tiles_n = cdiv(n, TILE.block_n)
    unit = world * TILE.group_m * tiles_n
    units = cdiv(world * cdiv(m // world, TILE.block_m) * tiles_n, unit)
    return Schedule(
        collective="all_gather",
        dtype=dtype,
        world_size=world,
        problem=Problem(m=m, n=n, k=k),
        settings=TritonSettings(
            tile=TILE,
            signal_tiles=unit,
            groups=split_decreasing(units, groups),
            layout="row_band",
            wait_mode="spin",
        ),
    )


# One op call (the fields of the forward cases'): ``m`` is the rows of ``a`` on every rank (a
# shard's rows for all_gather).
OpCase = Case


def _operands(
    case: OpCase, rank: int, world: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, b, dy) of ``rank``: dy is the output's gradient (for all_reduce the same on every rank,
    as every rank holds the same output)."""
    gen = torch.Generator().manual_seed(case.seed * 7919 + rank)
    a = torch.randn(case.m, case.k, generator=gen)
    b = (
        torch.randn(case.n, case.k, generator=gen).t()
        if case.kmajor
        else torch.randn(case.k, case.n, generator=gen)
    )
    out_rows = {"all_reduce": case.m, "reduce_scatter": case.m // world, "all_gather": case.m * world}
    shared = torch.Generator().manual_seed(case.seed * 7919 - 1)
    dy = torch.randn(
        out_rows[case.collective], case.n, generator=shared if case.collective == "all_reduce" else gen
    )
    return a.to(dtype), b.to(dtype), dy.to(dtype)


def _reference(case: OpCase, rank: int, world: int):
    """(y, da, db) of ``rank`` in float64 from the unsharded computation and the loss sum_r <dy_r, y_r>."""
    per = [_operands(case, r, world, torch.float64) for r in range(world)]
    a = [p[0].clone().requires_grad_(True) for p in per]
    b = [p[1].clone().requires_grad_(True) for p in per]
    if case.collective == "all_gather":
        full = torch.cat(a)
        ys = [full @ b[r] for r in range(world)]
    else:
        total = sum(a[r] @ b[r] for r in range(world))
        rows = case.m // world
        ys = [
            total if case.collective == "all_reduce" else total[r * rows : (r + 1) * rows]
            for r in range(world)
        ]
    if case.collective == "all_reduce":
        loss = (ys[0] * per[0][2]).sum()  # every rank holds the same output and gradient
    else:
        loss = sum((ys[r] * per[r][2]).sum() for r in range(world))
    loss.backward()
    return ys[rank].detach(), a[rank].grad, b[rank].grad


def op_cases(ctx, cases: list[OpCase]) -> list[dict]:
    """Each case's forward and gradients, eagerly, against the float64 reference."""
    return [op_case(case, ctx.rank, ctx.world_size) for case in cases]


def op_case(case: OpCase, rank: int, world: int, group: dist.ProcessGroup | None = None) -> dict:
    """``case`` on ``rank`` of ``group`` (of ``world`` ranks; None: the default group): the output
    without autograd, then the output and both gradients, against the float64 reference."""
    dtype = DTYPES[case.dtype]
    a, b, dy = _operands(case, rank, world, dtype)
    a.requires_grad_(True)
    b.requires_grad_(True)
    sched = Schedule.from_dict(case.schedule) if case.schedule is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            plain = OPS[case.collective](a.detach(), b.detach(), schedule=sched, group=group)
        y = OPS[case.collective](a, b, schedule=sched, group=group)
        (y * dy).sum().backward()
    ref_y, ref_da, ref_db = _reference(case, rank, world)
    return dict(
        case=case,
        shape_ok=tuple(y.shape) == tuple(ref_y.shape) == tuple(plain.shape),
        errs={
            "no_grad": rel(plain, ref_y),
            "y": rel(y, ref_y),
            "da": rel(a.grad, ref_da),
            "db": rel(b.grad, ref_db),
        },
    )


def compiled_ops(ctx, payload: dict) -> dict[str, float]:
    """A block of all three ops under torch.compile(fullgraph=True): forward and gradients equal
    eager ones (relative errors), the process group passed as an object and by default."""
    world, m, k, n = ctx.world_size, payload["m"], payload["k"], payload["n"]
    group = dist.new_group(list(range(world)))
    gen = torch.Generator().manual_seed(11 + ctx.rank)
    a = torch.randn(m, k, generator=gen, requires_grad=True)
    w1 = torch.randn(n, k, generator=gen, requires_grad=True)
    w2 = torch.randn(k, n, generator=gen, requires_grad=True)
    sched = gather_schedule(world, m * world, n, k, "float32", groups=2)

    def block(a: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = all_gather_gemm(a, w1.t(), group=group, schedule=sched).relu()  # (world*m, n)
        y = gemm_reduce_scatter(h, w2.t(), group=group)  # (m, k)
        return gemm_all_reduce(y, w1.t()).sum(0)

    def run(fn) -> list[torch.Tensor]:
        for t in (a, w1, w2):
            t.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fn(a, w1, w2)
            (out * torch.linspace(-1, 1, out.numel())).sum().backward()
        return [out.detach(), a.grad, w1.grad, w2.grad]

    eager = run(block)
    torch._dynamo.reset()
    compiled = run(torch.compile(block, fullgraph=True, backend=payload["backend"]))
    return {name: rel(c, e) for name, c, e in zip(("y", "da", "dw1", "dw2"), compiled, eager, strict=True)}


# The ranks of a 3-rank job that ``subgroup_ops`` groups: not contiguous, so global rank 2 is the
# group's rank 1, and rank 1 is outside the group.
SUBGROUP = (0, 2)


def _message(call) -> str:
    """``call``'s fo-tune error as "Type: message", or "NO ERROR" (any other error fails the test)."""
    try:
        call()
    except FoTuneError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "NO ERROR"


def _view_operands(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group rank ``rank``'s (a, b) of ``subgroup_ops``' views: a (4, 8) strided slice at a storage
    offset, b (8, 6) the transposed view of rows 2..7 of an (N, K) weight (a storage offset too)."""
    gen = torch.Generator().manual_seed(60 + rank)
    return torch.randn(8, 12, generator=gen)[1:5, 3:11], torch.randn(9, 8, generator=gen)[2:8].t()


def _views_on_group(group: dist.ProcessGroup, rank: int, world: int) -> dict[str, float]:
    """Each op under ``torch.inference_mode()`` on ``_view_operands`` over ``group``; name ->
    relative error against float64."""
    per = [[t.double() for t in _view_operands(r)] for r in range(world)]
    total = sum(a @ b for a, b in per)
    want = {
        "all_reduce": total,
        "reduce_scatter": total.chunk(world)[rank],
        "all_gather": torch.cat([a for a, _ in per]) @ per[rank][1],
    }
    a, b = _view_operands(rank)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: rel(op(a, b, group=group), want[name]) for name, op in OPS.items()}


def subgroup_ops(ctx, payload: dict) -> dict[str, object]:
    """The ops on a process group of ``SUBGROUP``'s ranks of 3. On its ranks: each of
    ``payload["cases"]`` (made for 2 ranks) against float64 as the group's ranks compute it, each op
    on views (``_views_on_group``), and a lookup that reads the table of the group's size: a world
    size 2 table (under ``payload["root"]``) whose row names the copy engine, refused on the CPU
    before any collective. On rank 1 each op's refusal of the group. Then every rank calls the same
    shape on the default group, whose lookup (world size 3) finds no row and runs."""
    group = dist.new_group(list(SUBGROUP))
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    out: dict[str, object] = {}
    mine = os.path.join(payload["root"], f"subgroup-rank{ctx.rank}")
    _write_table(len(SUBGROUP), _copy_engine_gather(len(SUBGROUP), rows=5, n=8, k=6), mine)
    shard, weight = torch.randn(5, 6), torch.randn(6, 8)
    if ctx.rank not in SUBGROUP:
        out["outside"] = {name: _message(lambda op=op: op(a, b, group=group)) for name, op in OPS.items()}
    else:
        rank, world = SUBGROUP.index(ctx.rank), len(SUBGROUP)
        out["cases"] = [op_case(c, rank, world, group) for c in payload["cases"]]
        out["views"] = _views_on_group(group, rank, world)
    before = os.environ.get("FO_TUNE_TABLE_DIR")
    os.environ["FO_TUNE_TABLE_DIR"] = mine
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if ctx.rank in SUBGROUP:
                out["group_table"] = _message(lambda: all_gather_gemm(shard, weight, group=group))
            out["world_table"] = tuple(all_gather_gemm(shard, weight).shape)
    finally:
        os.environ["FO_TUNE_TABLE_DIR"] = before or ""
    return out


def _write_table(world: int, row: Schedule, root: str) -> None:
    from fo_kernels import ScheduleTable, current_fingerprint, save_table
    from fo_kernels.table import table_path

    fp = current_fingerprint("cpu", world)
    table = ScheduleTable(
        fingerprint=fp, collective=row.collective, world_size=world, dtype=row.dtype, rows=[row]
    )
    path = table_path(root, fp.device_key, row.collective, world, row.dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_table(table, path)


def op_bad_inputs(ctx, root: str) -> dict[str, str]:
    """Each bad call must raise a ValueError subclass from fo_kernels.errors; name -> message.
    ``root`` is a folder for this test's tables (each rank writes its own)."""
    world = ctx.world_size
    a = torch.randn(6, 8)
    b = torch.randn(8, 6)
    others = dist.new_group([0, 1])  # on rank 2 of 3: GroupMember.NON_GROUP_MEMBER
    mine = os.path.join(root, f"rank{ctx.rank}")
    # gemm_reduce_scatter of (4w, 8) @ (8, 6): its backward is all_gather_gemm of (4, 6) @ (6, 8),
    # whose table row names an engine that cannot run here (the copy engine needs GPUs)
    _write_table(world, _copy_engine_gather(world, rows=4, n=8, k=6), mine)

    def backward_needs_copy_engine() -> None:
        before = os.environ.get("FO_TUNE_TABLE_DIR")
        os.environ["FO_TUNE_TABLE_DIR"] = mine
        try:
            x = torch.randn(4 * world, 8, requires_grad=True)
            gemm_reduce_scatter(x, b).sum().backward()
        finally:
            os.environ["FO_TUNE_TABLE_DIR"] = before or ""

    def compiled_grad_rows() -> None:
        # a compiled forward whose input needs a gradient traces the backward too (AOTAutograd)
        torch._dynamo.reset()
        x = torch.randn(4 * world + 1, 8, requires_grad=True)
        torch.compile(lambda x: gemm_reduce_scatter(x, b), fullgraph=True, backend="aot_eager")(x)

    destroyed = dist.new_group(list(range(world)))
    gemm_all_reduce(a, b, group=destroyed)  # (the runtime of this group is made and cached)
    dist.destroy_process_group(destroyed)
    calls = {
        "group_destroyed": lambda: gemm_all_reduce(a, b, group=destroyed),
        "ag_k_mismatch": lambda: all_gather_gemm(a, torch.randn(7, 6)),
        "ag_shard_problem": lambda: all_gather_gemm(a, b, schedule=_shard_row(world)),
        "ag_copy_engine": lambda: all_gather_gemm(
            a, b, schedule=_copy_engine_gather(world, rows=6, n=6, k=8)
        ),
        "ag_tile_major": lambda: TritonSettings(
            tile=TILE, groups=(1,), signal_tiles=world, layout="tile_major"
        ).check("all_gather", world),
        "rs_backward_engine": backward_needs_copy_engine,
        "group_not_a_group": lambda: all_gather_gemm(a, b, group="tp"),
    }
    if world == 2:  # (one compile: ~5 s of CPU a rank)
        calls["compiled_grad_rows"] = compiled_grad_rows
    if ctx.rank == 2:
        calls["group_not_member"] = lambda: gemm_all_reduce(a, b, group=others)
    msgs = {}
    for name, call in calls.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                call()
        except (ShapeError, ScheduleError, GroupError, EnvironmentMismatchError) as exc:
            # bad input is a ValueError; an engine this machine cannot run a RuntimeError
            assert isinstance(exc, RuntimeError if isinstance(exc, EnvironmentMismatchError) else ValueError)
            msgs[name] = f"{type(exc).__name__}: {exc}"
        else:
            msgs[name] = "NO ERROR"
    dist.barrier()  # every rank is still in step: no collective was left half-started
    return msgs


def _shard_row(world: int) -> Schedule:
    """An all_gather schedule written for the shard's M instead of the gathered one."""
    return Schedule(
        collective="all_gather", dtype="float32", world_size=world, problem=Problem(m=6, n=6, k=8)
    )


def _copy_engine_gather(world: int, *, rows: int, n: int, k: int) -> Schedule:
    """An ``engine: copy_engine`` all_gather schedule for shards of ``rows`` rows."""
    return Schedule.from_dict(
        dict(
            collective="all_gather",
            dtype="float32",
            world_size=world,
            problem=dict(m=rows * world, n=n, k=k),
            engine="copy_engine",
            settings=dict(mode="ring", weights=[1, 1]),
        )
    )


# ---------------------------------------------------------------------------------- layers
class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class ShardedMLP(nn.Module):
    def __init__(self, full: MLP, sequence_parallel: bool, group) -> None:
        super().__init__()
        self.up = ColumnParallelLinear.from_linear(full.up, sequence_parallel=sequence_parallel, group=group)
        self.down = RowParallelLinear.from_linear(full.down, sequence_parallel=sequence_parallel, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _sharded_mlp(full: MLP, sp: bool, backend: str | None, group=None) -> tuple[ShardedMLP, nn.Module]:
    """(the sharded MLP over ``group``, what a case calls: it, or it compiled with ``backend``),
    Dynamo reset."""
    torch._dynamo.reset()
    sharded = ShardedMLP(full, sp, group)
    return sharded, sharded if backend is None else torch.compile(sharded, fullgraph=True, backend=backend)


def _shard_of(want: tuple[torch.Tensor, ...], mine: slice, rank: int, width: int) -> tuple[torch.Tensor, ...]:
    """The unsharded MLP's ``_grads`` as this rank's sharded MLP gives them: its rows ``mine``, its
    ``width`` inner features."""
    cols = slice(rank * width, (rank + 1) * width)
    return (want[0][mine], want[1][mine], want[2][cols], want[3][cols], want[4][:, cols], want[5])


# What ``_grads`` returns, in order.
GRAD_NAMES = ("y", "dx", "dw_up", "db_up", "dw_down", "db_down")


def _grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    for p in module.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    (y * dy).sum().backward()
    return (
        y.detach(),
        x.grad,
        module.up.weight.grad,
        module.up.bias.grad,
        module.down.weight.grad,
        module.down.bias.grad,
    )


def mlp_cases(ctx, payload: dict) -> list[dict]:
    """Column- then row-parallel MLP against the unsharded one, forward and backward: for each
    (sequence_parallel, backend) in ``payload["runs"]`` (backend None: eager)."""
    return _mlp_runs(payload, ctx.rank, ctx.world_size)


def subgroup_mlp(ctx, payload: dict) -> list[dict]:
    """``mlp_cases`` on a process group of ``SUBGROUP``'s ranks (``payload`` made for its size), by
    its ranks; a rank outside it gets ``[]``."""
    group = dist.new_group(list(SUBGROUP))
    if ctx.rank not in SUBGROUP:
        return []
    return _mlp_runs(payload, SUBGROUP.index(ctx.rank), len(SUBGROUP), group)


def _mlp_runs(payload: dict, rank: int, world: int, group=None) -> list[dict]:
    """``mlp_cases``' runs on ``rank`` of ``group`` (of ``world`` ranks; None: the default group),
    the output also without autograd (``torch.no_grad``, ``torch.inference_mode``)."""
    batch, seq, hidden, inner = payload["batch"], payload["seq"], payload["hidden"], payload["inner"]
    torch.manual_seed(5)  # the same full model, input and output gradient on every rank
    full = MLP(hidden, inner)
    x = torch.randn(batch, seq, hidden)
    dy = torch.randn(batch, seq, hidden)
    want = _grads(full, x, dy)
    out = []
    for sp, backend in payload["runs"]:
        _sharded, model = _sharded_mlp(full, sp, backend, group)
        rows = batch // world
        mine = slice(rank * rows, (rank + 1) * rows) if sp else slice(None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = dict(zip(GRAD_NAMES, _grads(model, x[mine], dy[mine]), strict=True))
            with torch.no_grad():  # the plain (no autograd) path gives the same output
                got["y_no_grad"] = model(x[mine])
            with torch.inference_mode():
                got["y_inference"] = model(x[mine])
        ref = dict(zip(GRAD_NAMES, _shard_of(want, mine, rank, inner // world), strict=True))
        ref["y_no_grad"] = ref["y_inference"] = ref["y"]
        out.append(dict(sp=sp, backend=backend, errs={k: rel(got[k], ref[k]) for k in ref}))
    return out


def empty_inputs(ctx, _payload) -> dict[str, object]:
    """An input with no rows, as ``nn.Linear`` takes it: name -> (output shape, input gradient
    shape, largest parameter gradient) for each (sequence_parallel, backend, input shape), and an fp8 pair's
    output shape and dtype under no_grad and what its backward raises."""
    from fo_kernels import Fp8TrainingError

    world = ctx.world_size
    torch.manual_seed(5)
    full = MLP(16, 16 * world)
    out: dict[str, object] = {}
    for sp in (False, True):
        for backend in (None, "aot_eager"):
            sharded, model = _sharded_mlp(full, sp, backend)
            for shape in ((0, 3, 16), (2 * world, 0, 16)):
                x = torch.randn(shape, requires_grad=True)
                y = model(x)
                y.sum().backward()
                biggest = max(p.grad.abs().max().item() for p in sharded.parameters())
                out[f"sp={sp} {backend} {shape}"] = (tuple(y.shape), tuple(x.grad.shape), biggest)
    fp8 = nn.Sequential(
        ColumnParallelLinear.from_linear(nn.Linear(16, 16 * world), fp8="rowwise"),
        RowParallelLinear.from_linear(nn.Linear(16 * world, 16), fp8="tensorwise"),
    )
    with torch.no_grad():
        y = fp8(torch.randn(0, 16))
    out["fp8"] = (tuple(y.shape), str(y.dtype))
    try:
        fp8(torch.randn(0, 16, requires_grad=True)).sum().backward()
        out["fp8_backward"] = "NO ERROR"
    except Fp8TrainingError as exc:
        out["fp8_backward"] = type(exc).__name__
    return out


def autocast_cases(ctx, _payload) -> dict[str, object]:
    """The MLP inside ``torch.autocast`` (bfloat16) against the unsharded one inside it, as
    ``F.linear`` casts its operands: name -> (output dtype, largest relative error of the output,
    input and parameter gradients) for each (sequence_parallel, backend)."""
    rank, world = ctx.rank, ctx.world_size
    torch.manual_seed(5)
    full = MLP(16, 16 * world)
    x = torch.randn(2 * world, 3, 16)
    dy = torch.randn(2 * world, 3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _grads(full, x, dy)
    out: dict[str, object] = {}
    for sp in (False, True):
        for backend in (None, "aot_eager"):
            _sharded, model = _sharded_mlp(full, sp, backend)
            mine = slice(rank * 2, (rank + 1) * 2) if sp else slice(None)
            with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
                warnings.simplefilter("ignore")
                got = _grads(model, x[mine], dy[mine])
            ref = _shard_of(want, mine, rank, 16)
            out[f"sp={sp} {backend}"] = (
                str(got[0].dtype),
                max(rel(g, r) for g, r in zip(got, ref, strict=True)),
            )
    return out


def layer_bad_inputs(ctx, _payload) -> dict[str, str]:
    """Bad layer use raises a ValueError subclass before any collective; name -> message."""
    from fo_kernels import PlanError, parallelize_linears

    world = ctx.world_size

    def fixed(collective: str, ranks: int = world) -> Schedule:
        return Schedule(
            collective=collective,
            dtype="float32",
            world_size=ranks,
            problem=Problem(n=8, k=8, m_min=1, m_max=1024),
        )

    col = ColumnParallelLinear(8, 4 * world)
    row = RowParallelLinear(4 * world, 6, sequence_parallel=True)
    # a schedule of the forward's collective is taken
    ColumnParallelLinear(8, 4 * world, sequence_parallel=True, schedule=fixed("all_gather"))
    RowParallelLinear(4 * world, 6, schedule=fixed("all_reduce"))
    others = dist.new_group([0, 1])
    calls = {
        "col_features": lambda: col(torch.randn(3, 9)),
        "row_features": lambda: row(torch.randn(2 * world, 5)),
        "row_sp_rows": lambda: row(torch.randn(2 * world + 1, 4)),
        "col_dtype": lambda: col(torch.randn(3, 8, dtype=torch.bfloat16)),
        "col_dtype_int": lambda: col(torch.ones(3, 8, dtype=torch.long)),
        "row_dtype": lambda: row(torch.randn(2 * world, 4, dtype=torch.float64)),
        "col_not_divisible": lambda: ColumnParallelLinear(8, 4 * world + 1),
        "row_not_divisible": lambda: RowParallelLinear.from_linear(nn.Linear(4 * world + 1, 3)),
        "plan_unknown": lambda: parallelize_linears(MLP(4, 8), {"nope": "column"}),
        "plan_not_linear": lambda: parallelize_linears(nn.Sequential(MLP(4, 8)), {"0": "row"}),
        "plan_kind": lambda: parallelize_linears(MLP(4, 8), {"up": "diagonal"}),
        "plan_list": lambda: parallelize_linears(MLP(4, 8), ["up"]),
        "col_in_zero": lambda: ColumnParallelLinear(0, 4 * world),
        "row_out_str": lambda: RowParallelLinear(4 * world, "6"),
        "col_schedule": lambda: ColumnParallelLinear(8, 4 * world, schedule="auto"),
        "row_param_dtype": lambda: RowParallelLinear(4 * world, 6, dtype=torch.float64),
        "col_param_dtype_name": lambda: ColumnParallelLinear(8, 4 * world, dtype="bfloat16"),
        # a schedule the forward would not run: none runs without sequence parallelism, another
        # collective, another world size
        "col_schedule_unused": lambda: ColumnParallelLinear(8, 4 * world, schedule=fixed("all_gather")),
        "row_schedule_collective": lambda: RowParallelLinear(4 * world, 6, schedule=fixed("reduce_scatter")),
        "row_schedule_world": lambda: RowParallelLinear(
            4 * world, 6, sequence_parallel=True, schedule=fixed("reduce_scatter", world + 1)
        ),
    }
    if ctx.rank == 2:
        calls["group_not_member"] = lambda: ColumnParallelLinear(8, 4, group=others)
    msgs = {}
    for name, call in calls.items():
        try:
            call()
        except (ShapeError, ScheduleError, PlanError, GroupError) as exc:
            assert isinstance(exc, ValueError)
            msgs[name] = f"{type(exc).__name__}: {exc}"
        else:
            msgs[name] = "NO ERROR"
    dist.barrier()
    return msgs


def copied_layers(ctx, _payload) -> dict[str, dict[str, object]]:
    """Layers built over an explicit process group (the default one, passed as
    ``dist.group.WORLD``), copied: a deep copy (an EMA or a frozen reference model), and the model
    saved whole with torch.save and loaded again. Per copy: whether it runs on the original's group,
    owns its weights, and its output's difference from the original's."""
    import copy
    import io

    torch.manual_seed(0)
    sharded = ShardedMLP(MLP(8, 4 * ctx.world_size), False, dist.group.WORLD)
    buffer = io.BytesIO()
    torch.save(sharded, buffer)
    buffer.seek(0)
    copies = {"deepcopy": copy.deepcopy(sharded), "saved": torch.load(buffer, weights_only=False)}
    x = torch.randn(3, 8)
    return {
        name: {
            "same_group": copied.up.group is sharded.up.group and copied.down.group is sharded.down.group,
            "own_weights": copied.up.weight.data_ptr() != sharded.up.weight.data_ptr(),
            "err": rel(copied(x), sharded(x)),
        }
        for name, copied in copies.items()
    }


def suite(ctx, parts: dict[str, tuple[str, object]]) -> dict[str, object]:
    """Several rank functions of this module in one start of the ranks: name -> (function, payload)."""
    return {name: globals()[fn](ctx, payload) for name, (fn, payload) in parts.items()}
