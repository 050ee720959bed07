"""The ops on ``FO_TEST_WORLD_SIZE`` GPUs (default 2; ``bench/gpu_tests.sh`` sets it from
``FO_WORLD_SIZE``): the N-rank paths a TP=4 or TP=8 machine runs, each checked against float64.

AllReduce and ReduceScatter through the Triton engine (its heuristic schedule for N ranks), the
copy engine's ring (1 and 3 chunks a shard) and ``overlap: false``, on a layer-sized shape and one
whose shards end mid-tile; once, then all back to back (a buffer rewritten while a peer still
reads it shows up as a wrong output); then the copy engine's AllGather + GEMM, eager and replayed
from its own graphs. Skipped (not failed) on a machine with fewer GPUs than the world size.
"""

from __future__ import annotations

import os

import pytest
import torch

from dist_cases import TOL, Case, copy_engine_all_gather, run_back_to_back, run_cases
from fo_kernels.engines.copy_engine.settings import CopyEngineSettings
from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.plan import cdiv
from fo_kernels.schedule import Problem, Schedule
from fo_kernels.tile import Tile
from fo_tune.engines.triton.defaults import split_decreasing

# The ranks of these tests; bench/gpu_tests.sh exports it (FO_WORLD_SIZE there).
WORLD_ENV = "FO_TEST_WORLD_SIZE"
DEFAULT_WORLD = 2
# The Triton engine's tile here: small enough that the odd shape's shards have whole and partial tiles.
TILE = Tile(block_m=64, block_n=64, block_k=32, group_m=2, num_warps=4, num_stages=3)


def _world() -> int:
    world = int(os.environ.get(WORLD_ENV, str(DEFAULT_WORLD)))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < world:
        pytest.skip(f"needs {world} GPUs ({WORLD_ENV}={world}), {gpus} visible")
    return world


def _triton(head: dict, layout: str) -> TritonSettings:
    """Tile-major or band groups of the Triton engine for ``head``'s problem: three decreasing
    groups of signal units, 20 SMs left to NCCL at a cap of 16 CTAs."""
    p, world = head["problem"], head["world_size"]
    shards = world if head["collective"] == "reduce_scatter" else 1
    mt, nt = cdiv(p.m // shards, TILE.block_m), cdiv(p.n, TILE.block_n)
    unit = shards * (TILE.group_m * nt if layout == "row_band" else 1)
    groups = split_decreasing(cdiv(shards * mt * nt, unit), 3)
    return TritonSettings(
        tile=TILE, sms_free=20, nccl_max_ctas=16, signal_tiles=unit, groups=groups, layout=layout
    )


def _cases(world: int) -> list[Case]:
    # a layer-sized shape, and shards of 33 rows (not a tile's multiple) with odd N and K
    shapes = [(4096, 4096, 1024), (33 * world, 250, 70)]
    cases = []
    for collective in ("all_reduce", "reduce_scatter"):
        for m, n, k in shapes:
            head = dict(
                collective=collective, dtype="bfloat16", world_size=world, problem=Problem(m=m, n=n, k=k)
            )
            schedules = [
                *(Schedule(**head, settings=_triton(head, lay)) for lay in ("row_band", "tile_major")),
                Schedule(**head),
                *(
                    Schedule(**head, settings=CopyEngineSettings(mode="ring", weights=(1,) * c))
                    for c in (1, 3)
                ),
            ]
            for s in schedules:
                seed = 100 + len(cases)
                cases.append(Case(collective, m, n, k, "bfloat16", seed % 2 == 0, s.to_dict(), seed))
    return cases


@pytest.mark.multigpu
def test_every_engine_on_the_machines_world_size():
    from fo_tune.ranks.launch import run_ranks

    world = _world()
    cases = _cases(world)
    once = run_ranks(run_cases, world, cases, backend="nccl", timeout_s=600)
    again = run_ranks(run_back_to_back, world, cases * 2, backend="nccl", timeout_s=600)
    for per_rank in [*once, *again]:
        assert len(per_rank) in (len(cases), 2 * len(cases))
        for r in per_rank:
            assert not r["nan"] and r["err"] < TOL[r["case"].dtype], r


@pytest.mark.multigpu
def test_copy_engine_all_gather_on_the_machines_world_size():
    from fo_tune.ranks.launch import run_ranks

    world = _world()
    cases = [(4096, 4096, 1024, "bfloat16", 2, 7), (33 * world, 250, 70, "float16", 3, 8)]
    per_rank = run_ranks(copy_engine_all_gather, world, cases, backend="nccl", timeout_s=600)
    assert len(per_rank) == world
    for rows in per_rank:
        for r in rows:
            assert r["same"] and not r["nan"] and r["err"] < TOL[r["case"][3]], r
        assert all(r["replayed"] for r in rows if r["step"] == rows[-1]["step"]), rows
