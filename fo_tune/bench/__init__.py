"""``fo-tune bench`` as a library call: every way to run GEMM + collective, checked, then timed.

    run_bench(BenchRequest(shapes=((4096, 8192, 4096),)), reporter)        # run.py
      checks that the shapes can run here (request.py), opens one worker pool and agrees on the
      ranks' fingerprint (fo_tune.ranks.launch), then per shape x collective one BenchCaseTask on every
      rank (task.py): each variant (variants.py: gemm, collective, sequential, chunked_c<C>, the
      collective's fused torch op async_tp or torch_fused, fo_tune) checked against a float32
      reference (operands.py), then all timed side by side
      the ranks merged into BenchRows (rows.py): chunked (the best C), ideal = max(gemm, collective)
      (not run), speedup_vs_sequential = sequential / variant, fraction_of_ideal = ideal / variant
    write_bench_dir(result, out)       # output.py: bench.csv, bench.yaml, bench.png, all at once

Collectives: all_reduce and reduce_scatter of ``a @ b``, and all_gather (``all_gather(a) @ b``, the
column-parallel direction): a shape is the GEMM's (M, N, K) for each, so an all_gather case's M
is the gathered M (each rank holds M/w rows of A). Shapes come from ``--shape`` or a suite file
(suite.py). On the CPU (gloo, Triton's interpreter) there is no second stream: the chunks run one
after the other (said in the detail column) and the numbers describe the CPU, not overlap. The
CLI is ``fo_tune.cli.bench``.
"""

from fo_tune.bench.output import (
    BENCH_FILES,
    BENCH_ROOT,
    check_bench_out,
    default_bench_dir,
    stopped_bench_dir,
    write_bench_dir,
)
from fo_tune.bench.request import (
    CHUNK_COUNTS,
    CPU_SHAPES,
    BenchRequest,
    BenchRequestError,
    check_runnable,
)
from fo_tune.bench.rows import (
    BENCH_COLUMNS,
    FUSED_VARIANT,
    STATUSES,
    VARIANTS,
    BenchResult,
    BenchRow,
    case_rows,
    case_variants,
)
from fo_tune.bench.run import run_bench
from fo_tune.bench.suite import Suite, SuiteError, SuiteNotFoundError, load_suite, packaged_suite
from fo_tune.bench.task import BenchCaseTask
from fo_tune.ranks.limits import CPU_MAX_MACS

__all__ = [
    "BENCH_COLUMNS",
    "BENCH_FILES",
    "BENCH_ROOT",
    "CHUNK_COUNTS",
    "CPU_MAX_MACS",
    "CPU_SHAPES",
    "FUSED_VARIANT",
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
    "case_variants",
    "check_bench_out",
    "check_runnable",
    "default_bench_dir",
    "load_suite",
    "packaged_suite",
    "run_bench",
    "stopped_bench_dir",
    "write_bench_dir",
]
