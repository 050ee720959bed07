"""Shipped fo-tune data, installed as ``fo_results``: schedule tables and calibrations.

Every file here comes from a real run and carries the hardware fingerprint it was measured on.
The runtime finds packaged tables through ``importlib.resources.files("fo_results") / "tables"``.
Beside them (in the repository, not in the installed package): the search reports behind the
tables and the benches the README cites, which ``bench/tune.sh`` and ``bench/bench.sh`` re-run.
"""
