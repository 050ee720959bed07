"""Shipped fo-tune data, installed as ``fo_results``: schedule tables and calibrations.

Every file here comes from a real run and carries the hardware fingerprint it was measured on.
The runtime finds packaged tables through ``importlib.resources.files("fo_results") / "tables"``.
"""
