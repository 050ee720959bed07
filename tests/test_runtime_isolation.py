"""The runtime never imports the tuner: ``fo_kernels`` works with the tuner's packages unimportable
(tests/test_imports.py checks the sources for tuner imports)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

BLOCKED = ("optuna", "typer", "rich", "pandas", "fo_tune")

SCRIPT = textwrap.dedent(
    """
    import sys
    import warnings

    BLOCKED = {blocked!r}

    class Blocker:
        '''Refuse the tuner's packages, as on a machine that installed only the runtime.'''

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked by test_runtime_isolation")
            return None

    sys.meta_path.insert(0, Blocker())
    for name in BLOCKED:
        try:
            __import__(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"the blocker let {{name}} through")

    import fo_kernels
    from fo_kernels import HeuristicScheduleWarning, Problem, Schedule, Tile, TritonSettings, lookup_schedule
    from fo_kernels.table import MISS_SOURCE

    tile = Tile(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)
    settings = TritonSettings(tile=tile, signal_tiles=1, groups=(1, 1), layout="tile_major", wait_mode="spin")
    built = Schedule(collective="all_reduce", dtype="float32", world_size=2,
                     problem=Problem(m=64, n=32, k=16), settings=settings)
    assert Schedule.from_dict(built.to_dict()) == built
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = lookup_schedule("reduce_scatter", 64, 32, 16, dtype="float32", world_size=2, device="cpu")
    assert found.collective == "reduce_scatter" and found.problem.m == 64
    assert found.provenance.get("source") == MISS_SOURCE and not found.overlap
    assert any(issubclass(w.category, HeuristicScheduleWarning) for w in caught)
    leaked = sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    print("runtime ok", fo_kernels.__version__)
    """
)


def test_runtime_imports_and_runs_without_the_tuner(tmp_path):
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        FO_TUNE_TABLE_DIR=str(tmp_path / "tables"),
        XDG_DATA_HOME=str(tmp_path / "xdg"),
    )
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(blocked=BLOCKED)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "runtime ok" in proc.stdout
