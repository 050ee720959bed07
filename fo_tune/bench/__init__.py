"""``fo-tune bench`` as a library call: every way to run GEMM + collective, checked, then timed.

    run_bench(BenchRequest(shapes=((4096, 8192, 4096),)), reporter)        # run.py
      checks that the shapes can run here (request.py), opens one worker pool and agrees on the
      ranks' fingerprint (fo_tune.launch), then per shape x collective one BenchCaseTask on every
      rank (task.py): each variant (variants.py: gemm, collective, sequential, chunked_c<C>,
      async_tp, fo_tune) checked against a float32 reference, then all timed side by side
      the ranks merged into BenchRows (rows.py): chunked (the best C), ideal = max(gemm, collective)
      (not run), speedup_vs_sequential = sequential / variant, fraction_of_ideal = ideal / variant
    write_bench_dir(result, out)       # output.py: bench.csv, bench.yaml, bench.png, all at once

Shapes come from ``--shape`` or a suite file (suite.py). On the CPU (gloo, Triton's interpreter)
there is no second stream: the chunks run one after the other (said in the detail column) and the
numbers describe the CPU, not overlap. The CLI is ``fo_tune.cli.bench``.
"""

from .output import BENCH_FILES, BENCH_ROOT, check_bench_out, default_bench_dir, write_bench_dir
from .request import (
    CHUNK_COUNTS,
    CPU_MAX_MACS,
    CPU_SHAPES,
    BenchRequest,
    BenchRequestError,
    check_runnable,
)
from .rows import BENCH_COLUMNS, STATUSES, VARIANTS, BenchResult, BenchRow, case_rows
from .run import run_bench
from .suite import Suite, SuiteError, SuiteNotFoundError, load_suite, packaged_suite
from .task import BenchCaseTask

__all__ = [
    "BENCH_COLUMNS",
    "BENCH_FILES",
    "BENCH_ROOT",
    "CHUNK_COUNTS",
    "CPU_MAX_MACS",
    "CPU_SHAPES",
    "STATUSES",
    "VARIANTS",
    "BenchCaseTask",
    "BenchRequest",
    "BenchRequestError",
    "BenchResult",
    "BenchRow",
    "Suite",
    "SuiteError",
    "SuiteNotFoundError",
    "case_rows",
    "check_bench_out",
    "check_runnable",
    "default_bench_dir",
    "load_suite",
    "packaged_suite",
    "run_bench",
    "write_bench_dir",
]
