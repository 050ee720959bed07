"""The rank processes every stage runs its measurements on, and what they measure.

Modules: ``launch`` (the process-group backend, the worker pool of a command, ``run_ranks``, the
fingerprint the ranks agree on), ``timing`` (back-to-back samples, medians, variants side by side),
``limits`` (how large a problem may be on its target, checked before any work), and the tasks the
pool runs on every rank: ``collectives`` (bandwidth sweeps, interference), ``gemm`` (tile profiles
and reduced grids beside cuBLAS), ``checks`` (a schedule against float64 before it is timed) and
``trials`` (the search's trials, baselines and confirmations). An engine's own tasks live with the
engine (``fo_tune.engines.copy_engine.probe``).
"""

# The default rounds of a confirmation (``trials.ConfirmTask``): each round times every variant
# once, in turn. ``fo-tune search --confirm-rounds`` takes fewer on the CPU, where one call of
# Triton's interpreter takes 0.1-0.2 s. (Here, not in ``trials``, so the CLI's option default
# names it without importing torch.)
CONFIRM_ROUNDS = 15
