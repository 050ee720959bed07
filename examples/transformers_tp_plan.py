"""transformers' ``tp_plan`` on fo-tune's ops: its "colwise" / "rowwise" names registered to fo-tune.

    python examples/transformers_tp_plan.py          # 2 ranks: one GPU each if there are 2, else CPU (gloo)
    python examples/transformers_tp_plan.py --world-size 4
    torchrun --nproc-per-node 2 examples/transformers_tp_plan.py

transformers (5.x) shards a model loaded with ``from_pretrained(..., tp_plan="auto")`` by its
``base_model_tp_plan`` (module pattern -> style name, e.g. ``"layers.*.mlp.down_proj": "rowwise"``),
and looks each name up in a registry, ``ALL_PARALLEL_STYLES``, that a user can register into. Its
styles are transformers' own ``TensorParallelLayer`` classes, not torch's ``ParallelStyle``: each
shards every parameter as it loads (DTensors with torch's placements: colwise weight ``Shard(0)``,
rowwise ``Shard(-1)``), then wraps the module's forward (``install_forward``). So fo-tune's styles
are not registered as they are; ``fo_tune_style`` below keeps transformers' parameter sharding and
replaces only the forward, by ``fo_kernels.parallel.install`` (a module fo-tune cannot run keeps
transformers' forward, with a ``NotOverlappedWarning``). ``register_fo_tune_styles()`` puts it under
the names "colwise" and "rowwise" of every model's plan.

This script saves a tiny Llama with random weights (no download), registers the styles, loads it
with ``tp_plan="auto"`` on every rank and compares logits, loss and the gradients of the sharded
weights (this rank's shard) with the unsharded model. It prints the largest relative error of each,
then one ``RESULT`` line of JSON, and exits 1 when one exceeds the tolerance (float32: 1e-5).

Needs ``transformers>=5`` and ``accelerate`` (``from_pretrained`` with a ``tp_plan`` asks for it),
and ``launch.py`` beside it (how the examples start their ranks and report).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
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
from torch.distributed.device_mesh import DeviceMesh

# float32 against the unsharded float32 model.
TOLERANCE = 1e-5
# transformers applies no tp_plan on fewer ranks (the parameters stay plain tensors, no module runs
# fo-tune's forward), so a smaller world would check nothing of fo-tune.
MIN_WORLD = 2
TOO_FEW = f"transformers shards by its tp_plan only over {MIN_WORLD} or more ranks"
BATCH, SEQ = 2, 8
# Vocabulary rows per rank: transformers shards the embedding by vocabulary, so the tiny Llama's
# vocabulary grows with the world size (a fixed one leaves ranks past its size no rows).
VOCAB_PER_RANK = 32


def fo_tune_style(base: type, fo_style: type) -> type:
    """A transformers style class: ``base``'s parameter sharding, fo-tune's forward."""
    from fo_kernels import parallel
    from fo_kernels.errors import NotOverlappedWarning, PlanError

    class FoTuneStyle(base):
        def install_forward(
            self, module: torch.nn.Module, mesh: DeviceMesh, **kwargs: object
        ) -> torch.nn.Module:
            style = fo_style(
                input_layouts=self.input_layouts,
                output_layouts=self.output_layouts,
                use_local_output=self.use_local_output,
            )
            try:
                return parallel.install(module, mesh, style)
            except PlanError as exc:
                warnings.warn(f"{exc}; transformers' forward runs it", NotOverlappedWarning, stacklevel=2)
                return super().install_forward(module, mesh, **kwargs)

    FoTuneStyle.__name__ = f"FoTune{base.__name__}"
    return FoTuneStyle


def register_fo_tune_styles() -> None:
    """transformers' "colwise" and "rowwise" plan names -> fo-tune's ops (process-wide, as
    transformers' registry is)."""
    from torch.distributed.tensor import Replicate, Shard
    from transformers.integrations.tensor_parallel import (
        ALL_PARALLEL_STYLES,
        ColwiseParallel,
        RowwiseParallel,
    )

    from fo_kernels import parallel

    colwise = fo_tune_style(ColwiseParallel, parallel.ColwiseParallel)
    rowwise = fo_tune_style(RowwiseParallel, parallel.RowwiseParallel)
    ALL_PARALLEL_STYLES.register("colwise", colwise(input_layouts=Replicate(), output_layouts=Shard(-1)))
    ALL_PARALLEL_STYLES.register("rowwise", rowwise(input_layouts=Shard(-1), output_layouts=Replicate()))


def no_progress_bars() -> None:
    """Turn transformers' progress bars off ("Writing model shards", "Loading weights"): noise here,
    and each bar's tqdm lock is a multiprocessing semaphore that a rank's ``os._exit`` leaves behind
    ("resource_tracker: There appear to be N leaked semaphore objects" at the end of the run)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def save_tiny_llama(folder: str, world: int) -> None:
    """A 2-layer Llama, 2 query heads, 1 key/value head and 32 vocabulary rows per rank, random
    weights, saved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    no_progress_bars()

    config = LlamaConfig(
        vocab_size=VOCAB_PER_RANK * world,
        hidden_size=16 * world,
        intermediate_size=32 * world,
        num_hidden_layers=2,
        num_attention_heads=2 * world,
        num_key_value_heads=world,
        max_position_embeddings=4 * SEQ,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def tp_arguments() -> dict[str, object]:
    """``from_pretrained``'s arguments for sharding by the model's own tp_plan: a
    ``DistributedConfig(tp_plan="auto")`` where this transformers has one (a standalone ``tp_plan=``
    is deprecated there, to be removed), else ``tp_plan="auto"`` (the earlier 5.x releases)."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return {"tp_plan": "auto"}
    if "tp_plan" not in inspect.signature(DistributedConfig).parameters:
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def check(folder: str, world: int, rank: int, device: torch.device) -> tuple[dict[str, float], int]:
    """The tp_plan model (fo-tune's styles registered) against the unsharded one: name -> relative
    error, and how many of its modules run on fo-tune's ops."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    from fo_kernels.parallel import plan_of

    no_progress_bars()
    register_fo_tune_styles()
    mesh = init_device_mesh(device.type, (world,))
    full = LlamaForCausalLM.from_pretrained(folder).to(device)
    sharded = LlamaForCausalLM.from_pretrained(folder, **tp_arguments(), device_mesh=mesh)
    gen = torch.Generator().manual_seed(1)  # the same tokens on every rank
    tokens = torch.randint(0, VOCAB_PER_RANK * world, (BATCH, SEQ), generator=gen).to(device)
    outs = {}
    for name, model in (("full", full), ("sharded", sharded)):
        outs[name] = model(input_ids=tokens, labels=tokens)
        outs[name].loss.backward()
    logits = outs["sharded"].logits
    errors = {
        "logits": rel(logits.full_tensor() if isinstance(logits, DTensor) else logits, outs["full"].logits),
        "loss": rel(outs["sharded"].loss, outs["full"].loss),
    }
    full_params = dict(full.named_parameters())
    for name, param in sharded.named_parameters():
        if not (isinstance(param, DTensor) and (".self_attn." in name or ".mlp." in name)):
            continue
        (placement,) = param.placements
        kind = "colwise weights" if placement.dim % param.dim() == 0 else "rowwise weights"
        want = full_params[name].grad.chunk(world, dim=placement.dim)[rank]
        errors[kind] = max(errors.get(kind, 0.0), rel(param.grad.to_local(), want))
    on_fo_tune = [name for name, module in sharded.named_modules() if plan_of(module) is not None]
    return errors, len(on_fo_tune)


def unfit_world(world: int) -> str | None:
    """Why transformers' tp_plan would check nothing of fo-tune over ``world`` ranks, or None."""
    return TOO_FEW if world < MIN_WORLD else None


def rank_main(rank: int, ranks: launch.Launch, folder: str) -> dict[str, float]:
    """One rank: join the group, run ``check``, report (rank 0 prints); each check's largest error."""
    # transformers reads the rank and world size from torchrun's variables, and binds the device by LOCAL_RANK
    for key, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", ranks.world)):
        os.environ.setdefault(key, str(value))
    with launch.process_group(rank, ranks) as device:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the heuristic schedules' "no table row" warnings
            errors, on_fo_tune = check(folder, ranks.world, rank, device)
        worst = launch.worst_over_ranks(errors)
    if rank == 0:
        print(f"transformers Llama, tp_plan='auto' over {ranks.world} ranks ({ranks.backend}):")
        print(
            f"  'colwise' / 'rowwise' registered to fo-tune's forward: {on_fo_tune} modules on fo-tune's ops"
        )
        ok = launch.print_errors(worst, TOLERANCE, width=16)
        result = {
            "world_size": ranks.world,
            "backend": ranks.backend,
            "errors": worst,
            "fo_tune_modules": on_fo_tune,
            "ok": ok,
        }
        launch.print_result(result)
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    launch.add_world_size(parser, f">= {MIN_WORLD}")
    launch.add_backend(parser)
    # too few ranks is a usage error, before any import or rank
    ranks = launch.choose(parser, parser.parse_args(argv), unfit_world)
    if not launch.imports("transformers", "accelerate", install="pip install transformers accelerate"):
        return 2
    with tempfile.TemporaryDirectory() as folder:
        save_tiny_llama(folder, ranks.world)  # under torchrun every rank saves its own copy
        worst = launch.start(ranks, rank_main, folder)
    return 0 if launch.passed(worst, TOLERANCE) else 1


if __name__ == "__main__":
    sys.exit(main())
