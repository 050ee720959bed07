"""Compile ``fo_kernels.gemm.pingpong``'s kernel for sm_90a on a machine without a GPU and print,
as JSON, what the tests check in its PTX and ptxas's report (``tests/test_gemm_pingpong.py`` runs
this in a process of its own: it replaces Triton's active driver with one that names an H100/H200
target).

    python tests/pingpong_ptx.py BM BN BK STAGES LAYOUT SIGNAL KSPLIT
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

# Hopper (sm_90a), warps of 32 threads.
TARGET = GPUTarget("cuda", 90, 32)


class _HopperTarget:
    """The driver calls a warm-up compile makes, answered for an sm_90 device (nothing runs)."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _release_atomics_after_written_stores(ptx: list[str]) -> list[bool]:
    """For each release increment (``atom``, or ``red`` where Triton 3.9 drops the unused result):
    whether the last bulk (TMA) store before it is followed by ``cp.async.bulk.wait_group 0`` (not
    ``.read``), ``fence.proxy.async.global`` and a barrier, in that order, before the increment."""
    verdicts = []
    for i, line in enumerate(ptx):
        if not re.search(r"\b(atom|red)\.global\.gpu\.release\.add", line):  # red: its result unused
            continue
        stores = [j for j in range(i) if "cp.async.bulk.tensor" in ptx[j] and ".global.shared" in ptx[j]]
        if not stores:
            verdicts.append(False)
            continue
        after = ptx[stores[-1] + 1 : i]
        marks = []
        for text in after:
            if re.search(r"cp\.async\.bulk\.wait_group 0;", text):
                marks.append("wait")
            elif "fence.proxy.async.global" in text:
                marks.append("fence")
            elif re.search(r"\bbar(rier)?\.sync\b", text):
                marks.append("bar")
        verdicts.append(_in_order(marks, ["wait", "fence", "bar"]))
    return verdicts


def _arrivals_after_part_stores(ptx: list[str]) -> list[bool]:
    """For each arrival of the K-split tail (the acq_rel increment): whether a barrier follows the
    last global store before it (the part's), so every thread's part is stored first."""
    verdicts = []
    for i, line in enumerate(ptx):
        if not re.search(r"\batom\.global\.gpu\.acq_rel\.add", line):
            continue
        stores = [j for j in range(i) if re.search(r"\bst\.global\.", ptx[j])]
        verdicts.append(
            bool(stores) and any(re.search(r"\bbar(rier)?\.sync\b", t) for t in ptx[stores[-1] + 1 : i])
        )
    return verdicts


def _in_order(marks: list[str], want: list[str]) -> bool:
    it = iter(marks)
    return all(any(m == w for m in it) for w in want)


def main(bm: int, bn: int, bk: int, stages: int, layout: int, signal: bool, ksplit: bool) -> dict:
    driver.set_active(_HopperTarget())
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fo_kernels.gemm import pingpong as pp

    def desc(shape: tuple[int, int], block: list[int]) -> object:
        t = torch.empty(shape, dtype=torch.bfloat16)
        return TensorDescriptor.from_tensor(
            t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        )

    m = n = k = 1024
    ints = torch.zeros(8, dtype=torch.int32)
    floats = torch.zeros(8, dtype=torch.float32)
    tiles = (m // bm) * (n // bn)
    compiled = pp._kernel().warmup(
        desc((m, k), [bm, bk]), desc((n, k), [bn, bk]), desc((m, n), [bm, bn]), ints, ints, ints,
        ints, floats, m, n, k, m, m // bm, n // bn, tiles - 2, 2, 2, 1, 1,
        stages, 8, layout, signal, ksplit, pp.CONSUMER_REGS, pp.LOADER_REGS,
        grid=(1,), num_warps=4, maxnreg=pp.MAXNREG,
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    # Triton's own ptxas builds; the first that takes this PTX version (Triton 3.9 writes PTX that
    # only its newer ptxas-blackwell reads, for sm_90a too).
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        for ptxas in [p for p in (bin_dir / "ptxas", bin_dir / "ptxas-blackwell") if p.exists()]:
            run = subprocess.run(
                [str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                capture_output=True, text=True,
            )  # fmt: skip
            if run.returncode == 0 or "Unsupported .version" not in run.stderr:
                break
        run.check_returncode()
        report = run.stderr
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    return {
        "release_atomics": _release_atomics_after_written_stores(ptx.splitlines()),
        "arrivals": _arrivals_after_part_stores(ptx.splitlines()),
        "setmaxnreg": len(re.findall(r"setmaxnreg\.", ptx)),
        "spill_bytes": sum(spills),
        "registers": int(re.search(r"Used (\d+) registers", report).group(1)),
        "shared_bytes": compiled.metadata.shared,
    }


if __name__ == "__main__":
    bm_, bn_, bk_, st_, lay_, sig_, ks_ = (int(x) for x in sys.argv[1:8])
    print(json.dumps(main(bm_, bn_, bk_, st_, lay_, bool(sig_), bool(ks_))))
