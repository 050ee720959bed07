"""The virtual ranks run on the CPU, through the GPU executor's own addresses and byte counts.

A stand-in for the CUDA driver (``copy_engine_fakes``) carries out each operation when it is issued, on the
CPU tensors' memory, and a flag wait must already hold (raising otherwise). That is a GPU whose
streams all share one queue and finish each operation at once, so a run checks at the same time that
``issue_order`` puts every wait after its writers and that the executor's views, addresses and
copy sizes move the right rows: every rank's output is compared with float64, over repeated calls
into the same buffers (the flags must end each call as they began). The chunk GEMMs are torch's
CPU matmuls. The GPU runs the same code in ``tests/test_gpu_virtual_ranks.py``.
"""

from __future__ import annotations

import pytest
import torch
from copy_engine_fakes import DRIVER, cpu_device

import fo_kernels.engines.copy_engine.gpu as gpu
from fo_kernels.engines.copy_engine.buffers import Dtypes
from fo_kernels.engines.copy_engine.layout import shard_rows
from fo_kernels.engines.copy_engine.virtual import VirtualRanks
from fo_kernels.scaling import FP8_DTYPE, Scales


@pytest.fixture
def ranks_of(monkeypatch: pytest.MonkeyPatch):
    """``ranks_of(world)``: virtual ranks on the CPU, their operations done when issued."""
    device = cpu_device(monkeypatch)
    return lambda world: VirtualRanks(world, device)


CASES = [
    (collective, world, m, weights)
    for collective in ("all_reduce", "reduce_scatter", "all_gather")
    for world in range(2, 9)
    for m, weights in ((8 * world, (1,)), (40 * world + (3 if collective == "all_reduce" else 0), (1, 2, 3)))
]


@pytest.mark.parametrize("collective, world, m, weights", CASES)
def test_virtual_ranks_compute_the_collective(collective: str, world: int, m: int, weights, ranks_of):
    """Three calls into the same tensors with new values, outputs poisoned with NaN: every rank's
    output (and gathered A) equals float64's."""
    ranks = ranks_of(world)
    n, k = 24, 16
    gather = collective == "all_gather"
    vp = ranks.plan(collective, m, n, k, Dtypes(torch.float32, torch.float32), weights=weights)
    a = [torch.empty(m // world if gather else m, k) for _ in range(world)]
    b = [torch.empty(k, n) for _ in range(world)]
    outs = [torch.empty(p.out_rows, n) for p in vp.plans]
    gathered = [torch.empty(m, k) for _ in range(world)] if gather else None
    gen = torch.Generator().manual_seed(m + world)
    for _ in range(3):
        for t in (*a, *b):
            t.copy_(torch.randn(t.shape, generator=gen))
        for t in (*outs, *(gathered or ())):
            t.fill_(float("nan"))
        ranks.issue(vp, a, b, outs, gathered)
        if gather:
            whole = torch.cat([x.double() for x in a])
            for r in range(world):
                assert torch.equal(gathered[r].double(), whole), r
                torch.testing.assert_close(outs[r].double(), whole @ b[r].double(), rtol=1e-5, atol=1e-5)
            continue
        total = sum(x.double() @ y.double() for x, y in zip(a, b, strict=True))
        for r, (r0, r1) in enumerate(shard_rows(m, world)):
            want = total if collective == "all_reduce" else total[r0:r1]
            torch.testing.assert_close(outs[r].double(), want, rtol=1e-5, atol=1e-5)
    for ex in ranks._executors:  # the flags end as they began: the guards set, the rest clear
        flags = ex.flags[ex.rank]
        guards = {ex.layout.slot(c) for c in ex.layout.guards(ex.rank)}
        assert [int(v) for v in flags] == [int(i in guards) for i in range(len(flags))]


def test_a_lost_flag_is_caught(ranks_of, monkeypatch: pytest.MonkeyPatch):
    """The stand-in can fail: with every peer flag write dropped, the first wait on one fails."""
    ranks = ranks_of(3)
    monkeypatch.setattr(DRIVER, "cuStreamWriteValue32", lambda s, address, value, f: (0,))
    a, b = [torch.randn(9, 4) for _ in range(3)], [torch.randn(4, 5) for _ in range(3)]
    with pytest.raises(AssertionError, match="a wait issued before its writer"):
        ranks.run("reduce_scatter", a, b)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_fp8_calls_through_run(collective: str, scaling: str, ranks_of):
    """``run`` with float8_e4m3fn operands and torch._scaled_mm's scales (rowwise: an all_gather
    moves the rows' scales with them), float32 out, against the dequantized float64 product."""
    world, m, n, k = 3, 48, 32, 16
    gather = collective == "all_gather"
    rows = m // world if gather else m
    gen = torch.Generator().manual_seed(len(collective) + len(scaling))
    a = [(torch.randn(rows, k, generator=gen) * 3).to(FP8_DTYPE) for _ in range(world)]
    b = [torch.randn(k, n, generator=gen).to(FP8_DTYPE) for _ in range(world)]
    if scaling == "rowwise":
        sa = [torch.rand(rows, generator=gen) + 0.25 for _ in range(world)]
        sb = [torch.rand(n, generator=gen) + 0.25 for _ in range(world)]
    else:
        sa = [torch.tensor([0.75])] * world
        sb = [torch.rand(1, generator=gen) + 0.25 for _ in range(world)]
    rowwise = scaling == "rowwise"
    scales = [Scales(a=x, b=y, out_dtype=torch.float32, rowwise=rowwise) for x, y in zip(sa, sb, strict=True)]
    got = ranks_of(world).run(collective, a, b, weights=(1, 2), scales=scales)
    deq_a = [
        x.double() * (s.double().view(-1, 1) if rowwise else s.double()) for x, s in zip(a, sa, strict=True)
    ]
    deq_b = [
        y.double() * (s.double().view(1, -1) if rowwise else s.double()) for y, s in zip(b, sb, strict=True)
    ]
    if gather:
        whole = torch.cat(deq_a)
        for r in range(world):
            assert torch.equal(got.gathered[r], torch.cat(a)), r
            torch.testing.assert_close(got.outs[r].double(), whole @ deq_b[r], rtol=1e-5, atol=1e-4)
        return
    total = sum(x @ y for x, y in zip(deq_a, deq_b, strict=True))
    for r, (r0, r1) in enumerate(shard_rows(m, world)):
        want = total if collective == "all_reduce" else total[r0:r1]
        torch.testing.assert_close(got.outs[r].double(), want, rtol=1e-5, atol=1e-4)


def _rows_gemm(a, b, out, tile, *, grid, row_group, counters=None, ready=None, out2=None, **kw) -> None:
    """What the tiled mode's persistent kernel computes, group by group (``rows_gemm``'s contract):
    [ready[g] set, else the wait would spin]; out = a @ B (+ out); [out2 = out]; [counters[g] +=
    its tiles]. The kernel itself runs on GPUs and in its own interpreter tests."""
    assert grid == 66, "each of 2 virtual ranks' kernels takes half the SMs"
    tiles_n = -(-b.tensor.shape[1] // tile.block_n)
    groups = row_group.tolist()
    for g in dict.fromkeys(groups):
        first = groups.index(g)
        count = groups.count(g)
        r0, r1 = first * tile.block_m, min((first + count) * tile.block_m, a.shape[0])
        if ready is not None:
            assert int(ready[g]) != 0, f"group {g}'s tiles would wait for a ready cell never set"
        acc = a[r0:r1].double() @ b.tensor.double()
        if ready is not None:
            acc += out[r0:r1].double()
        out[r0:r1] = acc.to(out.dtype)
        if out2 is not None:
            out2[r0:r1] = out[r0:r1]
        if counters is not None:
            counters[g] += count * tiles_n


@pytest.mark.parametrize("weights", [(1,), (1, 2), (1, 1, 1)])
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_the_tiled_mode_through_its_kernels_contract(collective: str, weights, ranks_of, monkeypatch):
    """The tiled mode's two phases on 2 virtual ranks, the kernel replaced by its contract: its
    counters, ready cells, pushed sums and the peers' pulls meet at the right addresses."""
    from fo_kernels.tile import Tile

    monkeypatch.setattr(gpu, "rows_gemm", _rows_gemm)
    tile = Tile(block_m=16, block_n=32, block_k=16, group_m=1, num_warps=4, num_stages=1)
    m, n, k = 70 if collective == "all_reduce" else 72, 40, 24
    ranks = ranks_of(2)
    gen = torch.Generator().manual_seed(m + len(weights))
    for _ in range(2):
        a = [torch.randn(m, k, generator=gen) for _ in range(2)]
        b = [torch.randn(k, n, generator=gen) for _ in range(2)]
        got = ranks.run(collective, a, b, mode="tiled", weights=weights, tile=tile)
        total = sum(x.double() @ y.double() for x, y in zip(a, b, strict=True))
        for r, (r0, r1) in enumerate(shard_rows(m, 2)):
            want = total if collective == "all_reduce" else total[r0:r1]
            torch.testing.assert_close(got.outs[r].double(), want, rtol=1e-5, atol=1e-5)
