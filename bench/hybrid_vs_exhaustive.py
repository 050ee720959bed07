"""Re-time, side by side in one run, the best schedule of an exhaustive search and of a hybrid one.

    python3 bench/hybrid_vs_exhaustive.py EXHAUSTIVE/summary.yaml HYBRID/summary.yaml --out DIR

Drift between measurements on H200 x2 is 2-4% (the sequential baseline of one shape moved 4% between
two searches a minute apart, docs/design.md#timing), more than the 2% the comparison asks for; so for
every shape both searches' best schedules and GEMM-then-collective are re-timed in interleaved
rounds on one pool of ranks (each checked against the float32 reference first), and the medians
over rounds compared. Writes DIR/hybrid_vs_exhaustive.csv; prints one line per shape.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fo_kernels.schedule import Schedule
from fo_kernels.table import upgrade_v1_row
from fo_tune.ranks.launch import FingerprintTask, open_pool
from fo_tune.ranks.timing import Timing
from fo_tune.ranks.trials import OverlapTrialTask, SequentialTask

ROUNDS = 7
# The ranks the schedules are timed on: the H200 x2 searches' world size.
WORLD = 2


def best_schedules(path: Path) -> dict[str, tuple[Schedule, int]]:
    data = yaml.safe_load(path.read_text())
    out = {}
    for shape in data["shapes"]:
        if shape["best_schedule"] is not None:
            out[shape["shape"]] = (
                Schedule.from_dict(upgrade_v1_row(shape["best_schedule"])),
                shape["measured_this_run"],
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] + f" Needs {WORLD} CUDA GPUs (the searches' world size)."
    )
    ap.add_argument("exhaustive", type=Path, help="summary.yaml of the exhaustive search (fo-tune search)")
    ap.add_argument("hybrid", type=Path, help="summary.yaml of the hybrid search")
    ap.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="folder to write hybrid_vs_exhaustive.csv into"
    )
    args = ap.parse_args(argv)
    bests = []
    for path in (args.exhaustive, args.hybrid):
        try:
            bests.append(best_schedules(path))
        except OSError as exc:
            ap.error(f"{path}: {exc.strerror}")
        except (yaml.YAMLError, KeyError, TypeError) as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            ap.error(f"{path}: not a search's summary.yaml ({type(exc).__name__}: {first})")
    exh, hyb = bests
    if not set(exh) & set(hyb):
        ap.error("the two summaries share no shape with a best schedule")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < WORLD:
        print(f"needs {WORLD} CUDA GPUs ({gpus} visible): the schedules are timed on them", file=sys.stderr)
        return 2
    rows = []
    with open_pool(WORLD) as pool:
        device_key = pool.run(FingerprintTask())[0].device_key
        for shape in sorted(set(exh) & set(hyb)):
            m, n, k = map(int, shape.split("x"))
            times: dict[str, list[float]] = {"exhaustive": [], "hybrid": [], "sequential": []}
            for r in range(ROUNDS):
                for name, (schedule, _) in (("exhaustive", exh[shape]), ("hybrid", hyb[shape])):
                    res = pool.run(OverlapTrialTask(schedule, m, n, k, seed=r))
                    if not all(x["ok"] for x in res):
                        raise SystemExit(f"{shape} {name}: the schedule failed its check")
                    times[name].append(Timing.max_over([x["timing"] for x in res]).median_ms)
                seq = pool.run(SequentialTask(exh[shape][0].collective, m, n, k, "bfloat16", seed=r))
                times["sequential"].append(Timing.max_over([x["sequential"] for x in seq]).median_ms)
            med = {name: statistics.median(v) for name, v in times.items()}
            rows.append(
                dict(
                    device_key=device_key,
                    shape=shape,
                    exhaustive_ms=med["exhaustive"],
                    hybrid_ms=med["hybrid"],
                    sequential_ms=med["sequential"],
                    hybrid_over_exhaustive=med["hybrid"] / med["exhaustive"],
                    exhaustive_measured=exh[shape][1],
                    hybrid_measured=hyb[shape][1],
                    same_schedule=exh[shape][0].to_dict() == hyb[shape][0].to_dict(),
                )
            )
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "hybrid_vs_exhaustive.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for r in rows:
        print(
            f"{r['shape']}: exhaustive best {r['exhaustive_ms']:.3f} ms "
            f"({r['exhaustive_measured']} measured), "
            f"hybrid best {r['hybrid_ms']:.3f} ms ({r['hybrid_measured']} measured), ratio "
            f"{r['hybrid_over_exhaustive']:.3f}, sequential {r['sequential_ms']:.3f} ms, "
            f"same schedule: {r['same_schedule']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
