"""Tensor parallelism on a small Llama decoder, checked against the unsharded model.

    python examples/tp_block.py                     # 2 ranks: one GPU each if there are 2, else CPU (gloo)
    python examples/tp_block.py --world-size 4
    torchrun --nproc-per-node 2 examples/tp_block.py

Every rank builds the same decoder from a ``transformers`` Llama config with random weights (no
download) and keeps an unsharded copy. The attention's q/k/v projections and the MLP's gate/up
projections are sharded column-wise (each rank: its heads, its MLP columns), the attention's
output projection and the MLP's down projection row-wise (their GEMM and AllReduce overlapped by
fo_kernels), through ``fo_kernels.parallelize_linears``: fo-tune's ``ColwiseParallel`` /
``RowwiseParallel`` styles, the parameters DTensors with torch's placements. One forward and backward of
a language-model loss on the same tokens then runs on both models, and the example compares the
logits, the loss and every parameter's gradient (this rank's shard of it) with the unsharded
model's. It prints what it checked with the largest relative error of each, then one ``RESULT``
line of JSON, and exits 1 when an error exceeds the tolerance (float32: 1e-4).

Needs ``transformers`` (``pip install transformers``). On the CPU the Triton kernels run in Triton's
interpreter (``TRITON_INTERPRET=1``, set here), slow but exact; the schedules are fo-tune's
heuristic ones unless a table for this machine exists (``fo-tune search``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# float32 against the unsharded float32 model.
TOLERANCE = 1e-4
# Which Linear modules of a Llama decoder become which tensor-parallel layer.
PLAN = {
    "model.layers.*.self_attn.q_proj": "column",
    "model.layers.*.self_attn.k_proj": "column",
    "model.layers.*.self_attn.v_proj": "column",
    "model.layers.*.self_attn.o_proj": "row",
    "model.layers.*.mlp.gate_proj": "column",
    "model.layers.*.mlp.up_proj": "column",
    "model.layers.*.mlp.down_proj": "row",
}
HEAD_DIM = 16
BATCH, SEQ, VOCAB, LAYERS = 2, 8, 128, 2


def build_model(world: int, seed: int) -> torch.nn.Module:
    """A 2-layer Llama with 2 query heads and 1 key/value head per rank, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = 2 * world
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=heads * HEAD_DIM,
        intermediate_size=4 * heads * HEAD_DIM,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=world,
        max_position_embeddings=4 * SEQ,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.detach().double()
    return ((got.detach().double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def grad_errors(sharded: torch.nn.Module, full: torch.nn.Module, rank: int, world: int) -> dict[str, float]:
    """Largest relative error of each kind of parameter's gradient: this rank's shard of the
    unsharded model's gradient for the tensor-parallel weights (DTensors: ``Shard(0)`` column-wise,
    ``Shard(1)`` row-wise, cut as DTensor cuts them), all of it for the others."""
    from torch.distributed.tensor import DTensor, Shard

    worst: dict[str, float] = {}
    full_params = dict(full.named_parameters())
    for name, param in sharded.named_parameters():
        want = full_params[name].grad
        if isinstance(param, DTensor):
            (placement,) = param.placements
            kind = "column-parallel weights" if placement == Shard(0) else "row-parallel weights"
            got = param.grad.to_local()
            want = want.chunk(world, dim=placement.dim)[rank]
        else:  # embeddings, norms, lm_head
            kind, got = "other parameters", param.grad
        worst[kind] = max(worst.get(kind, 0.0), rel(got, want))
    return worst


def check(rank: int, world: int, device: torch.device) -> dict[str, float]:
    """Forward and backward of the sharded and the unsharded model; name -> relative error."""
    from fo_kernels import parallelize_linears

    full = build_model(world, seed=0).to(device)
    sharded = parallelize_linears(copy.deepcopy(full), PLAN)
    gen = torch.Generator().manual_seed(1)  # the same tokens on every rank
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(device)
    outputs = {}
    for name, model in (("full", full), ("sharded", sharded)):
        out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        outputs[name] = out
    errors = {
        "logits": rel(outputs["sharded"].logits, outputs["full"].logits),
        "loss": rel(outputs["sharded"].loss, outputs["full"].loss),
    }
    errors.update(grad_errors(sharded, full, rank, world))
    return errors


def rank_main(rank: int, world: int, backend: str, store: str, results: dict | None) -> None:
    """One rank: join the group, run ``check``, report (rank 0 prints)."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the heuristic schedules' "no table row" warnings
            errors = check(rank, world, device)
        everyone: list[dict[str, float]] = [{} for _ in range(world)]
        dist.all_gather_object(everyone, errors)
        # every rank done with its collectives before any tears the group down: a gloo rank whose
        # peer has already destroyed its pairs can abort at exit ("terminate called without an
        # active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    worst = {name: max(e[name] for e in everyone) for name in errors}
    if results is not None:
        results.update(worst)
    if rank == 0:
        report(world, backend, worst)


def report(world: int, backend: str, worst: dict[str, float]) -> None:
    print(f"Llama decoder ({LAYERS} layers, {2 * world} heads) sharded over {world} ranks ({backend}):")
    print("  q/k/v, gate/up -> ColwiseParallel; o_proj, down_proj -> RowwiseParallel (fo_kernels.parallel)")
    for name, err in worst.items():
        verdict = "ok" if err <= TOLERANCE else "TOO LARGE"
        print(f"  {name:<24} max relative error {err:.2e} ({verdict}, tolerance {TOLERANCE:.0e})")
    ok = all(err <= TOLERANCE for err in worst.values())
    print("RESULT " + json.dumps({"world_size": world, "backend": backend, "errors": worst, "ok": ok}))


def spawned(rank: int, world: int, backend: str, store: str, queue) -> None:
    results: dict[str, float] = {}
    rank_main(rank, world, backend, store, results)
    if rank == 0:
        queue.put(results)  # a SimpleQueue: written to its pipe before put returns
    # The rank's work is done, checked and reported. Its interpreter's shutdown is skipped: there a
    # gloo rank still aborted now and then ("terminate called without an active exception", twice
    # in CI, after every result was in and with the group destroyed behind a barrier), which
    # mp.spawn reports as a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument(
        "--backend", choices=["nccl", "gloo"], help="default: nccl with a GPU per rank, else gloo"
    )
    args = parser.parse_args(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.world_size
    if not under_torchrun and world < 1:
        parser.error("--world-size must be >= 1")
    # the backend before the imports of the client library: a usage error, at once
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend or ("nccl" if gpus >= world else "gloo")
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) if under_torchrun else 0
    if backend == "nccl" and under_torchrun and local >= gpus:
        parser.error(f"--backend nccl needs a GPU per rank; local rank {local} has none: use --backend gloo")
    if backend == "nccl" and not under_torchrun and gpus < world:
        parser.error(
            f"--backend nccl needs a GPU per rank ({world} ranks, {gpus} visible): use --backend gloo"
        )
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("this example needs transformers: pip install transformers", file=sys.stderr)
        return 2
    if under_torchrun:
        rank = int(os.environ["RANK"])
        os.environ.setdefault("TRITON_INTERPRET", "0" if backend == "nccl" else "1")
        results: dict[str, float] = {}
        if backend == "nccl":
            torch.cuda.set_device(local)
        dist.init_process_group(backend)
        rank_main(rank, world, backend, "", results)
        return 0 if all(err <= TOLERANCE for err in results.values()) else 1
    # Triton's interpreter on the CPU; set before the ranks import fo_kernels (they inherit it)
    os.environ.setdefault("TRITON_INTERPRET", "0" if backend == "nccl" else "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    with tempfile.TemporaryDirectory() as tmp:
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(spawned, args=(world, backend, os.path.join(tmp, "store"), queue), nprocs=world)
        results = queue.get()
    return 0 if all(err <= TOLERANCE for err in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
