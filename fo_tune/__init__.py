"""fo_tune: the tuner of fo-tune (calibrate -> model -> search -> tables), its demo and its CLI commands.

Import the submodule you need (``fo_tune.bench.demo``, ``fo_tune.ranks.launch``, ...); this package imports
nothing heavy itself. The runtime it tunes, ``fo_kernels``, never imports it.
"""
