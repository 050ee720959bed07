"""How an example starts its ranks and reports: the part the examples share.

Each example (``tp_block.py``, ``moe_block.py``, ``torchtitan_llama3.py``,
``transformers_tp_plan.py``) owns its model, its check, its options and the world sizes it can
shard over; this module owns what is the same in all of them:

- ``add_world_size`` and ``add_backend``: the two options every example takes;
- ``choose``: the world size (torchrun's, else ``--world-size``) and the backend (nccl with a GPU
  per rank, else gloo) as a ``Launch``, each refused as a usage error (exit 2) before the example
  imports its client library or any rank starts;
- ``imports``: the client library imported, or one line saying what to install;
- ``start``: the ranks started, by torchrun (this process is one of them) or by ``mp.spawn``, each
  running the example's rank function;
- ``process_group``, ``worst_over_ranks``: a rank's time in the group, and each check's largest
  error over the ranks;
- ``print_errors``, ``print_result``, ``passed``: the report's error lines, its ``RESULT {json}``
  line and the exit status's verdict.

An example imports it as ``import launch``: Python puts a script's own folder on ``sys.path``, and
``mp.spawn``'s ranks inherit that path. Copy it with the example you copy.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from multiprocessing.queues import SimpleQueue

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKENDS = ("nccl", "gloo")
# the world size an example spawns without --world-size: the smallest that shards anything
DEFAULT_WORLD = 2

# A rank function: ``rank_main(rank, launch, *args)`` joins the group (``process_group``), runs the
# example's check and returns its errors (check name -> largest relative error over the ranks).
RankMain = Callable[..., dict[str, float]]


@dataclass(frozen=True)
class Launch:
    """How the ranks start: how many, on which backend, and who starts them."""

    world: int
    backend: str  # "nccl" (a GPU per rank) or "gloo" (CPU)
    under_torchrun: bool  # torchrun started this process as one of the ranks
    local_rank: int  # torchrun's LOCAL_RANK (this rank's GPU with nccl); 0 when spawning
    store: str = ""  # the spawned ranks' rendezvous file (torchrun's ranks meet by its variables)


def add_world_size(parser: argparse.ArgumentParser, condition: str = "") -> None:
    """``--world-size``: how many ranks to spawn; ``condition`` (e.g. ">= 2") joins its help."""
    which = f", {condition}" if condition else ""
    parser.add_argument(
        "--world-size",
        type=int,
        default=DEFAULT_WORLD,
        help=f"ranks to spawn{which} (ignored under torchrun)",
    )


def add_backend(parser: argparse.ArgumentParser) -> None:
    """``--backend``: nccl or gloo, chosen by the GPUs when left out."""
    parser.add_argument("--backend", choices=BACKENDS, help="default: nccl with a GPU per rank, else gloo")


def choose(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    unfit: Callable[[int], str | None] | None = None,
) -> Launch:
    """The world size and backend from torchrun's variables or the options. A world size the
    example cannot shard over (``unfit(world)`` says why), or nccl without a GPU per rank, is a
    usage error (``parser.error``: one line, exit 2) before any import of the client library and,
    under torchrun, before this rank joins the group."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.world_size
    why = unfit(world) if unfit is not None else None
    if why:
        ranks = f"{world} rank" if world == 1 else f"{world} ranks"
        which = f"torchrun's {ranks}" if under_torchrun else f"--world-size {world}"
        parser.error(f"{which}: {why}")
    if not under_torchrun and world < 1:
        parser.error("--world-size must be >= 1")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend or ("nccl" if gpus >= world else "gloo")
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) if under_torchrun else 0
    if backend == "nccl" and under_torchrun and local >= gpus:
        parser.error(f"--backend nccl needs a GPU per rank; local rank {local} has none: use --backend gloo")
    if backend == "nccl" and not under_torchrun and gpus < world:
        parser.error(
            f"--backend nccl needs a GPU per rank ({world} ranks, {gpus} visible): use --backend gloo"
        )
    return Launch(world=world, backend=backend, under_torchrun=under_torchrun, local_rank=local)


def imports(*names: str, install: str) -> bool:
    """Whether the client libraries ``names`` import; when one does not, one line on stderr says
    what the example needs and the command that installs it (``install``)."""
    try:
        for name in names:
            importlib.import_module(name)
    except ImportError:
        print(f"this example needs {' and '.join(names)}: {install}", file=sys.stderr)
        return False
    return True


def start(launch: Launch, rank_main: RankMain, *args: object) -> dict[str, float]:
    """Run ``rank_main(rank, launch, *args)`` on every rank; rank 0's errors (under torchrun, this
    rank's: every rank returns the same). Spawned ranks pickle ``rank_main`` by reference: it is a
    module-level function of the example, which each spawned rank imports again as ``__mp_main__``."""
    # Triton's interpreter on the CPU; set before the ranks import fo_kernels (spawned ones inherit it)
    os.environ.setdefault("TRITON_INTERPRET", "0" if launch.backend == "nccl" else "1")
    if launch.under_torchrun:
        return rank_main(int(os.environ["RANK"]), launch, *args)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    with tempfile.TemporaryDirectory() as tmp:
        spawned_launch = replace(launch, store=os.path.join(tmp, "store"))
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_spawned, args=(rank_main, spawned_launch, args, queue), nprocs=launch.world)
        return queue.get()


def _spawned(rank: int, rank_main: RankMain, launch: Launch, args: tuple, queue: SimpleQueue) -> None:
    """One spawned rank: ``rank_main``, whose errors rank 0 hands to the parent, then a plain exit."""
    worst = rank_main(rank, launch, *args)
    if rank == 0:
        queue.put(worst)  # a SimpleQueue: written to its pipe before put returns
    # The rank's work is done, checked and reported. Its interpreter's teardown is skipped: a gloo
    # group that something other than fo_kernels keeps past its destroy (a model's device mesh,
    # torch._dynamo imported after the group) can abort the rank there ("terminate called without
    # an active exception", fo_kernels.runtime's _release_at_exit), which mp.spawn reports as a
    # failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextmanager
def process_group(rank: int, launch: Launch) -> Iterator[torch.device]:
    """This rank in the group for the ``with`` block, which gets its device (with nccl the GPU of its
    local rank, else the CPU); on leaving, a barrier, then the group destroyed."""
    local = launch.local_rank if launch.under_torchrun else rank
    device = torch.device("cuda", local) if launch.backend == "nccl" else torch.device("cpu")
    if launch.backend == "nccl":
        torch.cuda.set_device(device)
    if launch.under_torchrun:
        dist.init_process_group(launch.backend)  # torchrun's variables say where to meet
    else:
        init = f"file://{launch.store}"
        dist.init_process_group(launch.backend, init_method=init, rank=rank, world_size=launch.world)
    try:
        yield device
        # every rank done with its collectives before any tears the group down: a gloo rank whose
        # peer has already destroyed its pairs can abort at exit ("terminate called without an
        # active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def worst_over_ranks(errors: dict[str, float]) -> dict[str, float]:
    """Each check's largest error over the ranks (every rank gets them; a collective)."""
    everyone: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, errors)
    return {name: max(e[name] for e in everyone) for name in errors}


def passed(worst: dict[str, float], tolerance: float) -> bool:
    """Whether every check's error is within ``tolerance``."""
    return all(err <= tolerance for err in worst.values())


def print_errors(worst: dict[str, float], tolerance: float, width: int) -> bool:
    """One line a check, its name padded to ``width``: its error and whether it is within
    ``tolerance``; returns whether all are."""
    for name, err in worst.items():
        verdict = "ok" if err <= tolerance else "TOO LARGE"
        print(f"  {name:<{width}} max relative error {err:.2e} ({verdict}, tolerance {tolerance:.0e})")
    return passed(worst, tolerance)


def print_result(result: dict[str, object]) -> None:
    """The ``RESULT {json}`` line that scripts and tests read."""
    print("RESULT " + json.dumps(result))
