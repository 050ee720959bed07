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

Needs ``transformers`` (``pip install transformers``), and ``launch.py`` beside it (how the
examples start their ranks and report). On the CPU the Triton kernels run in Triton's
interpreter (``TRITON_INTERPRET=1``, set by ``launch.py``), slow but exact; the schedules are
fo-tune's heuristic ones unless a table for this machine exists (``fo-tune search``).
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings

try:
    import launch
except ModuleNotFoundError as missing:  # this script copied without the module the examples share
    if missing.name != "launch":
        raise
    print(
        f"{sys.argv[0]} needs launch.py beside it: copy fo-tune's examples/launch.py there", file=sys.stderr
    )
    sys.exit(2)
import torch

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


def rank_main(rank: int, ranks: launch.Launch) -> dict[str, float]:
    """One rank: join the group, run ``check``, report (rank 0 prints); each check's largest error."""
    with launch.process_group(rank, ranks) as device:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the heuristic schedules' "no table row" warnings
            errors = check(rank, ranks.world, device)
        worst = launch.worst_over_ranks(errors)
    if rank == 0:
        report(ranks.world, ranks.backend, worst)
    return worst


def report(world: int, backend: str, worst: dict[str, float]) -> None:
    print(f"Llama decoder ({LAYERS} layers, {2 * world} heads) sharded over {world} ranks ({backend}):")
    print("  q/k/v, gate/up -> ColwiseParallel; o_proj, down_proj -> RowwiseParallel (fo_kernels.parallel)")
    ok = launch.print_errors(worst, TOLERANCE, width=24)
    launch.print_result({"world_size": world, "backend": backend, "errors": worst, "ok": ok})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    launch.add_world_size(parser)
    launch.add_backend(parser)
    ranks = launch.choose(parser, parser.parse_args(argv))
    if not launch.imports("transformers", install="pip install transformers"):
        return 2
    worst = launch.start(ranks, rank_main)
    return 0 if launch.passed(worst, TOLERANCE) else 1


if __name__ == "__main__":
    sys.exit(main())
