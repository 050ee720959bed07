"""The tuner's side of the ``triton`` engine (the signalled persistent Triton GEMM and NCCL per
group): ``tuner`` (its plug-in: space section, points, Optuna parameters), ``model`` and ``gather``
(its cost-model terms: GEMM + AllReduce / ReduceScatter, and AllGather + GEMM), ``defaults`` (a
schedule without a search, for demos and first runs)."""

from fo_tune.engines.triton.tuner import TritonTuner

TUNER = TritonTuner

__all__ = ["TUNER", "TritonTuner"]
