"""The calibration's plots: bandwidth curves per collective and CTA cap, and the interference heat
maps (matplotlib, Agg, no pyplot; imported only when a plot is drawn).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fo_tune.calibrate.calibration import (
    Calibration,
)
from fo_tune.output import figure, size_label


def _cap_label(cap: int) -> str:
    return "default" if cap == 0 else f"{cap} CTAs"


def plot_bandwidth(cal: Calibration, path: Path) -> None:
    from matplotlib.ticker import FuncFormatter

    collectives = list(dict.fromkeys(p.collective for p in cal.bandwidth))
    ncols = min(2, max(1, len(collectives)))
    nrows = max(1, math.ceil(len(collectives) / ncols))
    fig, axes = figure(nrows, ncols, 5.5, 3.8)
    fig.suptitle(f"bus bandwidth, {cal.world_size} ranks, {cal.fingerprint.device_key}")
    flat = [ax for row in axes for ax in row]
    for ax, collective in zip(flat, collectives, strict=False):
        points = [p for p in cal.bandwidth if p.collective == collective]
        for cap in sorted({p.nccl_max_ctas for p in points}):
            line = sorted((p for p in points if p.nccl_max_ctas == cap), key=lambda p: p.size_bytes)
            ax.plot(
                [p.size_bytes for p in line], [p.busbw_gbs for p in line], marker="o", label=_cap_label(cap)
            )
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(size_label))
        ax.tick_params(axis="x", labelrotation=45)
        ax.set_title(collective)
        ax.set_xlabel("message size")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(title="NCCL CTA cap", fontsize="small")
    for ax in flat[len(collectives) :]:
        ax.set_axis_off()
    if not collectives:
        flat[0].text(0.5, 0.5, "no bandwidth points", ha="center", va="center")
    fig.savefig(path, dpi=110)


def _heat(
    ax: Any, values: list[list[float]], notes: list[list[str]], rows: list[int], cols: list[int]
) -> Any:
    """One annotated heat map (rows = r, columns = cap); NaN cells stay blank. Returns the image."""
    import numpy as np

    data = np.ma.masked_invalid(np.array(values, dtype=float))
    finite = data.compressed()
    lo = float(min(1.0, finite.min())) if finite.size else 1.0
    hi = float(max(lo + 0.05, finite.max())) if finite.size else 2.0
    image = ax.imshow(data, cmap="OrRd", vmin=lo, vmax=hi, aspect="auto")
    ax.set_xticks(range(len(cols)), [_cap_label(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel("NCCL CTA cap")
    ax.set_ylabel("SMs left free (r)")
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            if not math.isnan(value):
                dark = (value - lo) / (hi - lo) > 0.6
                text = f"{value:.2f}x{notes[i][j]}"
                ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
    return image


def plot_interference(cal: Calibration, path: Path) -> None:
    groups = list(dict.fromkeys((p.collective, p.size_bytes) for p in cal.interference))
    fig, axes = figure(max(1, len(groups)), 2, 4.8, 3.4)
    concurrent = all(p.concurrent for p in cal.interference)
    how = "concurrent" if concurrent else "CPU: run one after the other, not concurrently"
    fig.suptitle(f"interference ({how}), {cal.world_size} ranks, {cal.fingerprint.device_key}")
    if not groups:
        for ax in axes[0]:
            ax.set_axis_off()
        axes[0][0].text(0.5, 0.5, "no interference measured", ha="center", va="center")
    for (collective, size), (comm_ax, gemm_ax) in zip(groups, axes, strict=False):
        points = [p for p in cal.interference if (p.collective, p.size_bytes) == (collective, size)]
        rows = sorted({p.sms_free for p in points})
        cols = sorted({p.nccl_max_ctas for p in points})
        comm = [[math.nan] * len(cols) for _ in rows]
        gemm = [[math.nan] * len(cols) for _ in rows]
        notes = [[""] * len(cols) for _ in rows]
        for p in points:
            i, j = rows.index(p.sms_free), cols.index(p.nccl_max_ctas)
            comm[i][j], gemm[i][j] = p.comm_slowdown, p.gemm_slowdown
            notes[i][j] = "\n(after GEMM)" if p.concurrent and not p.comm_during_gemm else ""
        image = _heat(comm_ax, comm, notes, rows, cols)
        fig.colorbar(image, ax=comm_ax, shrink=0.8)
        comm_ax.set_title(f"{collective} {size_label(size)}: collective slowdown", fontsize="medium")
        blank = [[""] * len(cols) for _ in rows]
        image = _heat(gemm_ax, gemm, blank, rows, cols)
        fig.colorbar(image, ax=gemm_ax, shrink=0.8)
        gemm_ax.set_title(f"{collective} {size_label(size)}: GEMM slowdown", fontsize="medium")
    fig.savefig(path, dpi=110)
