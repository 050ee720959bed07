"""The bench folder: bench.csv, bench.yaml and bench.png, written as a whole or not at all."""

from __future__ import annotations

import math
import os
from pathlib import Path

import yaml

from fo_tune.bench.rows import BENCH_COLUMNS, BenchResult
from fo_tune.output import check_writable, figure, replacing_folder, write_rows

BENCH_ROOT = Path("results/bench")
BENCH_FILES = ("bench.csv", "bench.yaml", "bench.png")
# Variants drawn in bench.png (speedup over sequential; gemm and collective alone are not overlap);
# a panel draws those of its collective that ran.
PLOTTED = ("sequential", "chunked", "async_tp", "torch_fused", "fo_tune", "ideal")
PLOT_COLORS = dict(sequential="tab:gray", chunked="tab:orange", async_tp="tab:green", torch_fused="tab:olive",
                   fo_tune="tab:blue", ideal="tab:purple")  # fmt: skip


def default_bench_dir(device_key: str, world_size: int) -> Path:
    """``results/bench/<device-key>/tp<N>`` (relative to the working directory)."""
    return BENCH_ROOT / device_key / f"tp{world_size}"


# The sibling folder a stopped bench keeps its finished cases in when --out holds a finished run.
STOPPED_SUFFIX = "-stopped"


def finished_bench_in(out_dir: str | Path) -> bool:
    """Whether ``out_dir`` holds a finished bench: a bench.yaml that reads, without
    ``settings.stopped`` (what a bench stopped by Ctrl-C or a failing rank writes)."""
    try:
        data = yaml.safe_load((Path(out_dir) / "bench.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    settings = data.get("settings") if isinstance(data, dict) else None
    return isinstance(settings, dict) and "stopped" not in settings


def stopped_bench_dir(out_dir: str | Path) -> Path:
    """Where a stopped bench keeps its finished cases: ``out_dir``, unless that holds a finished
    run, which a partial one never replaces: then its sibling ``<out_dir>-stopped``."""
    out = Path(out_dir)
    return out.with_name(out.name + STOPPED_SUFFIX) if finished_bench_in(out) else out


def check_bench_out(out_dir: str | Path) -> None:
    """Raise ``OutputError`` unless ``write_bench_dir`` can create or replace ``out_dir``: a new
    folder, or one holding only ``BENCH_FILES`` (``fo_tune.output.check_writable``'s rules)."""
    check_writable(out_dir, allowed=BENCH_FILES, what="bench", writer="fo-tune bench")


def _plot(result: BenchResult, path: Path) -> None:
    """Grouped bars of speedup over sequential, per shape and variant; one panel per collective."""
    collectives = list(dict.fromkeys(r.collective for r in result.rows)) or ["-"]
    fig, axes = figure(1, len(collectives), 6.0, 3.8)
    where = "NCCL" if result.backend == "nccl" else "gloo on the CPU (not overlap)"
    fig.suptitle(f"speedup over GEMM then collective: {result.fingerprint.device_key}, {where}")
    for ax, collective in zip(axes[0], collectives, strict=True):
        rows = [r for r in result.rows if r.collective == collective]
        shapes = list(dict.fromkeys(r.shape for r in rows))
        values = {
            variant: {r.shape: r.speedup_vs_sequential for r in rows if r.variant == variant}
            for variant in PLOTTED
        }
        # drawn: the variants with a number here (not async_tp beside all_reduce, nor one unavailable)
        drawn = [v for v in PLOTTED if any(not math.isnan(x) for x in values[v].values())]
        width = 0.8 / max(1, len(drawn))
        for i, variant in enumerate(drawn):
            bars = [
                (j + (i - (len(drawn) - 1) / 2) * width, values[variant][s])
                for j, s in enumerate(shapes)
                if not math.isnan(values[variant].get(s, math.nan))
            ]
            made = ax.bar(*zip(*bars, strict=True), width, label=variant, color=PLOT_COLORS[variant],
                          hatch="//" if variant == "ideal" else None)  # fmt: skip
            ax.bar_label(made, fmt="%.2f", fontsize=6, rotation=90, padding=2)
        for j, s in enumerate(shapes):
            if all(r.status == "SKIP" for r in rows if r.shape == s):
                ax.text(j, 0.5, "skipped", ha="center", va="bottom", rotation=90, fontsize="small")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlim(-0.5, len(shapes) - 0.5)
        ax.set_xticks(range(len(shapes)), shapes, rotation=30, ha="right", fontsize="small")
        ax.set_title(collective)
        ax.set_ylabel("sequential ms / variant ms")
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.15)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)


def write_bench_dir(result: BenchResult, out_dir: str | Path) -> list[Path]:
    """Write ``BENCH_FILES`` into ``out_dir``, replacing it as a whole (``write_calibration_dir``'s way:
    built in a temporary sibling, swapped in; on error nothing changes). Returns the paths written."""
    check_bench_out(out_dir)
    with replacing_folder(out_dir) as tmp:
        rows = [[getattr(r, c) for c in BENCH_COLUMNS] for r in result.rows]
        with (tmp / "bench.csv").open("w", newline="", encoding="utf-8") as f:
            write_rows(f, BENCH_COLUMNS, rows)
        with (tmp / "bench.yaml").open("w", encoding="utf-8") as f:
            yaml.safe_dump(result.to_dict(), f, sort_keys=False, width=120)
        _plot(result, tmp / "bench.png")
        for name in BENCH_FILES:
            os.chmod(tmp / name, 0o644)
    return [Path(out_dir) / name for name in BENCH_FILES]
