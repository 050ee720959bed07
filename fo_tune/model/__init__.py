"""The cost model: the predicted latency of any schedule on one machine, read from its calibration.

    model = fo_tune.engines.cost_model(load_calibration(path))   # every engine's term
    model.predict(schedule, m, n, k).total_ms      # the schedule's engine's term
    model.baseline(collective, m, n, k, dtype)      # GEMM then the collective: eager and fallback

Modules: ``core`` (the model, the baselines; it is handed each engine's term), ``profiles`` (the
calibration's measurements as functions), ``library`` (the library GEMM and its clock), ``types``
(what a prediction holds), ``check`` (predictions against measured rows and trials). The engines'
terms live with their engines (``fo_tune.engines.triton.model``, ``.gather``;
``fo_tune.engines.copy_engine.model``, and ``.fit`` for its free parameters). The all_gather terms
are unvalidated: no all_gather was measured on GPUs, so ``check`` has no all_gather row to report.
"""

from fo_tune.model.core import CostModel
from fo_tune.model.types import Baseline, Interference, Prediction, element_bytes

__all__ = ["Baseline", "CostModel", "Interference", "Prediction", "element_bytes"]
