"""The tuner's side of the ``copy_engine`` engine (library GEMM chunks, copy-engine pulls between
peers): ``tuner`` (its plug-in: space section, points, Optuna parameters), ``model`` (its cost-model
term), ``calibrate`` (its part of ``fo-tune calibrate``), ``fit`` (its free parameters fitted to
measured rows)."""

from fo_tune.engines.copy_engine.tuner import CopyEngineTuner

TUNER = CopyEngineTuner

__all__ = ["TUNER", "CopyEngineTuner"]
