"""CPU tests of the order in which the copy engine issues a call's GPU operations.

The engine's ``_run``, ``_run_exchange`` and ``_run_tiled`` run here against recording fakes of the
CUDA driver, of torch's streams and events and of the GEMMs (cuBLAS's and ``rows_gemm``), so the
test sees every operation a call queues, on which stream, in issue order. The GPU tests
(``tests/test_gpu.py``) check the results; these check the rules that a result check cannot see
until a run hangs or races:

- every operation that waits for this call's data from the peer (its PARTIAL / SUMMED flags, or an
  event recorded after such a wait) is issued after all my phase-1 GEMMs and their flags, and every
  flag of a kind I set on the peer before my first wait for one of that kind: two streams can share
  one of the GPU's hardware queues, and a wait queued ahead of the work the peer waits for would
  block it (run 34 in ``docs/perf-notes.md`` hung that way);
- chunk GEMM g runs on the caller's stream or the second GEMM stream by ``gemm_streams``, each
  flag right after its GEMM on the same stream, each phase-2 GEMM after the wait for its chunk's
  pull on that stream;
- the call joins every stream it used back into the caller's stream;
- AllReduce's local copies of my sums: one per chunk after its GEMM, or (``own_copy_at_end``) one of
  the whole shard after every phase-2 GEMM;
- the tiled mode's phase-2 kernel, whose tiles spin on READY flags, is queued only after every
  pull and READY flag it waits for.

Each test was checked to fail on mutations of the engine that break its rule (five in all, named in
the tests' docstrings and the session-7 note).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

import fo_kernels.copy_engine as ce
from fo_kernels.copy_engine import GATHERED, PARTIAL, PULLED, SUMMED, CopyEnginePeers

M, N, K = 64, 8, 4
ROW_BYTES = N * 4  # float32
BUFFER_BYTES = M * ROW_BYTES
HANDLES = {"main": 1, "side": 2, "local": 3, "alt": 4, "notify": 5}


class Recorder:
    """The fakes' shared log: (operation, stream name, detail...) tuples in issue order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.current = "main"
        self.names = {h: name for name, h in HANDLES.items()}

    def ops(self, *kinds: str) -> list[tuple[int, tuple]]:
        return [(i, op) for i, op in enumerate(self.log) if op[0] in kinds]


class FakeStream:
    def __init__(self, name: str, rec: Recorder) -> None:
        self.name, self.rec, self.cuda_stream = name, rec, HANDLES[name]

    def wait_stream(self, other: FakeStream) -> None:
        self.rec.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.rec.log.append(("wait_event", self.name, event.id))


class FakeEvent:
    def __init__(self, rec: Recorder) -> None:
        self.rec, self.id = rec, len(rec.ops("new_event"))
        rec.log.append(("new_event", None, self.id))

    def record(self, stream: FakeStream) -> None:
        self.rec.log.append(("record", stream.name, self.id))


class FakeDriver:
    """cuda-bindings' driver module as the engine uses it; flags are ("my" | "peer", slot)."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.CUresult = SimpleNamespace(CUDA_SUCCESS=0)

    def CUstream(self, handle: int) -> int:
        return handle

    def CUdeviceptr(self, address: int) -> int:
        return int(address)

    def cuStreamWaitValue32(self, stream, address, value, flags):
        self.rec.log.append(("wait_flag", self.rec.names[stream], address, value))
        return (0,)

    def cuStreamWriteValue32(self, stream, address, value, flags):
        self.rec.log.append(("write_flag", self.rec.names[stream], address, value))
        return (0,)

    def cuMemcpyDtoDAsync(self, dst, src, nbytes, stream):
        self.rec.log.append(("copy", self.rec.names[stream], dst, src, nbytes))
        return (0,)

    def cuMemsetD32Async(self, address, value, count, stream):
        self.rec.log.append(("memset", self.rec.names[stream], address, value, count))
        return (0,)


def _peers(rec: Recorder, gemm_streams: int, at_end: bool, rank: int = 0) -> CopyEnginePeers:
    """A peers object without GPUs: CPU byte buffers, the fakes, rank ``rank`` of two."""
    peers = object.__new__(CopyEnginePeers)
    peers.device, peers.rank, peers.peer = torch.device("cpu"), rank, 1 - rank
    peers.gemm_streams, peers.own_copy_at_end = gemm_streams, at_end
    peers._driver, peers._ok, peers._geq, peers._fence_write = FakeDriver(rec), 0, "geq", "fence"
    peers._streams, peers._events, peers._plans = {}, [], OrderedDict()
    peers._calls, peers._capturing_own, peers._broken, peers._captured = 0, False, "", False
    peers._my_flag = [("my", i) for i in range(ce.FLAG_SLOTS)]
    peers._peer_flag = [("peer", i) for i in range(ce.FLAG_SLOTS)]
    peers._counter = [("counter", i) for i in range(ce.COUNTER_SLOTS)]
    peers._counters = torch.zeros(ce.COUNTER_SLOTS, dtype=torch.int32)
    peers._flags = torch.zeros(ce.FLAG_SLOTS, dtype=torch.int32)
    peers._peer_flags = torch.zeros(ce.FLAG_SLOTS, dtype=torch.int32)
    peers._sms = 132
    for name in ("side", "local", "alt", "notify"):
        setattr(peers, f"_{name}", FakeStream(name, rec))
        setattr(peers, f"_{name}_h", HANDLES[name])
    peers._capacity = BUFFER_BYTES
    peers._part, peers._final, peers._peer_part, peers._peer_final = (
        torch.zeros(BUFFER_BYTES, dtype=torch.uint8) for _ in range(4)
    )
    return peers


@pytest.fixture
def rec(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Torch's streams, events and GEMMs replaced by recording fakes for one test."""
    rec = Recorder()
    streams = {"main": FakeStream("main", rec)}

    @contextlib.contextmanager
    def stream(s: FakeStream):
        before, rec.current = rec.current, s.name
        try:
            yield
        finally:
            rec.current = before

    def mm(x, y, *, out):
        rec.log.append(("gemm", rec.current, out.data_ptr()))

    def addmm_(self, x, y):
        rec.log.append(("gemm", rec.current, self.data_ptr()))
        return self

    def add_(self, other):
        rec.log.append(("add", rec.current, self.data_ptr(), other.data_ptr()))
        return self

    def rows_gemm(
        a, b, out, tile, *, grid, row_group, counters=None, ready=None, out2=None, remote_counters=False
    ):
        phase = "phase 2" if ready is not None else "phase 1"
        rec.log.append(("kernel", rec.current, phase, out2 is not None, out.data_ptr(), remote_counters))

    monkeypatch.setattr(ce, "rows_gemm", rows_gemm)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams["main"])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **kw: FakeEvent(rec))
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch.Tensor, "addmm_", addmm_)
    monkeypatch.setattr(torch.Tensor, "add_", add_)
    return rec


def _call(
    peers: CopyEnginePeers, collective: str, weights: tuple[int, ...], exchange: bool = False, tile=None
) -> torch.Tensor:
    a, b = torch.randn(M, K), torch.randn(K, N)
    rows = M if collective == "all_reduce" else M // 2
    out = torch.empty(rows, N)
    peers._run(collective, a, b, weights, ce._Mode(tile=tile, exchange=exchange), out)
    return out


def _peer_waits(rec: Recorder) -> list[int]:
    """Indices of the waits for this call's data from the peer: its PARTIAL / SUMMED flags."""
    return [
        i
        for i, op in rec.ops("wait_flag")
        if op[2][0] == "my" and (PARTIAL <= op[2][1] < SUMMED or SUMMED <= op[2][1] < PULLED)
    ]


def _signals_before_waits(rec: Recorder) -> None:
    """For PARTIAL and SUMMED: every flag of the kind I set on the peer is queued before my first
    wait for one of that kind (the peer's wait for mine would otherwise sit behind my wait for its
    flag in a shared hardware queue, and both ranks would wait forever)."""
    for lo, hi in ((PARTIAL, SUMMED), (SUMMED, PULLED)):
        sets = [i for i, op in rec.ops("write_flag") if op[2][0] == "peer" and lo <= op[2][1] < hi]
        waits = [i for i, op in rec.ops("wait_flag") if op[2][0] == "my" and lo <= op[2][1] < hi]
        if sets and waits:
            assert max(sets) < min(waits), (lo, sets, waits)


def _after_waits(rec: Recorder, waits: list[int]) -> set[int]:
    """Events recorded on a stream after one of ``waits`` (on that stream): they depend on the peer."""
    out = set()
    for i, op in rec.ops("record"):
        if any(w < i and rec.log[w][1] == op[1] for w in waits):
            out.add(op[2])
    return out


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("gemm_streams", [1, 2])
@pytest.mark.parametrize("at_end", [False, True])
@pytest.mark.parametrize("weights", [(1,), (1, 1, 1), (2, 1)])
def test_chunked_call_order(rec: Recorder, collective: str, gemm_streams: int, at_end: bool, weights):
    """The cuBLAS-chunk mode: the GEMMs' streams and outputs, each phase-1 flag right after its
    GEMM, the hardware-queue rule, each phase-2 GEMM after its pull, the joins at the end and
    AllReduce's local copies (checked to fail on three mutations of ``_run``: phase 1 queued after
    the side stream's waits, the second GEMM stream not joined, a phase-2 GEMM's pull awaited on
    the wrong stream)."""
    peers = _peers(rec, gemm_streams, at_end)
    out = _call(peers, collective, weights)
    plan = peers._plan(collective, M, N, torch.float32, weights)
    chunks = len(plan.own)
    log = rec.log
    gemms = rec.ops("gemm")
    assert len(gemms) == 2 * chunks  # the peer's shard's chunks, then mine
    streams = ["main", "alt"][:gemm_streams]
    assert [op[1] for _, op in gemms] == [streams[g % gemm_streams] for g in range(2 * chunks)]
    # phase 1: into my ``part`` buffer, each followed on its stream by the peer's PARTIAL flag
    for c, (i, op) in enumerate(gemms[:chunks]):
        assert op[2] == plan.part[c].data_ptr()
        nxt = next(x for x in log[i + 1 :] if x[1] == op[1])
        assert nxt == ("write_flag", op[1], ("peer", PARTIAL + c), 1)
    last_phase1 = max(
        i for i, op in rec.ops("write_flag") if op[2][0] == "peer" and PARTIAL <= op[2][1] < SUMMED
    )
    # the hardware-queue rule: nothing waits for the peer's data before all of phase 1 is queued
    waits = _peer_waits(rec)
    assert waits and min(waits) > last_phase1
    _signals_before_waits(rec)
    dependent = _after_waits(rec, waits)
    for i, op in rec.ops("wait_event"):
        if op[2] in dependent:
            assert i > last_phase1, (i, op)
    # phase 2: each GEMM after its stream waited for the event recorded after its chunk's pull
    pulls = [(i, op) for i, op in rec.ops("copy") if op[1] == "side"][:chunks]
    for c, (i, op) in enumerate(gemms[chunks:]):
        pull_at = pulls[c][0]
        pulled = next(x[2] for x in log[pull_at:] if x[0] == "record" and x[1] == "side")
        waited = [j for j, x in rec.ops("wait_event") if x[1] == op[1] and x[2] == pulled]
        assert waited and waited[0] < i
        want = plan.final[c].data_ptr() if collective == "all_reduce" else out[plan.own[c][0]].data_ptr()
        assert op[2] == want
    # the call ends with every stream it used joined into the caller's
    joined = {op[2] for _, op in rec.ops("wait_stream") if op[1] == "main"}
    used = {op[1] for op in log if op[1] not in (None, "main")}
    assert used <= joined, (used, joined)
    tail = [op for op in log if op[1] == "main"][-len(used) :]
    assert all(op[0] == "wait_stream" for op in tail)
    local = [op for _, op in rec.ops("copy") if op[1] == "local"]
    if collective == "reduce_scatter":
        assert not local
        return
    m0 = plan.mine[0]
    if at_end:  # one copy of the whole shard, after a wait for every phase-2 GEMM's event
        shard_bytes = plan.own[-1][1] * ROW_BYTES
        assert local == [("copy", "local", out.data_ptr() + m0 * ROW_BYTES, plan.final_src[0], shard_bytes)]
        copy_at = next(i for i, op in rec.ops("copy") if op[1] == "local")
        summed = {x[2] for j, x in rec.ops("record") if j > gemms[chunks][0] and x[1] in streams}
        waited = {x[2] for j, x in rec.ops("wait_event") if x[1] == "local" and j < copy_at}
        assert summed and summed <= waited
    else:
        assert [op[4] for op in local] == [(r1 - r0) * ROW_BYTES for r0, r1 in plan.own]


@pytest.mark.parametrize("gemm_streams", [1, 2])
def test_exchange_call_order(rec: Recorder, gemm_streams: int):
    """The exchange mode: its GEMMs alternate streams too, every flag follows its GEMM, the adds
    wait for their pulls, and nothing waits for the peer before every GEMM is queued."""
    peers = _peers(rec, gemm_streams, False)
    _call(peers, "all_reduce", (1, 2, 1), exchange=True)
    streams = ["main", "alt"][:gemm_streams]
    gemms = rec.ops("gemm")
    assert [op[1] for _, op in gemms] == [streams[g % gemm_streams] for g in range(3)]
    last = max(i for i, op in rec.ops("write_flag") if op[2][0] == "peer" and op[2][1] < SUMMED)
    assert min(_peer_waits(rec)) > last
    _signals_before_waits(rec)
    for c, (i, op) in enumerate(rec.ops("add")):
        assert op[1] == streams[c % gemm_streams]
        assert any(x[1] == op[1] and j < i for j, x in rec.ops("wait_event"))
    joined = {op[2] for _, op in rec.ops("wait_stream") if op[1] == "main"}
    assert {"side"} | set(streams[1:]) <= joined


def test_waits_guarding_my_buffers_come_first(rec: Recorder):
    """PULLED (my ``part``) is waited for on the caller's stream before phase 1 writes it, and
    GATHERED (my ``final``) on the side stream before the pulls write it."""
    peers = _peers(rec, 2, False)
    _call(peers, "all_reduce", (1, 1))
    first_gemm = rec.ops("gemm")[0][0]
    pulled = [i for i, op in rec.ops("wait_flag") if op[2] == ("my", PULLED)]
    assert pulled and pulled[0] < first_gemm and rec.log[pulled[0]][1] == "main"
    gathered = [i for i, op in rec.ops("wait_flag") if op[2] == ("my", GATHERED)]
    first_pull = next(i for i, op in rec.ops("copy") if op[1] == "side")
    assert gathered and gathered[0] < first_pull and rec.log[gathered[0]][1] == "side"


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("weights", [(1,), (2, 1)])
@pytest.mark.parametrize("rank", [0, 1])
def test_tiled_call_order(rec: Recorder, collective: str, weights: tuple[int, ...], rank: int):
    """The tiled mode: phase 1's kernel, then per chunk the notify stream's wait for its tile count
    and the peer's PARTIAL flag; the side stream's pulls into my shard of the output, each followed
    by its READY flag; phase 2's kernel (whose tiles spin on READY) only after every pull and READY
    is queued, then READY's reset; for AllReduce phase 2 stores into the peer's memory too and
    counts in its SUMMED slots, and my side stream waits for each of the peer's chunk counts (after
    phase 2 is queued) and copies those sums from my ``final`` into the output; every stream joined
    at the end. Checked to fail when the notify stream's PARTIAL flags are queued after the side
    stream's pulls, when ReduceScatter's pulls land at my shard's rows of the whole output instead
    of the shard-sized output (session 8's first draft, which wrote past rank 1's output), and when
    the SUMMED waits are queued before phase 2."""
    from fo_kernels.schedule import Tile

    tile = Tile(block_m=16, block_n=32, block_k=16, group_m=1, num_warps=4, num_stages=1)
    peers = _peers(rec, 2, False, rank=rank)
    out = _call(peers, collective, weights, tile=tile)
    all_reduce = collective == "all_reduce"
    log = rec.log
    kernels = rec.ops("kernel")
    plan = peers._plan_tiled(collective, M, N, torch.float32, weights, tile)
    (m0, _), (t0, _) = plan.mine, plan.theirs
    mine = out[m0:] if all_reduce else out  # my shard of the output
    assert [op[1:] for _, op in kernels] == [
        ("main", "phase 1", False, plan.part.data_ptr(), False),
        ("main", "phase 2", all_reduce, mine.data_ptr(), all_reduce),
    ]
    (k1, _), (k2, _) = kernels
    notify = [op for op in log if op[1] == "notify" and op[0] in ("wait_flag", "write_flag")]
    want = []
    for c in range(len(plan.other)):
        want += [("wait_flag", "notify", ("counter", c), plan.other_tiles[c])]
        want += [
            ("write_flag", "notify", ("counter", c), 0),
            ("write_flag", "notify", ("peer", PARTIAL + c), 1),
        ]
    assert notify == want
    assert min(i for i, op in enumerate(log) if op[1] == "notify" and op[0] == "wait_flag") > k1
    partial = [i for i, op in rec.ops("write_flag") if op[2][0] == "peer" and op[2][1] < SUMMED]
    assert min(_peer_waits(rec)) > max(partial)
    _signals_before_waits(rec)
    # the pulls: the peer's partial of each of my chunks into my shard of the output, in bounds
    side_copies = [op for _, op in rec.ops("copy") if op[1] == "side"]
    end = out.data_ptr() + out.numel() * out.element_size()
    for c, (r0, r1) in enumerate(plan.own):
        dst, src, nbytes = side_copies[c][2:]
        want = (mine.data_ptr() + r0 * ROW_BYTES, plan.pull_src[c], (r1 - r0) * ROW_BYTES)
        assert (dst, src, nbytes) == want
        assert dst + nbytes <= end
    ready = [
        i
        for i, op in rec.ops("write_flag")
        if op[1] == "side" and op[2][0] == "my" and op[2][1] >= ce.READY and op[3] == 1
    ]
    assert len(ready) == len(plan.own) and max(ready) < k2
    resets = rec.ops("memset")
    assert [op[1:] for _, op in resets] == [("main", ("my", ce.READY), 0, len(plan.own))]
    assert resets[0][0] > k2
    # AllReduce: the peer's summed tiles, counted per chunk, copied into the output as each completes
    summed = [(i, op) for i, op in rec.ops("wait_flag") if op[2][0] == "my" and SUMMED <= op[2][1] < PULLED]
    if all_reduce:
        assert [op[1:] for _, op in summed] == [
            ("side", ("my", SUMMED + c), plan.other_tiles[c]) for c in range(len(plan.other))
        ]
        assert min(i for i, _ in summed) > k2
        gathers = side_copies[len(plan.own) :]
        assert [op[2:] for op in gathers] == [
            (out.data_ptr() + (t0 + r0) * ROW_BYTES, plan.final_src[c], (r1 - r0) * ROW_BYTES)
            for c, (r0, r1) in enumerate(plan.other)
        ]
    else:
        assert not summed and len(side_copies) == len(plan.own)
    assert not [op for _, op in rec.ops("wait_flag") if op[2] == ("my", GATHERED)]
    joined = {op[2] for _, op in rec.ops("wait_stream") if op[1] == "main"}
    assert {"side", "notify"} <= joined
