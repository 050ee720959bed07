"""GPU tests of the copy engine's virtual ranks: N ranks in one process on one GPU.

Every mode and collective at N = 2, 3, 4 and 8 (the tiled mode runs between 2): the calls of
``check_on_gpu`` (``fo_kernels.engines.copy_engine.check``) on the same tensors, new values and
NaN-poisoned outputs every call, eagerly and captured in a CUDA graph then replayed, each output
against float64. CUDA's lazy module loading stays on (the default): the first call of every plan
runs only because its kernels are loaded before its first flag wait (``warmup.py``). Each test
runs under a watchdog (``faulthandler``): a hang prints every thread's stack and ends the run.
The CPU side of the same code is ``tests/test_copy_engine_virtual.py``.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import pytest
import torch

from fo_kernels.engines.copy_engine.check import CpuCheck, check_on_gpu
from fo_kernels.tile import Tile

pytestmark = pytest.mark.gpu

# A hung test ends the process after this many seconds (the first tiled case compiles its Triton
# kernels, ~10-30 s each on an H200; a ring case takes a few seconds).
HANG_S = 150
TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}
TILE = Tile(block_m=64, block_n=64, block_k=32, group_m=2, num_warps=4, num_stages=3)
CALLS = 4


@pytest.fixture(autouse=True)
def watchdog():
    """A hang fails the run (every thread's stack on stderr, exit 1) instead of blocking it."""
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=sys.stderr)
    yield
    faulthandler.cancel_dump_traceback_later()


def _ranks(world: int):
    from fo_kernels.engines.copy_engine.virtual import VirtualRanks, cuda_device

    ranks = VirtualRanks(world, cuda_device("cuda"))
    streams = [s.cuda_stream for s in ranks._mains]
    streams += [s.cuda_stream for ex in ranks._executors for s in ex._streams.values()]
    assert len(set(streams)) == len(streams) == 5 * world, "two of the ranks' streams are one"
    return ranks


def _shapes(world: int, collective: str) -> list[tuple[int, int, int, tuple[int, ...], torch.dtype]]:
    """(M, N, K, weights, dtype): an odd small shape (all_reduce: M not divisible by N) and one
    whose shards are cut on ROW_ALIGN rows into three chunks."""
    odd = 131 * world + (1 if collective == "all_reduce" else 0)
    return [(odd, 257, 192, (1, 1), torch.bfloat16), (1024 * world, 1024, 512, (1, 1, 1), torch.bfloat16)]


def test_lazy_module_loading_is_on():
    """The suite proves the warm-up only with CUDA's default lazy loading."""
    assert os.environ.get("CUDA_MODULE_LOADING", "LAZY").upper() == "LAZY", (
        "CUDA_MODULE_LOADING is set: unset it, the tests must run with lazy loading"
    )


def _ring(world: int, collective: str, graph: bool) -> None:
    for m, n, k, weights, dtype in _shapes(world, collective):
        ranks = _ranks(world)  # (new ranks per shape: a captured graph's buffers cannot grow)
        check = CpuCheck(
            collective=collective, world=world, m=m, n=n, k=k, weights=weights, dtype=dtype,
            calls=CALLS, seed=m + world,
        )  # fmt: skip
        got = check_on_gpu(check, ranks, graph=graph)
        assert not got.has_nan and got.rel_err < TOL[dtype], (m, n, k, got)


def _tiled(collective: str, graph: bool) -> None:
    for m, n, k, weights in ((258, 256, 64, (1, 2)), (1030, 1024, 512, (1, 1, 1))):
        ranks = _ranks(2)
        check = CpuCheck(
            collective=collective, world=2, m=m, n=n, k=k, mode="tiled", weights=weights, tile=TILE,
            dtype=torch.bfloat16, calls=CALLS, seed=m,
        )  # fmt: skip
        got = check_on_gpu(check, ranks, graph=graph)
        assert not got.has_nan and got.rel_err < TOL[torch.bfloat16], (m, n, k, got)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ring_eager(world: int, collective: str):
    _ring(world, collective, graph=False)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_tiled_eager(collective: str):
    _tiled(collective, graph=False)


@pytest.mark.parametrize("world", [3, 8])
def test_float32_and_reuse_across_shapes(world: int):
    """float32 (tight tolerance), then a smaller and a larger shape on the same ranks (the
    regions grow), eagerly: each plan warms its own kernels."""
    ranks = _ranks(world)
    for m, n, k in ((64 * world, 96, 80), (16 * world, 40, 24), (512 * world, 768, 256)):
        for collective in ("reduce_scatter", "all_reduce", "all_gather"):
            check = CpuCheck(
                collective=collective, world=world, m=m, n=n, k=k, weights=(2, 1), dtype=torch.float32,
                calls=2, seed=m + n,
            )  # fmt: skip
            got = check_on_gpu(check, ranks)
            assert not got.has_nan and got.rel_err < TOL[torch.float32], (collective, m, n, k, got)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_fp8_eager(collective: str, scaling: str):
    """float8_e4m3fn operands with torch._scaled_mm's scales (rowwise: the all_gather moves the
    rows' scales too), bfloat16 out, at 4 ranks."""
    world = 4
    check = CpuCheck(
        collective=collective, world=world, m=64 * world, n=256, k=128, weights=(1, 2), scaling=scaling,
        out_dtype=torch.bfloat16, calls=3, seed=world,
    )  # fmt: skip
    got = check_on_gpu(check, _ranks(world))
    assert not got.has_nan and got.rel_err < TOL[torch.bfloat16], got


# Rowwise chunks whose rows start anywhere in the scale buffer (an odd shard, uneven weights) while
# their row counts are multiples of 16: cuBLASLt refuses a scale vector off a 16-byte boundary.
ROWWISE_ANY_ROW = [
    ("all_reduce", 4, 3672, 624, 96, (3, 2)),
    ("reduce_scatter", 3, 2142, 80, 416, (2, 3)),
    ("all_gather", 8, 8536, 48, 112, (2, 3)),
]


@pytest.mark.parametrize(("collective", "world", "m", "n", "k", "weights"), ROWWISE_ANY_ROW)
def test_fp8_rowwise_chunks_at_any_row(collective: str, world: int, m: int, n: int, k: int, weights):
    check = CpuCheck(
        collective=collective, world=world, m=m, n=n, k=k, weights=weights, scaling="rowwise",
        out_dtype=torch.bfloat16, calls=2, seed=m,
    )  # fmt: skip
    got = check_on_gpu(check, _ranks(world))
    assert not got.has_nan and got.rel_err < TOL[torch.bfloat16], got


# The graphs last: one graph holds every rank's flag waits, and their order is its executor's; a
# hang there ends the run after the eager tests have reported.
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ring_graph(world: int, collective: str):
    _ring(world, collective, graph=True)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_tiled_graph(collective: str):
    _tiled(collective, graph=True)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_fp8_graph(collective: str):
    """fp8's sums (the rows GEMM adding each partial in its epilogue) captured and replayed."""
    world = 4
    check = CpuCheck(
        collective=collective, world=world, m=64 * world, n=256, k=128, weights=(1, 2), scaling="rowwise",
        out_dtype=torch.bfloat16, calls=3, seed=world + 1,
    )  # fmt: skip
    got = check_on_gpu(check, _ranks(world), graph=True)
    assert not got.has_nan and got.rel_err < TOL[torch.bfloat16], got


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_moe_copy_engine_virtual_ranks_match_float64(world: int, dtype: str):
    """The MoE copy engine's lists (``moe_virtual``) forward and backward, three calls into the
    same slots: uneven tokens with a rank empty, skewed routing in 3 pieces a slot, distinct
    experts per token in 2; every rank's y and gradients against float64. Lazy module loading
    stays on: the Phases' kernels load on first launch, behind issued waits only."""
    from fo_kernels.engines.copy_engine.moe_virtual import MoeVirtualRanks
    from fo_kernels.engines.copy_engine.virtual import cuda_device
    from moe_cases import TOL as MOE_TOL
    from moe_cases import MoeCase, virtual_errors

    ranks = MoeVirtualRanks(world, cuda_device("cuda"))
    tokens = tuple(0 if r == world // 2 else 97 * r + 33 for r in range(world))
    shape = dict(hidden=256, intermediate=192, experts=4, top_k=4)
    fewer = tuple(t // 3 for t in tokens)
    runs = ((tokens, 1, "random"), (tokens[::-1], 3, "skewed"), (fewer, 2, "distinct"))
    for i, (toks, chunks, routing) in enumerate(runs):
        problem = dict(shape, tokens_max=1024)
        schedule = dict(dtype=dtype, world_size=world, problem=problem, engine="copy_engine", chunks=chunks)
        case = MoeCase(
            tokens=toks, hidden=256, inter=192, experts=4, top_k=4, dtype=dtype, routing=routing,
            seed=10 * world + i, schedule=schedule,
        )  # fmt: skip
        errs = virtual_errors(ranks, case, "cuda")
        assert max(errs.values()) < MOE_TOL[dtype], (toks, chunks, routing, errs)
    torch.cuda.synchronize()
    for q, flags in ranks.flags.items():  # the flags end as they began: the guards set, the rest clear
        assert int(flags.sum()) == 2 * (world - 1), q
