"""torchtitan's Llama-3 on fo-tune's tensor-parallel styles: the two-line change, checked.

    python examples/torchtitan_llama3.py          # 2 ranks: one GPU each if there are 2, else CPU (gloo)
    python examples/torchtitan_llama3.py --world-size 4
    torchrun --nproc-per-node 2 examples/torchtitan_llama3.py

torchtitan (0.2) parallelizes Llama-3 in ``torchtitan/models/llama3/infra/parallelize.py``
(``apply_tp``) with torch's ``parallelize_module`` and torch's styles. fo-tune's styles take the same
arguments and leave the same DTensor parameters, so switching is the import of two names there:

    from torch.distributed.tensor.parallel import parallelize_module, PrepareModuleInput, SequenceParallel
    from fo_kernels.parallel import ColwiseParallel, RowwiseParallel

Then every block's ``wo`` and ``w2`` run GEMM + ReduceScatter (the plan's ``output_layouts=Shard(1)``,
sequence parallelism) and the output layer AllGather + GEMM (its ``input_layouts=Shard(1)``) as
fo-tune's overlapped ops; q/k/v, w1 and w3 take the replicated activation that torchtitan's
``PrepareModuleInput`` gathers. The embedding (an ``nn.Embedding``) and the output layer's gather of
its logits run as torch's styles run them, and say so once (``NotOverlappedWarning``; this script
silences warnings, so it prints none).

This script swaps those two names on torchtitan's module (what the edited import does), builds a
tiny Llama-3 with random weights on every rank (no download), parallelizes one copy with
torchtitan's plan as shipped and one with the swap, runs a cross-entropy loss on the same tokens
through both, and compares the loss and every parameter's gradient (this rank's shard). It prints
the largest relative error of each, then one ``RESULT`` line of JSON, and exits 1 when one exceeds
the tolerance (float32: 1e-5).

Needs ``torchtitan==0.2.2`` (0.3 shards its models with its own ``spmd_types`` instead of
``parallelize_module``), and ``launch.py`` beside it (how the examples start their ranks and
report). On the CPU the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
``launch.py``); the schedules are fo-tune's heuristic ones unless a table for this machine exists
(``fo-tune search``).
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

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
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

# float32 against torchtitan's own plan on the same float32 model.
TOLERANCE = 1e-5
# A tiny Llama-3: 4 heads of 4 dims, a SwiGLU FFN of 48 (multiple_of 16 over 2 * 4 * 16 / 3),
# 32 tokens: every sharded size divides by 1, 2 and 4 ranks.
TINY = dict(dim=16, n_layers=2, n_heads=4, vocab_size=32, multiple_of=16, max_seq_len=16, rope_theta=500000)
BATCH, SEQ = 2, 8  # SEQ divides by the world size: sequence parallelism shards it


def tiny_llama3(seed: int) -> torch.nn.Module:
    """torchtitan's Llama-3 ``Transformer`` with the tiny config and random weights."""
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    torch.manual_seed(seed)
    model = Transformer(TransformerModelArgs(**TINY))
    with torch.no_grad():
        model.init_weights()
    return model


@contextmanager
def fo_tune_styles() -> Iterator[None]:
    """torchtitan's parallelize module with fo-tune's ColwiseParallel and RowwiseParallel in place
    of torch's: what the two-line change of its import does."""
    from torchtitan.models.llama3.infra import parallelize as titan

    from fo_kernels.parallel import ColwiseParallel, RowwiseParallel

    with mock.patch.multiple(titan, ColwiseParallel=ColwiseParallel, RowwiseParallel=RowwiseParallel):
        yield


def apply_torchtitan_tp(model: torch.nn.Module, mesh: DeviceMesh, *, fo_tune: bool) -> torch.nn.Module:
    """torchtitan's tensor- and sequence-parallel plan (``apply_tp``) on ``model``, with torch's
    styles or with fo-tune's."""
    from torchtitan.models.llama3.infra.parallelize import apply_tp

    if fo_tune:
        with fo_tune_styles():
            apply_tp(model, mesh, loss_parallel=False, enable_float8_tensorwise_tp=False)
    else:
        apply_tp(model, mesh, loss_parallel=False, enable_float8_tensorwise_tp=False)
    return model


def loss_and_grads(
    model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The cross-entropy loss of one forward and every parameter's gradient after its backward."""
    for p in model.parameters():
        p.grad = None
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a tensor itself otherwise)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = local(got).detach().double(), local(want).detach().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def check(world: int, device: torch.device) -> dict[str, float]:
    """Both parallelizations on the same tokens; name -> relative error (fo-tune's against torch's)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    full = tiny_llama3(seed=0).to(device)
    gen = torch.Generator().manual_seed(1)  # the same tokens on every rank
    tokens = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=gen).to(device)
    labels = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=gen).to(device)
    results = {}
    for fo_tune in (False, True):
        model = apply_torchtitan_tp(copy.deepcopy(full), mesh, fo_tune=fo_tune)
        results[fo_tune] = loss_and_grads(model, tokens, labels)
    (want_loss, want), (got_loss, got) = results[False], results[True]
    errors = {"loss": rel(got_loss, want_loss)}
    for kind, names in (
        ("attention wq/wk/wv/wo", [n for n in want if ".attention.w" in n]),
        ("feed_forward w1/w2/w3", [n for n in want if ".feed_forward.w" in n]),
        (
            "embedding, norms, output",
            [n for n in want if ".attention." not in n and ".feed_forward." not in n],
        ),
    ):
        errors[kind] = max(rel(got[n], want[n]) for n in names)
    return errors


def rank_main(rank: int, ranks: launch.Launch) -> dict[str, float]:
    """One rank: join the group, run ``check``, report (rank 0 prints); each check's largest error."""
    with launch.process_group(rank, ranks) as device:
        with warnings.catch_warnings():
            # the heuristic schedules' "no table row" warnings, torchtitan's own
            warnings.simplefilter("ignore")
            errors = check(ranks.world, device)
        worst = launch.worst_over_ranks(errors)
    if rank == 0:
        report(ranks.world, ranks.backend, worst)
    return worst


def report(world: int, backend: str, worst: dict[str, float]) -> None:
    print(f"torchtitan Llama-3 ({TINY['n_layers']} layers) on {world} ranks ({backend}), its TP plan:")
    print("  fo_kernels.parallel's ColwiseParallel / RowwiseParallel against torch's")
    ok = launch.print_errors(worst, TOLERANCE, width=26)
    launch.print_result({"world_size": world, "backend": backend, "errors": worst, "ok": ok})


def unfit_world(world: int) -> str | None:
    """Why the tiny model cannot be sharded over ``world`` ranks, or None: sequence parallelism
    cuts the sequence and tensor parallelism the heads, so the world size divides both. Checked
    before any rank joins a group (an uneven cut fails inside a collective, on every rank)."""
    if world < 1:
        return "needs at least 1 rank"
    if SEQ % world or TINY["n_heads"] % world:
        return (
            f"the tiny Llama-3's sequence ({SEQ} tokens) and heads ({TINY['n_heads']}) are sharded "
            "over the ranks, so the world size must divide both"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    launch.add_world_size(parser, f"a divisor of {SEQ} and {TINY['n_heads']}")
    launch.add_backend(parser)
    # a world size the tiny model cannot be sharded over is a usage error, before any import or rank
    ranks = launch.choose(parser, parser.parse_args(argv), unfit_world)
    if not launch.imports("torchtitan", install="pip install torchtitan==0.2.2"):
        return 2
    worst = launch.start(ranks, rank_main)
    return 0 if launch.passed(worst, TOLERANCE) else 1


if __name__ == "__main__":
    sys.exit(main())
