"""How much of the bench's fo-tune time is the way samples are taken? (2 GPUs)

    python3 bench/timing_probe.py --out DIR [--shape MxNxK ...] [--collective C] [--rounds N]

At 2048x4096x4096 AllReduce, run 58's bench read 0.172 ms for fo-tune while the host probe's plain
40-call loop read 0.151 ms in the same session (``docs/perf-notes.md``, run 58); sequential read
0.174 and 0.170. A bench sample is ~15 back-to-back calls that start on an idle GPU (the first
call's host time is inside it) and on ranks that did not start together (a rank's first call can
wait for a peer still finishing its previous sample). This probe runs the bench's own rank task
(``fo_tune.bench.BenchCaseTask``: every variant, checked, then timed side by side) per case once
per sampling mode, in one process, the modes' order reversed every other case:

- ``plain``: the bench as it was before run 60 (``MIN_SAMPLE_MS`` samples, ranks not aligned, no
  lead);
- ``aligned``: the ranks start every sample together (``time_interleaved(align=True)``);
- ``aligned_lead``: aligned, and each sample's first call queued behind an untimed spin of
  ``LEAD_MS`` (the GPU does not idle while the host issues it);
- ``long``: samples of ``LONG_SAMPLE_MS`` (more calls per sample; ``MAX_INNER`` caps them).

Then, in the same process, the host probe's issue / GPU / loop times of fo-tune and sequential
(``bench/host_probe.py``'s ``HostTask``, its results checked): is the bench process's host slower
than a fresh one's?
Writes DIR/timing.csv (every variant's median per rank and mode) and DIR/host.csv; prints one line
per case and mode, and the AllReduce and ReduceScatter geomeans of fo-tune over sequential per
mode last.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from host_probe import HostTask
from probe_common import Progress, append_rows, case_options, cases

from fo_tune.bench import BenchCaseTask
from fo_tune.harness import open_pool

# The lead: more than a fo-tune call's host time in a fresh process (68-89 us, run 58).
LEAD_MS = 0.2
# Long samples: 4x the bench's (at 2048x4096x4096, ~60 calls instead of ~15).
LONG_SAMPLE_MS = 16.0
MODES = {
    "plain": {},
    "aligned": {"align": True},
    "aligned_lead": {"align": True, "lead_ms": LEAD_MS},
    "long": {"min_sample_ms": LONG_SAMPLE_MS},
}
HOST_CALLS = 40


def main() -> None:
    ap = case_options(__doc__.splitlines()[0], rounds=20)
    args = ap.parse_args()
    shapes, collectives = cases(args)
    progress = Progress()
    ratios: dict[tuple[str, str], list[float]] = {}
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        case_no = 0
        for m, n, k in shapes:
            for coll in collectives:
                modes = list(MODES) if case_no % 2 == 0 else list(MODES)[::-1]
                case_no += 1
                for mode in modes:
                    task = BenchCaseTask(coll, m, n, k, "bfloat16", reps=args.rounds, **MODES[mode])
                    per_rank = pool.run(task, timeout_s=300)
                    rows, med = [], {}
                    for rank, entries in enumerate(per_rank):
                        for e in entries:
                            t = e.get("timing")
                            if t is None:
                                continue
                            med[e["variant"]] = max(med.get(e["variant"], 0.0), t.median_ms)
                            rows.append(dict(m=m, n=n, k=k, collective=coll, mode=mode, rank=rank,
                                             variant=e["variant"], status=e["status"],
                                             rel_err=e["rel_err"], median_ms=t.median_ms,
                                             iqr_ms=t.iqr_ms, samples=t.samples))  # fmt: skip
                    append_rows(args.out / "timing.csv", rows)
                    fo, seq = med.get("fo_tune", math.nan), med.get("sequential", math.nan)
                    ratios.setdefault((coll, mode), []).append(seq / fo)
                    progress.line(
                        f"{m}x{n}x{k} {coll} {mode}: fo_tune {fo:.4f} seq {seq:.4f} ms = {seq / fo:.3f}x"
                        f" (gemm {med.get('gemm', math.nan):.4f}, coll {med.get('collective', math.nan):.4f})"
                    )
                per_rank = pool.run(HostTask(m, n, k, coll, HOST_CALLS, profile=False), timeout_s=300)
                rows = [dict(m=m, n=n, k=k, collective=coll, rank=r, variant=name, **v)
                        for r, res in enumerate(per_rank) for name, v in res.items()]  # fmt: skip
                append_rows(args.out / "host.csv", rows)
                parts = [
                    f"r{x['rank']} {x['variant']} issue {x['issue_us']:.0f} gpu {x['gpu_us']:.0f} "
                    f"loop {x['loop_us']:.0f} us"
                    for x in rows
                ]
                progress.line(f"{m}x{n}x{k} {coll} host in the bench process: " + ", ".join(parts))
    for (coll, mode), rs in sorted(ratios.items()):
        geo = math.exp(sum(math.log(r) for r in rs) / len(rs))
        each = " ".join(f"{r:.2f}" for r in rs)
        progress.keep(f"{coll} {mode}: geomean {geo:.3f} over {len(rs)} shapes: {each}")
    progress.summary()


if __name__ == "__main__":
    main()
