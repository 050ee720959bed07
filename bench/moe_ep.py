"""The expert-parallel FFN on the ranks of this machine: each engine's overlapped call beside the
sequential one (dispatch -> torch._grouped_mm -> combine, two ``all_to_all_single``).

    python bench/moe_ep.py --out DIR [--world-size N] [--suite suites/moe/experts.yaml]
                           [--tokens T] [--scale S] [--rounds 30] [--backward]

For every model of the suite, EP = the world size: E / EP experts a rank, T tokens a rank (rank r
gets T x (1 + r mod 2) / 2 rounded: uneven, as serving is), routed top-k by random logits (each
token's k experts distinct, as ``torch.topk`` gives). ``--scale S`` divides H and I by S (a
smaller run of the same layout: the CPU smoke run uses it). Variants, by schedule:

    sequential   engine null: all_to_all_single, torch's grouped GEMMs, all_to_all_single
    table        schedule=None: the MoE table's row for the shape and the most tokens a rank holds
                 (``fo-tune search -c moe`` writes it), else the sequential path
    triton       NCCL ring steps beside the Triton grouped GEMMs (the dense engine's default tile)
    copy_engine  pushes into the peers' symmetric slots (only where its blocker allows: GPUs with
                 peer access, cuda-bindings, symmetric memory)

Every variant's output (and with ``--backward`` every gradient) is checked against the sequential
one's before timing (relative error < 2e-2 in bf16, 1e-4 in fp32). Timed side by side in
alternating rounds (``fo_tune.ranks.timing.time_interleaved``, 16 ms samples on GPUs, the ranks
aligned), the max over ranks. Writes DIR/moe_ep.csv (one row per model and variant, with the
GPU, versions and time of the run) and prints x sequential (> 1: faster than sequential).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
from pathlib import Path

import torch
import yaml

# The Triton engine's tile: the dense engine's default (docs/design.md#default-schedule).
TILE = {"block_m": 128, "block_n": 256, "block_k": 64, "group_m": 8, "num_warps": 8, "num_stages": 3}
# SMs the Triton engine's phase-2 GEMM leaves to NCCL: its default cap (16) + 4 (docs/design.md#interference).
SMS_FREE = 20
NCCL_CAP = 16
CHECK_TOL = {"bfloat16": 2e-2, "float32": 1e-4}
SHAPE_COLUMNS = ("model", "world", "tokens", "hidden", "intermediate", "experts_local", "top_k", "dtype")
RUN_COLUMNS = ("backend", "gpu", "torch", "time")
# The packaged suite: six public MoE models' expert shapes.
SUITE = Path(__file__).resolve().parents[1] / "suites" / "moe" / "experts.yaml"
# A CPU run that ends in minutes: the suite's layouts with H and I / 64, 16 tokens a rank, 2 rounds.
CPU_SMOKE = "--scale 64 --tokens 16 --rounds 2"
COLUMNS = (*SHAPE_COLUMNS, "backward", "variant", "median_ms", "iqr_ms", "x_sequential", *RUN_COLUMNS)


def _schedules(model: dict, world: int, tokens_max: int, dtype: str, device: torch.device) -> dict:
    from fo_kernels import MoeProblem, MoeSchedule
    from fo_kernels.engines.copy_engine.moe_gpu import blocker
    from fo_kernels.tile import Tile

    problem = MoeProblem(
        hidden=model["hidden"], intermediate=model["intermediate"], experts=model["experts"] // world,
        top_k=model["top_k"], tokens_max=tokens_max,
    )  # fmt: skip
    out = {"sequential": MoeSchedule(dtype=dtype, world_size=world, problem=problem), "table": None}
    if world > 1:
        out["triton"] = MoeSchedule(
            dtype=dtype, world_size=world, problem=problem, engine="triton", tile=Tile(**TILE),
            sms_free=SMS_FREE if device.type == "cuda" else 0, nccl_max_ctas=NCCL_CAP,
        )  # fmt: skip
        if not blocker(device, world):
            out["copy_engine"] = MoeSchedule(
                dtype=dtype, world_size=world, problem=problem, engine="copy_engine", chunks=2
            )
    return out


def rank_task(ctx, payload: dict) -> list[dict]:
    """This rank's check and timings of every model (see the module docstring)."""
    from fo_kernels import expert_parallel_ffn
    from fo_kernels.schedule import torch_dtype
    from fo_tune.ranks.timing import comparison_sample_ms, time_interleaved

    dtype_name, dev, world = payload["dtype"], ctx.device, ctx.world_size
    dtype = torch_dtype(dtype_name)
    out = []
    for i, model in enumerate(payload["models"]):
        model = dict(model, hidden=model["hidden"] // payload["scale"])
        model["intermediate"] = model["intermediate"] // payload["scale"]
        local, k, h, inter = model["experts"] // world, model["top_k"], model["hidden"], model["intermediate"]
        tokens = payload["tokens"] * (1 + ctx.rank % 2) // 2
        gen = torch.Generator(device=dev).manual_seed(1000 * i + ctx.rank)
        x = torch.randn(tokens, h, device=dev, generator=gen).to(dtype)
        w, ids = torch.randn(tokens, model["experts"], device=dev, generator=gen).softmax(-1).topk(k, dim=-1)
        w13 = (torch.randn(local, h, 2 * inter, device=dev, generator=gen) / h**0.5).to(dtype)
        w2 = (torch.randn(local, inter, h, device=dev, generator=gen) / inter**0.5).to(dtype)
        dy = torch.randn(tokens, h, device=dev, generator=gen).to(dtype)
        leaves = (x, w, w13, w2)
        schedules = _schedules(model, world, payload["tokens"], dtype_name, dev)

        def call(schedule, leaves=leaves, ids=ids, dy=dy):
            if not payload["backward"]:
                with torch.no_grad():
                    return (expert_parallel_ffn(leaves[0], ids, *leaves[1:], schedule=schedule),)
            args = [t.detach().requires_grad_() for t in leaves]
            y = expert_parallel_ffn(args[0], ids, *args[1:], schedule=schedule)
            return (y, *torch.autograd.grad(y, args, dy))

        want = call(schedules["sequential"])
        for name, schedule in schedules.items():
            for got, ref in zip(call(schedule), want, strict=True):
                err = ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
                if not err < CHECK_TOL[dtype_name]:
                    raise RuntimeError(f"{model['name']} {name}: relative error {err:.2e} against sequential")
        fns = {name: (lambda s=s: call(s)) for name, s in schedules.items()}
        timings = time_interleaved(
            fns, dev, rounds=payload["rounds"], agree=True, align=True,
            min_sample_ms=comparison_sample_ms(dev.type == "cuda"),
        )  # fmt: skip
        for name, t in timings.items():  # a collective is as slow as its slowest rank
            slowest = torch.tensor([t.median_ms, t.iqr_ms], device=dev)
            torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
            med, iqr = slowest.tolist()
            shape = (model["name"], world, payload["tokens"], h, inter, local, k, dtype_name)
            row = dict(zip(SHAPE_COLUMNS, shape, strict=True))
            out.append(
                {**row, "backward": payload["backward"], "variant": name, "median_ms": med, "iqr_ms": iqr}
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--out", required=True, help="folder to write moe_ep.csv into (made if missing)")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks = EP (default: the GPUs if 2 or more, else 2 on gloo)",
    )
    parser.add_argument(
        "--suite", default=str(SUITE), help="the models' expert shapes (default: %(default)s)"
    )
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: the suite's)")
    parser.add_argument(
        "--scale",
        type=int,
        default=None,
        help="divide H and I by this (default 1; on the CPU it must be given)",
    )
    parser.add_argument("--rounds", type=int, default=30, help="timing rounds (default: %(default)s)")
    parser.add_argument(
        "--dtype", choices=sorted(CHECK_TOL), default=None, help="default: bf16 on GPUs, else fp32"
    )
    parser.add_argument("--backward", action="store_true", help="time forward and backward")
    args = parser.parse_args(argv)
    for name in ("world_size", "tokens", "scale", "rounds"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = args.world_size or (gpus if gpus >= 2 else 2)
    backend = "nccl" if gpus >= world else "gloo"
    if backend == "gloo" and args.scale is None:
        print(
            f"on the CPU (gloo, {gpus} GPUs for {world} ranks) the suite's full shapes take hours in "
            f"Triton's interpreter: give --scale (a smoke run: {CPU_SMOKE}), or run on {world} GPUs",
            file=sys.stderr,
        )
        return 2
    try:
        suite = yaml.safe_load(Path(args.suite).read_text())
    except OSError as exc:
        parser.error(f"--suite: {exc.strerror}: {args.suite}")
    models = [m for m in suite["models"] if m["experts"] % world == 0]
    if not models:
        experts = ", ".join(f"{m['name']} {m['experts']}" for m in suite["models"])
        parser.error(f"--world-size {world} divides no model's experts ({experts}): EP must divide E")
    skipped = [f"{m['name']} ({m['experts']} experts)" for m in suite["models"] if m not in models]
    if skipped:
        print(f"skipped, EP {world} does not divide their experts: {', '.join(skipped)}", file=sys.stderr)
    smallest = min(min(m["hidden"], m["intermediate"]) for m in models)
    if args.scale and smallest < args.scale:
        parser.error(f"--scale {args.scale} leaves no column of the smallest H or I ({smallest})")
    os.environ.setdefault("TRITON_INTERPRET", "0" if backend == "nccl" else "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    from fo_tune.ranks.launch import run_ranks

    payload = dict(
        models=models, tokens=args.tokens or suite["tokens"], scale=args.scale or 1, rounds=args.rounds,
        dtype=args.dtype or ("bfloat16" if backend == "nccl" else "float32"), backward=args.backward,
    )  # fmt: skip
    rows = run_ranks(rank_task, world, payload, backend=backend)[0]
    run = dict(
        backend=backend, gpu=torch.cuda.get_device_name() if gpus else "cpu", torch=torch.__version__,
        time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )  # fmt: skip
    base = {r["model"]: r["median_ms"] for r in rows if r["variant"] == "sequential"}
    for r in rows:
        r.update(run, x_sequential=base[r["model"]] / r["median_ms"])  # unrounded in the CSV
        print(f"{r['model']:<18} w{world} {r['variant']:<12} {r['median_ms']:.3f} ms  ", end="")
        print(f"x sequential {r['x_sequential']:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "moe_ep.csv"
    with open(path.with_suffix(".tmp"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    path.with_suffix(".tmp").replace(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
