"""``release_group``: what the overlapped ops keep for a process group (its runtime: counters,
streams, capped communicators, copy-engine buffers, graphs) is freed on request, only that group's,
and a later op on the group makes it again and is right. The NCCL run of the same is in
``tests/test_gpu_ops.py``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist

from fo_kernels import gemm_all_reduce, release_group
from fo_kernels.runtime import runtime_for
from ports import free_port

CPU = torch.device("cpu")


def test_release_group_frees_that_groups_runtime_and_a_later_op_runs_again(quiet_one_rank, over_limits):
    m, n, k = over_limits.shape
    schedule = over_limits.schedule("all_reduce")
    a, b = torch.randn(m, k, dtype=torch.float64), torch.randn(k, n, dtype=torch.float64)
    group = dist.new_group([0])
    try:
        gemm_all_reduce(a.float(), b.float(), schedule=schedule)
        gemm_all_reduce(a.float(), b.float(), schedule=schedule, group=group)
        mine, world = runtime_for(CPU, group), runtime_for(CPU, None)
        assert mine.reserve_tiles([0])[0] > 0  # (the call's tiles counted)
        assert release_group(group) == 1
        assert release_group(group) == 0  # nothing left to free
        assert runtime_for(CPU, None) is world, "another group's runtime was freed"
        again = runtime_for(CPU, group)
        assert again is not mine and again.reserve_tiles([0]) == [0]  # counters start over
        got = gemm_all_reduce(a.float(), b.float(), schedule=schedule, group=group)
        assert torch.allclose(got.double(), a @ b, rtol=1e-4, atol=1e-4)
        assert release_group(None) == 1 and runtime_for(CPU, None) is not world
    finally:
        release_group(group)
        dist.destroy_process_group(group)


# One gloo rank, as a user writes it: fo_kernels imported (its ops load on first use), the group
# made, one op, the destroy; then what the interpreter runs when it starts to exit.
SHORT_JOB = """
import atexit
import gc
import weakref

import torch
import torch.distributed as dist

import fo_kernels

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
group = weakref.ref(dist.group.WORLD)
y = fo_kernels.gemm_all_reduce(torch.randn(64, 32), torch.randn(32, 96))
dist.destroy_process_group()
atexit._run_exitfuncs()
gc.collect()
print("HELD" if group() is not None else "FREED", tuple(y.shape), flush=True)
"""


def test_a_destroyed_group_is_not_kept_into_the_interpreters_teardown(tmp_path):
    """Nothing fo_kernels made keeps a destroyed process group once the interpreter starts to
    exit (its runtime, torch's modules the ops import): a gloo group kept into the teardown can
    abort the rank there (``fo_kernels.runtime._release_at_exit``)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SHORT_JOB).replace("{port}", str(free_port())))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "FREED (64, 96)" in done.stdout, done.stdout + done.stderr[-3000:]
