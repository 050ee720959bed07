"""Expert parallelism on a small MoE decoder (Mixtral or Qwen3-MoE), checked against the unsharded
model.

    python examples/moe_block.py                         # 2 ranks: a GPU each if there are 2, else CPU (gloo)
    python examples/moe_block.py --world-size 4 --model qwen3_moe
    torchrun --nproc-per-node 2 examples/moe_block.py

Every rank builds the same decoder from a ``transformers`` config with random weights (no download)
and keeps an unsharded copy. ``fo_kernels.parallelize_experts`` replaces each layer's experts block
by an ``ExpertParallelExperts``: rank r keeps experts [r x E/w, (r + 1) x E/w) and every expert
FFN runs as ``expert_parallel_ffn`` (dispatch, grouped GEMMs, combine). Attention and the routers
stay replicated; each rank runs its own tokens (a different number on every rank), as data
parallelism does. One forward and backward of a language-model loss then runs on both models on
this rank's tokens, and the example compares the logits, the loss, the gradients of the replicated
parameters (this rank's tokens alone) and of this rank's experts (every rank's tokens routed to
them: the unsharded model's expert gradients summed over the ranks). Last, the unsharded model's
state_dict (a checkpoint's keys, every expert) loads into a sharded model of other weights, whose
logits must then be the unsharded model's. It prints what it checked
with the largest relative error of each, then one ``RESULT`` line of JSON, and exits 1 when an
error exceeds the tolerance (float32: 1e-4).

Needs ``transformers`` (>= 5: its fused experts blocks), and ``launch.py`` beside it (how the
examples start their ranks and report). On the CPU, gloo moves the rows.
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
import torch.distributed as dist

# float32 against the unsharded float32 model.
TOLERANCE = 1e-4
HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB = 32, 4, 2, 2, 128
EXPERTS_PER_RANK, TOP_K, EXPERT_INTER = 3, 2, 24
MODELS = ("mixtral", "qwen3_moe")


def build_model(kind: str, world: int, seed: int) -> torch.nn.Module:
    """A 2-layer MoE decoder with ``EXPERTS_PER_RANK`` x world experts, random weights."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            **common, intermediate_size=EXPERT_INTER, num_local_experts=EXPERTS_PER_RANK * world
        )
        model_cls = MixtralForCausalLM
    else:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            **common,
            head_dim=HIDDEN // HEADS,
            intermediate_size=2 * EXPERT_INTER,
            moe_intermediate_size=EXPERT_INTER,
            num_experts=EXPERTS_PER_RANK * world,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
        model_cls = Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # transformers leaves some experts' weights to its init: make them all random
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0.0, 0.2)
    return model


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.detach().double()
    return ((got.detach().double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def grad_errors(sharded: torch.nn.Module, full: torch.nn.Module, rank: int, world: int) -> dict[str, float]:
    """The largest relative error of the experts' and of the other parameters' gradients."""
    from fo_kernels import ExpertParallelExperts

    worst: dict[str, float] = {}
    full_modules = dict(full.named_modules())
    for name, module in sharded.named_modules():
        if isinstance(module, ExpertParallelExperts):
            ref = full_modules[name]
            local = module.w13.shape[0]
            part = slice(rank * local, (rank + 1) * local)
            for got, want in ((module.w13, ref.gate_up_proj), (module.w2, ref.down_proj)):
                summed = want.grad.clone()
                dist.all_reduce(summed)  # every rank's tokens reach this rank's experts
                err = rel(got.grad, summed[part].transpose(1, 2))
                worst["expert weights"] = max(worst.get("expert weights", 0.0), err)
        elif not any(True for _ in module.children()) and "experts" not in name:
            for n, p in module.named_parameters():
                want = dict(full_modules[name].named_parameters())[n].grad
                worst["other parameters"] = max(worst.get("other parameters", 0.0), rel(p.grad, want))
    return worst


def check(kind: str, rank: int, world: int, device: torch.device) -> dict[str, float]:
    """Forward and backward of the sharded and the unsharded model; name -> relative error."""
    from fo_kernels import parallelize_experts

    full = build_model(kind, world, seed=0).to(device)
    sharded = copy.deepcopy(full)
    replaced = parallelize_experts(sharded)
    assert len(replaced) == LAYERS, replaced
    gen = torch.Generator().manual_seed(100 + rank)  # this rank's own tokens, a length of its own
    tokens = torch.randint(0, VOCAB, (1, 5 + 3 * rank), generator=gen).to(device)
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
    # the unsharded model's state_dict (a Hugging Face checkpoint's keys, every expert) loads into
    # a sharded model of other weights as this rank's experts
    loaded = build_model(kind, world, seed=1).to(device)
    parallelize_experts(loaded)
    loaded.load_state_dict(full.state_dict())
    with torch.no_grad():
        errors["checkpoint load"] = rel(loaded(input_ids=tokens).logits, outputs["full"].logits)
    return errors


def rank_main(rank: int, ranks: launch.Launch, kind: str) -> dict[str, float]:
    """One rank: join the group, run ``check``, report (rank 0 prints); each check's largest error."""
    with launch.process_group(rank, ranks) as device:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            errors = check(kind, rank, ranks.world, device)
        worst = launch.worst_over_ranks(errors)
    if rank == 0:
        report(kind, ranks.world, ranks.backend, worst)
    return worst


def report(kind: str, world: int, backend: str, worst: dict[str, float]) -> None:
    experts = EXPERTS_PER_RANK * world
    print(f"{kind} decoder ({LAYERS} layers, {experts} experts, top-{TOP_K}) over {world} ranks ({backend}):")
    print(f"  experts -> ExpertParallelExperts, {EXPERTS_PER_RANK} a rank; attention and routers replicated")
    ok = launch.print_errors(worst, TOLERANCE, width=18)
    launch.print_result({"model": kind, "world_size": world, "backend": backend, "errors": worst, "ok": ok})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    launch.add_world_size(parser)
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="mixtral",
        help="the decoder's transformers model (default: mixtral)",
    )
    launch.add_backend(parser)
    args = parser.parse_args(argv)
    ranks = launch.choose(parser, args)
    if not launch.imports("transformers", install="pip install transformers"):
        return 2
    worst = launch.start(ranks, rank_main, args.model)
    return 0 if launch.passed(worst, TOLERANCE) else 1


if __name__ == "__main__":
    sys.exit(main())
