"""Rank functions for the torchtitan test (spawned processes import this module).

torchtitan's Llama-3 with a tiny config, parallelized twice by torchtitan's own ``apply_tp`` (its
tensor- and sequence-parallel plan): once as it ships, with torch's styles, once with fo-tune's
``ColwiseParallel`` / ``RowwiseParallel`` in their place (the two names its module imports, swapped
as a user's two-line change would). The model, the swap and the loss are
``examples/torchtitan_llama3.py``'s, so the example runs here too. Both copies take the same
tokens; the loss, every parameter's gradient (this rank's shard), the placements and the
collectives fo-tune's ops ran are reported.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cli_checks import load_example
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
    return dict(
        errs={"loss": rel(loss, want_loss), **{n: rel(got[n], want[n]) for n in want}},
        ops=sorted(set(ops)),
        same_names=list(got) == list(want),
        placements_equal=_placements(ref) == _placements(ours),
        grad_placements_equal=all(
            got[n].placements == g.placements for n, g in want.items() if isinstance(g, DTensor)
        ),
    )


# the rank functions a suite may name (fsdp2_tp and styles_on_mesh_dims reuse the 4 ranks of the
# world-size-4 job)
RANK_FUNCTIONS = {"llama3": llama3, "fsdp2_tp": fsdp2_tp, "styles_on_mesh_dims": styles_on_mesh_dims}


def suite(ctx, parts: dict[str, tuple[str, object]]) -> dict[str, object]:
    """Several rank functions in one start of the ranks: name -> (function, payload)."""
    return {name: RANK_FUNCTIONS[fn](ctx, payload) for name, (fn, payload) in parts.items()}
