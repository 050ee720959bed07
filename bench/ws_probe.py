"""Probe: does a warp-specialized ping-pong GEMM close the signalled GEMM's gap to cuBLAS on one
H200? (Issue 24; temporary: once its numbers are in docs/perf-notes.md, this file goes.)

The kernel is written out in Triton's Gluon dialect, because Triton's automatic warp
specialization on sm_90 builds only 4-warp, non-flattened loops and drops the signal's release
atomic (docs/perf-notes.md, session 15). One TMA loader warp fills a ring of stages; two consumer
warpgroups take a program's tiles in turn (local tiles 0, 2, 4, ... and 1, 3, 5, ...), each
starting a tile's wgmma main loop only when the other has finished the previous tile's
(``turn``), so the stages are consumed in the loader's order and one consumer's epilogue (a TMA
store) runs while the other's main loop does. The ``_sig`` twins add the shipped kernel's signal
(each tile row's counter, one release increment a tile once its TMA store is written).

    python3 bench/ws_probe.py check   # every variant on three shapes against a float32 matmul
    python3 bench/ws_probe.py time    # the profile's ten shapes at full grid: cuBLAS, the shipped
                                      # kernel (its profile's best tile) and every variant, each
                                      # sample one CUDA graph replay, in one interleaved timing

Run each under ``timeout``: a wrong barrier phase hangs a kernel rather than failing it
(``bash bench/profile_session.sh ws`` does). Writes ``$OUT/ws.csv`` (time) and prints a summary.
A cooperative twin (``ws_coop_kernel``: the loader warp and one consumer of two warpgroups on a
128x256 tile) takes the loads out of the consumers' instruction stream but hides no epilogue.
Compiled for sm_90a on the CPU with Triton 3.6 (the device image's): no spills at 168 registers
(maxnreg; setmaxnreg gives the consumers 232 and the loader 40), 192 KB of shared memory with
four stages of 128x128x64.
"""

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _tile_coords(t, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    in_group = GROUP_M * tiles_n
    first_m = (t // in_group) * GROUP_M
    size_m = gl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (t % size_m), (t % in_group) // size_m


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, empty, ready, M, N, K, GROUP_M: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    S: gl.constexpr = a_bufs.shape[0]
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    i = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        pm, pn = _tile_coords(t, tiles_m, tiles_n, GROUP_M)
        for kk in range(k_tiles):
            s = i % S
            mbarrier.wait(empty.index(s), ((i // S) & 1) ^ 1)  # the first use passes at once
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [pm * BM, kk * BK], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [pn * BN, kk * BK], ready.index(s), b_bufs.index(s))
            i += 1


# The CTA barrier (in a partition, its warps' named barrier): Triton 3.6, the device image's, calls
# it thread_barrier; 3.7 renamed it barrier.
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _stores_written():
    """Wait until this thread's TMA stores are written, not only read from shared memory, and order
    them before its later generic-proxy accesses (as ``fo_kernels.gemm_epilogue._bulk_stores_done``)."""
    gl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;",
        "=r",
        [],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _consumer(
    a_desc,
    b_desc,
    c_desc,
    a_bufs,
    b_bufs,
    c_smem,
    empty,
    ready,
    turn,
    counters,
    M,
    N,
    K,
    ME: gl.constexpr,
    CONSUMERS: gl.constexpr,
    WARPS: gl.constexpr,
    GROUP_M: gl.constexpr,
    SIGNAL: gl.constexpr,
):
    """Consumer ``ME`` of ``CONSUMERS`` (``WARPS`` warps) runs the program's local tiles j = ME,
    ME + CONSUMERS, ...; with two, it starts a tile's main loop once the other has finished the
    previous tile's (``turn``), so the stages are consumed in the loader's order and each
    consumer's epilogue overlaps the other's main loop (ping-pong). With one (the cooperative
    kernel: two warpgroups on one tile) nothing overlaps the epilogue. ``SIGNAL``: once a tile's
    TMA store is written, the partition's barrier, then one release increment of its tile row's
    counter (``counters[pm]``), as the shipped kernel signals a group; in ping-pong the wait for
    the write overlaps the other consumer's main loop."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    S: gl.constexpr = a_bufs.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BN, 16]
    )
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    G = gl.num_programs(0)
    pid = gl.program_id(0)
    for t in range(pid + ME * G, tiles_m * tiles_n, CONSUMERS * G):
        j = (t - pid) // G  # the program's local tile index: ME, ME + CONSUMERS, ...
        if CONSUMERS == 2 and j > 0:  # the other consumer's main loop of tile j - 1 is done
            mbarrier.wait(turn.index(1 - ME), ((j - 1) // 2) & 1)
        pm, pn = _tile_coords(t, tiles_m, tiles_n, GROUP_M)
        acc = gl.zeros((BM, BN), gl.float32, layout)
        i0 = j * k_tiles
        for kk in range(k_tiles):
            i = i0 + kk
            s = i % S
            mbarrier.wait(ready.index(s), (i // S) & 1)
            acc = warpgroup_mma(
                a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, use_acc=kk > 0, is_async=True
            )
            acc = warpgroup_mma_wait(1, deps=(acc, a_bufs.index(s), b_bufs.index(s)))[0]
            if kk > 0:  # the step before has finished reading its stage
                mbarrier.arrive(empty.index((i - 1) % S), count=1)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((i0 + k_tiles - 1) % S), count=1)
        if CONSUMERS == 2:
            mbarrier.arrive(turn.index(ME), count=1)  # the other consumer may start its next tile
        tma.store_wait(0)  # this consumer's previous tile has left c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [pm * BM, pn * BN], c_smem)
        if SIGNAL:
            _stores_written()
            _barrier()
            gl.atomic_add(counters + pm, 1, sem="release", scope="gpu")
    tma.store_wait(0)


@gluon.jit
def _ring(a_desc, b_desc, STAGES: gl.constexpr):
    """The loader's ring: ``STAGES`` A and B blocks in shared memory, and each stage's ``empty``
    and ``ready`` mbarriers (one arrival each)."""
    # (Gluon's code generator builds these shapes by list concatenation, not starred lists)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)  # noqa: RUF005
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)  # noqa: RUF005
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(empty.index(s), count=1)
        mbarrier.init(ready.index(s), count=1)
    return a_bufs, b_bufs, empty, ready


@gluon.jit
def ws_gemm_kernel(
    a_desc,
    b_desc,
    c_desc,
    counters,
    M,
    N,
    K,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    SIGNAL: gl.constexpr,
):
    a_bufs, b_bufs, empty, ready = _ring(a_desc, b_desc, STAGES)
    c0 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    c1 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(turn.index(c), count=1)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    a_desc,
                    b_desc,
                    c_desc,
                    a_bufs,
                    b_bufs,
                    c0,
                    empty,
                    ready,
                    turn,
                    counters,
                    M,
                    N,
                    K,
                    0,
                    2,
                    4,
                    GROUP_M,
                    SIGNAL,
                ),
            ),
            (
                _consumer,
                (
                    a_desc,
                    b_desc,
                    c_desc,
                    a_bufs,
                    b_bufs,
                    c1,
                    empty,
                    ready,
                    turn,
                    counters,
                    M,
                    N,
                    K,
                    1,
                    2,
                    4,
                    GROUP_M,
                    SIGNAL,
                ),
            ),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, empty, ready, M, N, K, GROUP_M)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


@gluon.jit
def ws_coop_kernel(
    a_desc,
    b_desc,
    c_desc,
    counters,
    M,
    N,
    K,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    SIGNAL: gl.constexpr,
):
    """The cooperative twin (launched with 8 warps): the loader warp, and the kernel's 8 warps (two
    warpgroups, 64 rows of the tile each) as one consumer, so loads leave the consumers' instruction stream
    but nothing overlaps the epilogue."""
    a_bufs, b_bufs, empty, ready = _ring(a_desc, b_desc, STAGES)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    # one consumer of the kernel's 8 warps; ``turn`` (here ``empty``) is not used with one
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    a_desc,
                    b_desc,
                    c_desc,
                    a_bufs,
                    b_bufs,
                    c_smem,
                    empty,
                    ready,
                    empty,
                    counters,
                    M,
                    N,
                    K,
                    0,
                    1,
                    8,
                    GROUP_M,
                    SIGNAL,
                ),
            ),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, empty, ready, M, N, K, GROUP_M)),
        ],
        [1],
        [LOADER_REGS],
    )


# --------------------------------------------------------------------------------------- host
# name: (consumer tile BM x BN, BK, stages, ping-pong). A ping-pong consumer's fp32 accumulator is
# BM x BN over one warpgroup: 128 registers a thread at 128x128 or 64x256 (128x256 would need 256);
# the cooperative kernel's is 128x256 over two warpgroups, with one 64 KB epilogue buffer (so 3
# stages of 48 KB fit).
VARIANTS = {
    "ws_128x128_s4": (128, 128, 64, 4, True),
    "ws_128x128_s5": (128, 128, 64, 5, True),
    "ws_128x128_s3": (128, 128, 64, 3, True),
    "ws_64x256_s4": (64, 256, 64, 4, True),
    "coop_128x256_s3": (128, 256, 64, 3, False),
}
# the same kernels signalling each tile row's counter as its tiles land (the shipped kernel's
# protocol, without its deferral): the cost of the signal, and its count checked after each run
SIGNALLED = {"ws_128x128_s4_sig": "ws_128x128_s4", "coop_128x256_s3_sig": "coop_128x256_s3"}
GROUP_M = 8
CONSUMER_REGS, LOADER_REGS, MAXNREG = 232, 40, 168  # 232 * 256 + 40 * 128 threads <= 65536 registers
SHAPES = [
    (2048, 4096, 4096),
    (4096, 8192, 4096),
    (4096, 8192, 14336),
    (8192, 8192, 8192),
    (16384, 8192, 4096),
    (8192, 4096, 7168),
    (8192, 4096, 2048),
    (3000, 5120, 6912),
    (8192, 3584, 9472),
    (4096, 8192, 14784),
]


def ws_runner(a, w, out, variant: str, sms: int, counters=None):
    """A call of the probe kernel: ``out = a @ w.T`` (a (M, K), w (N, K), both row-major);
    ``counters`` (int32, one per tile row): each tile adds 1 to its row's once it is written."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bm, bn, bk, stages, pingpong = VARIANTS[variant]
    signal = counters is not None
    counters = counters if signal else out
    m, k = a.shape
    n = w.shape[0]

    def desc(t, block):
        return TensorDescriptor.from_tensor(
            t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        )

    a_desc, b_desc, c_desc = desc(a, [bm, bk]), desc(w, [bn, bk]), desc(out, [bm, bn])
    grid = min(sms, triton.cdiv(m, bm) * triton.cdiv(n, bn))

    def run():
        if pingpong:
            ws_gemm_kernel[(grid,)](
                a_desc, b_desc, c_desc, counters, m, n, k, stages, GROUP_M, CONSUMER_REGS, LOADER_REGS,
                signal, num_warps=4, maxnreg=MAXNREG,
            )  # fmt: skip
        else:
            ws_coop_kernel[(grid,)](
                a_desc, b_desc, c_desc, counters, m, n, k, stages, GROUP_M, LOADER_REGS, signal,
                num_warps=8, maxnreg=MAXNREG,
            )  # fmt: skip
        return out

    return run


def _shipped_tile(m: int, n: int, k: int):
    """The shipped profile's best full-grid tile of this shape, else 128x256x64 with 4 stages."""
    import csv
    from pathlib import Path

    from fo_kernels.schedule import Tile

    for path in Path("results/profiles").glob(f"*w1*/{m}x{n}x{k}-bfloat16.csv"):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row["status"] == "ok" and row["sms_free"] == "0":
                    keys = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
                    return Tile(**{key: int(row[key]) for key in keys})
    return Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4)


def main(mode: str) -> None:
    import os
    import sys

    import torch

    from fo_tune.measure import gemm_operands, gemm_runner, rel_err
    from fo_tune.timing import STEADY_SAMPLE_MS, time_interleaved

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shapes = [(1024, 1024, 1024), (3000, 5120, 6912), (130, 256, 200)] if mode == "check" else SHAPES
    out_dir = os.environ.get("OUT", ".")
    rows = []  # the CSV's
    for m, n, k in shapes:
        a, b = gemm_operands(m, n, k, "bfloat16", dev, seed=m + n + k)
        w = b.t().contiguous()  # the (N, K) weight
        ref = a.float() @ b.float()
        fns = {"cublas": lambda a=a, b=b: a @ b}
        outs, counts = {}, {}
        if mode == "time":  # the shipped kernel, checked too (its output view is the same each call)
            fns["shipped"], _ = gemm_runner(a, b, _shipped_tile(m, n, k), 0, sms)
            outs["shipped"] = fns["shipped"]()
            assert rel_err(outs["shipped"], ref) < 1e-2
        for name in [*VARIANTS, *SIGNALLED]:
            base = SIGNALLED.get(name, name)
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
            tile_rows, cols = triton.cdiv(m, VARIANTS[base][0]), triton.cdiv(n, VARIANTS[base][1])
            cnt = torch.zeros(tile_rows, dtype=torch.int32, device=dev) if name in SIGNALLED else None
            run = ws_runner(a, w, out, base, sms, cnt)
            torch.cuda.synchronize()
            err = rel_err(run(), ref)
            torch.cuda.synchronize()
            counted = cnt is None or cnt.tolist() == [cols] * tile_rows  # one increment a tile
            print(
                f"{m}x{n}x{k} {name}: rel err {err:.2e}" + ("" if counted else " signal count WRONG"),
                flush=True,
            )
            if err < 1e-2 and counted:
                fns[name], outs[name] = run, out
                if cnt is not None:
                    counts[name] = (cnt, cols)
        if mode == "check":
            continue

        def poison(outs=outs, counts=counts):
            for o in outs.values():
                o.fill_(float("nan"))
            for cnt, _ in counts.values():
                cnt.zero_()

        t = time_interleaved(
            fns, dev, warmup=3, rounds=10, min_sample_ms=STEADY_SAMPLE_MS, graphs=True, before_samples=poison
        )
        cub = t["cublas"].median_ms
        line = []
        for name, timing in t.items():
            after = rel_err(outs[name], ref) if name in outs else 0.0
            ok = after < 1e-2
            if name in counts:  # every row counted the same whole number of calls
                got, cols = counts[name][0].tolist(), counts[name][1]
                ok = ok and len(set(got)) == 1 and got[0] > 0 and got[0] % cols == 0
            rows.append([m, n, k, name, timing.median_ms, timing.iqr_ms, cub / timing.median_ms, after, ok])
            bad = "" if ok else " (wrong result or signal count after timing)"
            line.append(f"{name} {cub / timing.median_ms:.3f}{bad}")
        print(f"{m}x{n}x{k}: cuBLAS {cub:.3f} ms; " + ", ".join(line), flush=True)
        with open(f"{out_dir}/ws.csv", "w") as f:  # after every shape: a call cut short keeps it
            f.write("m,n,k,variant,median_ms,iqr_ms,cublas_over,rel_err_after,ok\n")
            f.writelines(",".join(str(x) for x in r) + "\n" for r in rows)
    sys.stdout.flush()


if __name__ == "__main__":
    import sys

    main(sys.argv[1] if len(sys.argv) > 1 else "check")
