"""The cost model: the predicted latency of any schedule on one machine, read from its calibration.

    model = CostModel(load_calibration(path))
    model.predict(schedule, m, n, k).total_ms      # the schedule's engine's term
    model.baseline(collective, m, n, k, dtype)      # GEMM then the collective: eager and fallback

Modules: ``core`` (the model, the baselines), ``profiles`` (the calibration's measurements as
functions), ``library`` (the library GEMM and its clock), ``triton`` and ``copy_engine`` (the
engines' terms; ``triton_gather``: the Triton engine's all_gather pipeline), ``check``
(predictions against measured rows and trials), ``fit`` (fitting the copy engine's free
parameters to measured rows). The all_gather terms are unvalidated: no all_gather was measured on
GPUs, so ``check`` has no all_gather row to report.
"""

from fo_tune.model.core import CostModel
from fo_tune.model.triton import num_units, with_groups
from fo_tune.model.types import Baseline, Interference, Prediction, element_bytes

__all__ = ["Baseline", "CostModel", "Interference", "Prediction", "element_bytes", "num_units", "with_groups"]
