"""The tuner's expert-parallel MoE part: the model of one ``expert_parallel_ffn`` call, its search
space and the planner of MoE table rows (``fo-tune search -c moe``).

    alltoall.py   the All-to-All curve: the calibration's, or derived from another curve (``basis``)
    model.py      MoeCall, MoePrediction, MoeCostModel (the no-overlap path; each engine's term,
                  ``fo_tune.engines.<engine>.moe``, handed in by ``fo_tune.engines.moe_cost_model``)
    space.py      search_spaces/moe/*.yaml: M buckets and each engine's candidates
    plan.py       plan_moe (every point priced per experts' shape and M bucket), write_moe_rows
                  (the MoE table, ``fo_kernels.moe.table``, under the file lock)
    host.py       the MoE path's host times on one rank: MoeHostTask (``fo-tune calibrate --only
                  moe_host``) and measure_shape (``bench/moe_host.py``)

The runtime reads the table (``fo_kernels.moe.table``); it never imports this package.
"""
