"""The MoE grouped GEMMs on one GPU: fo_kernels' Triton kernels beside ``torch._grouped_mm``.

    python bench/moe_grouped_gemm.py --out DIR [--suite suites/moe/experts.yaml] [--rounds 20]
        [--models DeepSeek-V3,Mixtral-8x7B] [--ep 4,8] [--tokens 1,16,64,256] [--tiles 1]

For every model, EP and tokens a rank (the suite's ``suites/moe/experts.yaml``, or ``--tokens``)
one rank's expert GEMMs at a balanced load: E / EP local experts, tokens x k rows split over them
by a seeded multinomial draw (uneven, as routing is; at few tokens some experts get no row, as
``fo_tune.moe.model``'s filled segments assume). Variants, bf16, timed side by side:

    up      lib: torch._grouped_mm(x, W13)               fo: swiglu_gemm (the SwiGLU in its epilogue)
    up_act  lib: torch._grouped_mm(x, W13) + silu * up   (what the no-overlap path runs)
    up_slotted                                          fo: swiglu_gemm over EP slots' segments
                                                            (the rows as dispatch lands them)
    down    lib: torch._grouped_mm(h, W2)                fo: grouped_gemm, one slot
    down_signalled                                      fo: grouped_gemm, EP slots, a counter
                                                            per slot (what the combine waits on)

Every variant is checked against ``torch._grouped_mm`` first (relative error < 2e-2). fo's tile
is the fastest of ``TILES`` (the first ``--tiles`` of them) per shape (each timed alone, then the
pick side by side). A sample is one CUDA graph replay of ``--calls`` calls; rounds alternate the
variants' order; the median of the rounds is reported. Writes DIR/moe_grouped_gemm.csv (one row
per model, EP, tokens and variant, with the GPU, torch, Triton and time of the run) and prints a
summary: fo's time over lib's (x lib > 1: fo is faster). Needs a CUDA GPU with
``torch._grouped_mm`` (torch >= 2.8, Hopper for bf16).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

os.environ.setdefault("TRITON_INTERPRET", "0")

from fo_kernels.moe.kernels import grouped_gemm, segment_tables, swiglu_block, swiglu_gemm
from fo_kernels.tile import Tile

# Tiles tried for fo's kernels: the dense engine's default (128x256x64, 8 warps, 3 stages; the
# design brief's prototype) and its neighbours.
TILES = (
    Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
    Tile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4),
    Tile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4),
    Tile(block_m=64, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
)
# The packaged suite: six public MoE models' expert shapes.
SUITE = Path(__file__).resolve().parents[1] / "suites" / "moe" / "experts.yaml"
TILE_SAMPLES = 3  # samples of each tile alone, to pick one
CHECK_TOL = 2e-2  # bf16 against torch._grouped_mm (the dense ops' bf16 tolerance)
COLUMNS = (
    "model", "ep", "tokens", "experts_local", "rows", "hidden", "intermediate", "variant", "tile",
    "lib_ms", "fo_ms", "x_lib", "gpu", "torch", "triton", "time",
)  # fmt: skip


@dataclass
class _Graphed:
    """One sample: a replay of a CUDA graph of ``calls`` calls of ``fn``, in ms per call. ``fn``
    lives as long as the graph: the device tensors it holds (fo's segment tables) are what the
    graph's kernels read, and freed, their memory goes to the next capture."""

    fn: Callable[[], object]
    graph: torch.cuda.CUDAGraph
    calls: int
    start: torch.cuda.Event = field(default_factory=lambda: torch.cuda.Event(enable_timing=True))
    end: torch.cuda.Event = field(default_factory=lambda: torch.cuda.Event(enable_timing=True))

    def __call__(self) -> float:
        self.start.record()
        self.graph.replay()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / self.calls


def _timed(fn: Callable[[], object], calls: int) -> _Graphed:
    """``fn`` warmed up, then captured ``calls`` times into one graph (``_Graphed``)."""
    fn()  # warm-up: compile, allocate
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return _Graphed(fn, graph, calls)


def _rounds(samples: dict[str, _Graphed], rounds: int) -> dict[str, float]:
    """Median ms of each variant over ``rounds`` rounds whose order rotates."""
    names = list(samples)
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            times[n].append(samples[n]())
    return {n: statistics.median(t) for n, t in times.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def planned_shapes(suite: dict, models: list[str], eps: list[int], tokens: list[int]) -> list[tuple]:
    """(suite index, model, EP, tokens a rank) of every shape the run times, in its order: the
    suite's models (those of ``models``, all when empty), each at every EP and tokens."""
    return [
        (i, model, ep, t)
        for i, model in enumerate(suite["models"])
        if not models or model["name"] in models
        for ep in eps
        for t in tokens
    ]


def bench_shape(
    model: dict, ep: int, tokens: int, rounds: int, calls: int, seed: int, tiles: tuple[Tile, ...] = TILES
) -> list[dict]:
    """The rows of one model at one EP and tokens a rank (see the module docstring)."""
    dev = torch.device("cuda")
    local, k = model["experts"] // ep, model["top_k"]
    h, inter, rows = model["hidden"], model["intermediate"], tokens * k
    gen = torch.Generator(device=dev).manual_seed(seed)
    probs = torch.ones(local, device=dev)
    counts = torch.bincount(torch.multinomial(probs, rows, replacement=True, generator=gen), minlength=local)
    counts = counts.tolist()
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(rows, h, device=dev, generator=gen, dtype=torch.bfloat16)
    w13 = torch.randn(local, h, 2 * inter, device=dev, generator=gen, dtype=torch.bfloat16) / h**0.5
    hh = torch.randn(rows, inter, device=dev, generator=gen, dtype=torch.bfloat16)
    w2 = torch.randn(local, inter, h, device=dev, generator=gen, dtype=torch.bfloat16) / inter**0.5
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    segs, at = [], 0
    for e, c in enumerate(counts):
        segs.append((at, c, e, 0))
        at += c
    # EP slots: each expert's rows cut into EP parts, listed slot by slot (the tiles of slot 0
    # first, as the combine sends them); the rows stay where they are, so the product is the same
    slotted = [
        (r0 + c * s // ep, c * (s + 1) // ep - c * s // ep, e, s) for s in range(ep) for r0, c, e, _ in segs
    ]
    counters = torch.zeros(ep, dtype=torch.int32, device=dev)
    up_out = torch.empty(rows, inter, device=dev, dtype=torch.bfloat16)
    down_out = torch.empty(rows, h, device=dev, dtype=torch.bfloat16)

    def lib_up():
        return torch._grouped_mm(x, w13, offs=offs)

    def lib_up_act():
        gu = torch._grouped_mm(x, w13, offs=offs)
        return torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]

    def lib_down():
        return torch._grouped_mm(hh, w2, offs=offs)

    def fo(kind: str, tile: Tile):
        if kind in ("up", "up_slotted"):
            these = slotted if kind == "up_slotted" else segs
            tables = segment_tables(these, tile.block_m, -(-inter // swiglu_block(tile)), dev)
            return lambda: swiglu_gemm(x, w13, up_out, tables, tile, grid=sms)
        these = slotted if kind == "down_signalled" else segs
        tables = segment_tables(these, tile.block_m, -(-h // tile.block_n), dev)
        ctr = counters if kind == "down_signalled" else None
        return lambda: grouped_gemm(hh, w2, down_out, tables, tile, grid=sms, counters=ctr)

    # correctness first: fo against the library, every tile
    print(f"  {model['name']} EP{ep} T{tokens}: checking", file=sys.stderr, flush=True)
    ref_up = lib_up_act()
    ref_down = lib_down()
    for tile in tiles:
        for kind in ("up", "up_slotted"):
            up_out.fill_(float("nan"))
            fo(kind, tile)()
            assert _rel(up_out, ref_up) < CHECK_TOL, (model["name"], kind, tile)
        for kind in ("down", "down_signalled"):
            down_out.fill_(float("nan"))
            fo(kind, tile)()
            assert _rel(down_out, ref_down) < CHECK_TOL, (model["name"], kind, tile)
    out = []
    lib_of = {"up": lib_up, "up_slotted": lib_up_act, "down": lib_down, "down_signalled": lib_down}
    for kind in ("up", "up_slotted", "down", "down_signalled"):
        # (on stderr: an asynchronous CUDA error then names the variant it came from)
        print(f"  {model['name']} EP{ep} T{tokens}: timing {kind}", file=sys.stderr, flush=True)
        alone = {}
        for t in tiles:
            sample = _timed(fo(kind, t), calls)
            alone[t] = statistics.median(sample() for _ in range(TILE_SAMPLES))
        best = min(alone, key=alone.get)
        variants = {"fo": _timed(fo(kind, best), calls), "lib": _timed(lib_of[kind], calls)}
        if kind == "up":
            variants["lib_act"] = _timed(lib_up_act, calls)
        med = _rounds(variants, rounds)
        pairs = [(kind, med["lib"])] + ([("up_act", med["lib_act"])] if kind == "up" else [])
        for name, lib_ms in pairs:
            tile = f"{best.block_m}x{best.block_n}x{best.block_k}/w{best.num_warps}/s{best.num_stages}"
            shape = dict(
                model=model["name"], ep=ep, tokens=tokens, experts_local=local, rows=rows, hidden=h,
                intermediate=inter,
            )  # fmt: skip
            fo_ms = med["fo"]
            times = {"lib_ms": lib_ms, "fo_ms": fo_ms, "x_lib": lib_ms / fo_ms}  # unrounded in the CSV
            out.append({**shape, "variant": name, "tile": tile, **times})
    return out


def read_suite(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[dict, list[str], list[int], list[int]]:
    """The suite of ``args.suite``, the models ``args.models`` names (empty: all), the EP sizes of
    ``args.ep`` and the tokens a rank of ``args.tokens`` (comma-separated; empty: the suite's),
    each checked: a bad one is the parser's one-line error (exit 2), before any work. Shared by
    bench/'s one-GPU MoE scripts."""
    try:
        suite = yaml.safe_load(Path(args.suite).read_text())
    except OSError as exc:
        parser.error(f"--suite: {exc.strerror}: {args.suite}")
    names = [m["name"] for m in suite["models"]]
    wanted = [n for n in args.models.split(",") if n]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        parser.error(f"--models: unknown model {unknown[0]!r}: the suite has {', '.join(names)}")
    try:
        eps = [int(e) for e in args.ep.split(",") if e] or suite["ep"]
    except ValueError:
        parser.error(f"--ep: {args.ep!r} is not a comma-separated list of whole numbers")
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t] or [suite["tokens"]]
    except ValueError:
        parser.error(f"--tokens: {args.tokens!r} is not a comma-separated list of whole numbers")
    if min(tokens) < 1:
        parser.error(f"--tokens: {args.tokens!r}: every count of tokens a rank must be >= 1")
    for model in (m for m in suite["models"] if m["name"] in (wanted or names)):
        for ep in eps:
            if ep < 1 or model["experts"] % ep:  # E / EP experts a rank
                parser.error(f"--ep {ep} does not divide {model['name']}'s {model['experts']} experts")
    return suite, wanted, eps, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] + " Needs a CUDA GPU with torch._grouped_mm."
    )
    parser.add_argument(
        "--out", required=True, help="folder to write moe_grouped_gemm.csv into (made if missing)"
    )
    parser.add_argument(
        "--suite", default=str(SUITE), help="the models' expert shapes (default: %(default)s)"
    )
    parser.add_argument("--rounds", type=int, default=20, help="timing rounds (default: %(default)s)")
    parser.add_argument(
        "--calls", type=int, default=10, help="calls per graph replay, a sample (default: %(default)s)"
    )
    parser.add_argument("--models", default="", help="comma-separated model names (default: all)")
    parser.add_argument("--ep", default="", help="comma-separated EP sizes (default: the suite's)")
    parser.add_argument(
        "--tokens", default="", help="comma-separated tokens a rank, each >= 1 (default: the suite's tokens)"
    )
    parser.add_argument(
        "--tiles",
        type=int,
        default=len(TILES),
        help=f"try the first N of fo's {len(TILES)} tiles, 128x256x64 first (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.tiles <= len(TILES):
        parser.error(f"--tiles must be 1..{len(TILES)}, got {args.tiles}")
    for name in ("rounds", "calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    suite, wanted, eps, tokens = read_suite(parser, args)
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        print("needs a CUDA GPU and torch._grouped_mm (torch >= 2.8)", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import triton

    run = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )  # fmt: skip
    rows = []
    path = out_dir / "moe_grouped_gemm.csv"
    for i, model, ep, t in planned_shapes(suite, wanted, eps, tokens):
        for r in bench_shape(model, ep, t, args.rounds, args.calls, seed=i, tiles=TILES[: args.tiles]):
            rows.append({**r, **run})
            where = f"{r['model']:<18} EP{ep} T{t:<5} {r['experts_local']:>3} experts {r['rows']:>6} rows"
            times = f"lib {r['lib_ms']:.3f} ms  fo {r['fo_ms']:.3f} ms  x lib {r['x_lib']:.3f}"
            print(f"{where}  {r['variant']:<15} {times}  ({r['tile']})", flush=True)
        _write(rows, path)  # after every shape: a run cut short keeps what it measured
    print(f"wrote {path}")
    return 0


def _write(rows: list[dict], path: Path) -> None:
    """The CSV of ``rows``, replaced atomically."""
    with open(path.with_suffix(".tmp"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    path.with_suffix(".tmp").replace(path)


if __name__ == "__main__":
    sys.exit(main())
