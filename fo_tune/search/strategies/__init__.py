"""The search's strategies, registered by exact name; each module is imported on first use.

- ``measure``: a TPE study over the union of engines, every trial checked then timed on the ranks;
- ``predict``: the cost model prices the enumerated space, bounded per engine (no ranks, no study);
  with ``--trials`` (or a space too large to enumerate) a TPE study of predictions instead;
- ``hybrid``: the model ranks the space, the ``--top-k`` best (and every engine's best) are timed;
- ``exhaustive``: every enumerated point, timed (measure) or priced (predict).

Every strategy has the signature of ``base.Strategy.run``.
"""

from __future__ import annotations

import functools

from fo_kernels.registry import Registry
from fo_tune.search.request import SearchError
from fo_tune.search.strategies.base import ShapeJob, Strategy

__all__ = ["STRATEGIES", "ShapeJob", "Strategy", "get_strategy", "strategy_names"]

# name -> "module:class", imported on first use (measure, hybrid and exhaustive import Optuna).
STRATEGIES = Registry(
    "strategy",
    {
        "measure": "fo_tune.search.strategies.measure:MeasureStrategy",
        "predict": "fo_tune.search.strategies.predict:PredictStrategy",
        "hybrid": "fo_tune.search.strategies.hybrid:HybridStrategy",
        "exhaustive": "fo_tune.search.strategies.exhaustive:ExhaustiveStrategy",
    },
    error=SearchError,
)


def strategy_names() -> tuple[str, ...]:
    """The search strategies' registered names."""
    return STRATEGIES.names()


@functools.cache
def get_strategy(name: str) -> Strategy:
    """The strategy registered as ``name``; an unknown name lists the valid ones."""
    return STRATEGIES.load(name)()
