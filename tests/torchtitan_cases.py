"""Rank functions for the torchtitan test (spawned processes import this module).

torchtitan's Llama-3 with a tiny config, parallelized twice by torchtitan's own ``apply_tp`` (its
tensor- and sequence-parallel plan): once as it ships, with torch's styles, once with fo-tune's
``ColwiseParallel`` / ``RowwiseParallel`` in their place (the two names its module imports, swapped
as a user's two-line change would). The model, the swap and the loss are
``examples/torchtitan_llama3.py``'s, so the example runs here too. Both copies take the same
tokens; the loss, every parameter's gradient (this rank's shard), the placements and the
collectives fo-tune's ops ran are reported.

torchtitan's DeepSeek-V3 (dense layers, low-rank queries) runs the same comparison through its own
plan (``apply_non_moe_tp``), which differs from Llama-3's: colwise ``wq_b`` / ``wkv_b`` take the
replicated DTensor a ``NoParallel`` module returns and give DTensors (``use_local_output=False``),
and the output layer keeps its vocabulary shards for torch's ``loss_parallel``.
"""

from __future__ import annotations

import copy
import sys
import warnings
from contextlib import nullcontext
from pathlib import Path
from types import ModuleType
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from cli_checks import load_example
from fo_kernels.errors import NotOverlappedWarning
from parallel_cases import fsdp2_tp, recorded_collectives, rel, styles_on_mesh_dims

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchtitan_llama3.py"


def example() -> ModuleType:
    """``examples/torchtitan_llama3.py`` as a module, loaded once (``load_example``)."""
    name = "torchtitan_llama3"
    if name not in sys.modules:
        sys.modules[name] = load_example(EXAMPLE, name)
    return sys.modules[name]


def _placements(model: torch.nn.Module) -> dict[str, tuple]:
    return {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}


def _compared(
    ref: torch.nn.Module,
    ours: torch.nn.Module,
    torch_result: tuple[torch.Tensor, dict[str, torch.Tensor]],
    fo_result: tuple[torch.Tensor, dict[str, torch.Tensor]],
    ops: list[str],
) -> dict[str, object]:
    """torch's model ``ref`` (its loss and gradients, ``torch_result``) against fo-tune's ``ours``
    (``fo_result``): relative errors of the loss and of every gradient, whether names and
    placements agree, and the collectives fo-tune's ops ran (``ops``)."""
    (want_loss, want), (loss, got) = torch_result, fo_result
    return dict(
        errs={"loss": rel(loss, want_loss), **{n: rel(got[n], want[n]) for n in want}},
        ops=sorted(set(ops)),
        same_names=list(got) == list(want),
        placements_equal=_placements(ref) == _placements(ours),
        grad_placements_equal=all(
            got[n].placements == g.placements for n, g in want.items() if isinstance(g, DTensor)
        ),
    )


def llama3(ctx, _payload) -> dict[str, object]:
    """fo-tune's styles against torch's in torchtitan's plan: relative errors of the loss and of
    every gradient, whether placements agree, and the collectives fo-tune's ops ran."""
    ex = example()
    mesh = DeviceMesh.from_group(dist.group.WORLD, ctx.device.type)
    full = ex.tiny_llama3(seed=0)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, ex.TINY["vocab_size"], (ex.BATCH, ex.SEQ), generator=gen)
    labels = torch.randint(0, ex.TINY["vocab_size"], (ex.BATCH, ex.SEQ), generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ex.apply_torchtitan_tp(copy.deepcopy(full), mesh, fo_tune=False)
        want_loss, want = ex.loss_and_grads(ref, tokens, labels)
        ours = ex.apply_torchtitan_tp(copy.deepcopy(full), mesh, fo_tune=True)
        with recorded_collectives() as ops:
            loss, got = ex.loss_and_grads(ours, tokens, labels)
    return _compared(ref, ours, (want_loss, want), (loss, got), ops)


# A tiny DeepSeek-V3: 2 dense layers of 4 heads (every sharded size divides by 2 and 4 ranks),
# low-rank queries and keys/values (q_lora_rank > 0: wq_a, q_norm, wq_b), 32 tokens.
DEEPSEEK_V3 = dict(
    vocab_size=32,
    dim=16,
    inter_dim=32,
    n_layers=2,
    n_dense_layers=2,
    n_heads=4,
    q_lora_rank=8,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=4,
    max_seq_len=16,
)


def tiny_deepseek_v3(seed: int) -> torch.nn.Module:
    """torchtitan's DeepSeek-V3 with the tiny dense config and random weights."""
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
    from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model

    torch.manual_seed(seed)
    model = DeepSeekV3Model(DeepSeekV3ModelArgs(**DEEPSEEK_V3))
    with torch.no_grad():
        model.init_weights()
    return model


def _deepseek_v3_tp(model: torch.nn.Module, mesh: DeviceMesh, *, fo_tune: bool) -> torch.nn.Module:
    """torchtitan's DeepSeek-V3 plan with loss parallelism, with torch's styles or with fo-tune's
    (the two names its parallelize module imports, swapped)."""
    from torchtitan.models.deepseek_v3.infra import parallelize as titan

    from fo_kernels.parallel import ColwiseParallel, RowwiseParallel

    styles = {"ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel} if fo_tune else {}
    with mock.patch.multiple(titan, **styles) if styles else nullcontext():
        titan.apply_non_moe_tp(
            model, mesh, loss_parallel=True, enable_float8_tensorwise_tp=False, cp_enabled=False
        )
    return model


def _parallel_loss_and_grads(
    model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The cross-entropy loss of the vocabulary-sharded logits (torch's ``loss_parallel``) and every
    parameter's gradient after its backward."""
    for p in model.parameters():
        p.grad = None
    logits = model(tokens)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
    return loss.full_tensor().detach(), {n: p.grad for n, p in model.named_parameters()}


def deepseek_v3(ctx, _payload) -> dict[str, object]:
    """fo-tune's styles against torch's in torchtitan's DeepSeek-V3 plan (loss parallelism): relative
    errors of the loss and of every gradient, whether placements agree, the collectives fo-tune's ops
    ran and the ``NotOverlappedWarning`` texts (apply and two steps)."""
    mesh = DeviceMesh.from_group(dist.group.WORLD, ctx.device.type)
    full = tiny_deepseek_v3(seed=0)
    vocab = DEEPSEEK_V3["vocab_size"]
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (2, 8), generator=gen)
    labels = torch.randint(0, vocab, (2, 8), generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = _deepseek_v3_tp(copy.deepcopy(full), mesh, fo_tune=False)
        want_loss, want = _parallel_loss_and_grads(ref, tokens, labels)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ours = _deepseek_v3_tp(copy.deepcopy(full), mesh, fo_tune=True)
        with recorded_collectives() as ops:
            loss, got = _parallel_loss_and_grads(ours, tokens, labels)
        _parallel_loss_and_grads(ours, tokens, labels)  # a second step warns of nothing new
    return dict(
        **_compared(ref, ours, (want_loss, want), (loss, got), ops),
        not_overlapped=[str(w.message) for w in seen if issubclass(w.category, NotOverlappedWarning)],
    )


# the rank functions a suite may name (fsdp2_tp and styles_on_mesh_dims reuse the 4 ranks of the
# world-size-4 job)
RANK_FUNCTIONS = {
    "llama3": llama3,
    "deepseek_v3": deepseek_v3,
    "fsdp2_tp": fsdp2_tp,
    "styles_on_mesh_dims": styles_on_mesh_dims,
}


def suite(ctx, parts: dict[str, tuple[str, object]]) -> dict[str, object]:
    """Several rank functions in one start of the ranks: name -> (function, payload)."""
    return {name: RANK_FUNCTIONS[fn](ctx, payload) for name, (fn, payload) in parts.items()}
