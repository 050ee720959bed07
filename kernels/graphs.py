"""CUDA graphs a runtime records of its own calls: a call that repeats is captured once, then replayed.

A call's host time (Python, torch's dispatch, NCCL's enqueue) can exceed its GPU time at small
shapes: the loop then runs at the host's pace, not the GPU's. A training or serving loop's steady
state repeats each call with the same shape and the same operand and output addresses (the caching
allocator hands out the same blocks), so the runtime can capture such a call into a CUDA graph of
its own and replay it from then on: one launch instead of a call's worth of them. ``OwnGraphs``
keeps those graphs for a caller that says what a call's key is and how to issue it; ``OutputPool``
gives the outputs a memory pool of their own so their addresses repeat.

Both the ``overlap: false`` fallback and the copy engine (``fo_kernels.engines.copy_engine``) record their
graphs here; the copy engine also says what a capture issues (its list without the eager-only
prologue), joins the side streams a failed capture forked (``unwind``) and refuses to go on when
one was left capturing (``after_failure``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# A call is captured into a graph of its own the second time its key (shape, operand and output
# addresses) is seen: once could be a one-off, twice is a loop's steady state. A capture costs
# about one call's host time plus the graph's instantiation. At least 2 for calls through NCCL: the
# first, eager, call makes the communicator, which a capture cannot.
GRAPH_AFTER_CALLS = 2
# Graphs kept (LRU): a model has a few calls per layer, each with its own addresses. The graphs
# allocate nothing but cuBLAS's workspace for the capture stream, made in the first graph's pool
# (that graph is kept for the owner's life); buffers and the caller's tensors are outside.
GRAPH_CACHE_SIZE = 512
# Keys counted towards a capture (LRU), so keys that never repeat cannot grow without bound.
SEEN_CACHE_SIZE = 4096


class OutputPool:
    """New output tensors from a memory pool of their own (where torch has ``MemPool``): only these
    outputs come and go there, so a loop that drops each output before its next call gets the same
    block back and its calls keep one graph key (from torch's common pool an output's address
    wanders with other allocations, docs/design.md#cuda-graphs). The pool's freed blocks serve only
    later outputs of its owner."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: object | None = None
        # (an int: torch resolves a torch.device to its index on every call, ~2 us of host time)
        self._index = device.index if device.index is not None else 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.pool is None and hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool"):
            with torch.cuda.device(self.device):  # a MemPool belongs to the current device
                self.pool = torch.cuda.MemPool()
        if self.pool is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        with torch.cuda.use_mem_pool(self.pool, device=self._index):
            return torch.empty(shape, dtype=dtype, device=self.device)


def end_generator_capture(stream: torch.cuda.Stream) -> None:
    """After a failed capture: torch's CUDA random generator still believes a capture is on
    (``capture_end`` raised before telling it), and every later random draw on this GPU would
    fail; an empty capture's ``capture_end`` on ``stream`` tells it the capture is over."""
    with torch.cuda.stream(stream), warnings.catch_warnings(), contextlib.suppress(RuntimeError):
        warnings.simplefilter("ignore")  # "the CUDA graph is empty"
        empty = torch.cuda.CUDAGraph()
        empty.capture_begin(capture_error_mode="thread_local")
        empty.capture_end()


@dataclass
class OwnGraphs:
    """One owner's graphs of its calls, by key (LRU), and how often each uncaptured key was seen.

    ``call(key, issue, record)`` runs ``issue`` (which issues one call's work on the current
    stream and must issue the same operations every time for a key) eagerly until ``key`` has been
    seen ``after`` times, then captures ``record`` (default: ``issue``) once (on a stream of its
    own, ``thread_local``: other threads' CUDA calls do not break the capture) and replays the
    graph on the current stream, now and at every later sighting. A capture that fails ran
    nothing: that call and every later one run eagerly, with one ``RuntimeWarning`` (``failure``
    says why). ``unwind()`` runs on the capture stream when ``record`` raised mid-capture, before
    the capture ends; ``after_failure(exc)`` runs once a failed capture has ended and may raise to
    stop the call (the owner cannot go on).
    """

    device: torch.device
    what: str  # names the owner in the warning
    after: int = GRAPH_AFTER_CALLS  # 0: never capture
    replays: int = 0  # calls served by a graph (the bench and tests read it)
    calls: int = 0  # calls run through ``call``, replayed or not
    failure: str = ""
    unwind: Callable[[], None] | None = None
    after_failure: Callable[[BaseException], None] | None = None
    _graphs: OrderedDict = field(default_factory=OrderedDict, repr=False)  # key -> CUDAGraph
    _seen: OrderedDict = field(default_factory=OrderedDict, repr=False)  # key -> sightings
    _stream: torch.cuda.Stream | None = field(default=None, repr=False)
    # The first graph, never dropped: cuBLAS's workspace for the capture stream was allocated in
    # its memory pool and every later graph uses it, so that pool must outlive them all.
    _first: object | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self._graphs)

    def call(self, key: tuple, issue: Callable[[], None], record: Callable[[], None] | None = None) -> None:
        self.calls += 1
        if self.after <= 0:
            issue()
            return
        graph = self._graphs.get(key)
        if graph is None:
            seen = self._seen.pop(key, 0) + 1
            if seen < self.after:
                self._seen[key] = seen
                while len(self._seen) > SEEN_CACHE_SIZE:
                    self._seen.popitem(last=False)
                issue()
                return
            try:
                graph = self._capture(record if record is not None else issue)
            except Exception as exc:  # nothing recorded ran: this call and later ones run eagerly
                if self.after_failure is not None:
                    self.after_failure(exc)
                self.failure = str(exc)
                warnings.warn(
                    f"{self.what}: capturing a call in a CUDA graph failed ({exc}); this process "
                    "issues these calls eagerly from now on",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self.after = 0
                issue()
                return
            self._graphs[key] = graph
            if self._first is None:
                self._first = graph
            while len(self._graphs) > GRAPH_CACHE_SIZE:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        graph.replay()
        self.replays += 1

    def clear(self) -> None:
        """Drop every graph (the buffers they read moved); keys start counting again."""
        self._graphs.clear()
        self._seen.clear()

    def _capture(self, issue: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """A graph of one call: recorded, not run."""
        if self._stream is None:  # one stream, so cuBLAS makes one workspace for captures
            self._stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            # a memory pool of its own (pool=None): a pool shared by graphs is released once they
            # are all dropped, and torch asserts when a capture reuses it (docs/design.md#cuda-graphs)
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                issue()
            except BaseException:
                if self.unwind is not None:
                    self.unwind()
                try:
                    graph.capture_end()
                except RuntimeError:  # invalid already: the first error is the one to report
                    end_generator_capture(self._stream)
                raise
            try:
                graph.capture_end()
            except RuntimeError:
                end_generator_capture(self._stream)
                raise
        return graph
