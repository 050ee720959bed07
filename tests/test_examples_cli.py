"""The examples' command lines: ``--help`` describes each in a whole sentence, and ``--backend nccl``
on a machine with fewer GPUs than ranks is one usage error (exit 2) before the example imports its
client library (transformers, torchtitan) and before any rank starts (under torchrun: on each rank,
before it joins the group), not a traceback from every spawned rank. Fast: nothing here spawns a
rank. ``--help`` runs each script as a process (its ``sys.exit(main())`` included); the refusals call
``main`` in this process, where the exit status is argparse's ``SystemExit`` or ``main``'s return
(what ``sys.exit(main())`` exits with), so no process imports torch for them. ``launch.py`` is no
example: it is the module the examples share (how they start their ranks and report), which each
imports and says it needs beside it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_checks import load_example

FOLDER = Path(__file__).resolve().parents[1] / "examples"
SHARED = FOLDER / "launch.py"
EXAMPLES = sorted(p for p in FOLDER.glob("*.py") if p != SHARED)


def run(example: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(example), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def refusal(example: Path, args: list[str], env: dict[str, str] | None, monkeypatch, capsys) -> str:
    """``main(args)`` of ``example`` in this process with only ``env``'s torchrun variables set:
    its exit status must be 2, by ``SystemExit`` or ``main``'s return (any other exception, the
    traceback a process would print, fails the test); returns what it wrote on stderr."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    module = load_example(example, f"example_{example.stem}")
    try:
        code = module.main(args)
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    return err


def test_every_example_is_covered():
    assert {p.name for p in EXAMPLES} >= {
        "moe_block.py",
        "tp_block.py",
        "torchtitan_llama3.py",
        "transformers_tp_plan.py",
    }


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_imports_the_shared_launch_module_and_says_so(example):
    """A user copies an example: its docstring says to take launch.py with it, and launch.py's
    names every example that imports it."""
    tree = ast.parse(example.read_text())
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert "launch" in imported, example.name
    assert "``launch.py`` beside it" in ast.get_docstring(tree), example.name
    assert f"``{example.name}``" in ast.get_docstring(ast.parse(SHARED.read_text())), example.name


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_an_example_copied_without_launch_py_is_one_line_naming_it(example, tmp_path):
    """A user copies the example alone: one line on stderr names launch.py and where to copy it
    from, exit 2, before torch is imported (not a traceback ending in ModuleNotFoundError)."""
    copied = tmp_path / example.name
    copied.write_text(example.read_text())
    done = run(copied, "--help")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "needs launch.py beside it" in done.stderr and "examples/launch.py" in done.stderr, done.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_help_describes_the_example(example):
    done = run(example, "--help")
    assert done.returncode == 0, done.stderr
    description = done.stdout.split("\n\n")[1]
    assert description.rstrip().endswith("."), done.stdout  # a whole sentence, not a cut first line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
@pytest.mark.parametrize("torchrun", [False, True], ids=["spawn", "torchrun"])
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_nccl_without_gpus_is_one_usage_error(example, torchrun, monkeypatch, capsys):
    # torchrun's variables (rank 0 of 2): the example takes its torchrun branch
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"} if torchrun else None
    err = refusal(example, ["--backend", "nccl"], env, monkeypatch, capsys)
    last = err.strip().splitlines()[-1]
    assert "--backend nccl needs a GPU per rank" in last and "--backend gloo" in last, err


# (example, its arguments, the world size torchrun would give, what the one line says): world sizes
# the example cannot shard over, refused before any import of the client library or any rank;
# under torchrun the rank reads its world size from torchrun's variables, set here without
# starting torchrun
UNFIT_WORLDS = [
    ("torchtitan_llama3.py", ["--world-size", "3"], None, "--world-size 3: the tiny Llama-3's sequence"),
    ("torchtitan_llama3.py", [], "3", "torchrun's 3 ranks: the tiny Llama-3's sequence"),
    ("transformers_tp_plan.py", ["--world-size", "1"], None, "--world-size 1: transformers shards"),
    ("transformers_tp_plan.py", [], "1", "torchrun's 1 rank: transformers shards"),
]


@pytest.mark.parametrize(("name", "args", "torchrun_world", "says"), UNFIT_WORLDS)
def test_a_world_size_the_example_cannot_shard_over_is_one_usage_error(
    name, args, torchrun_world, says, monkeypatch, capsys
):
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": torchrun_world} if torchrun_world else None
    err = refusal(EXAMPLES[0].parent / name, [*args, "--backend", "gloo"], env, monkeypatch, capsys)
    assert says in err.strip().splitlines()[-1], err
