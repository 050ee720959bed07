"""``fo-tune search`` as a library: one search per shape over the union of engines, the best
schedule as a table row.

    run_search(SearchRequest(shapes=((4096, 8192, 4096),), collective="all_reduce", mode="predict"))

Modules: ``request`` (the request and every check before anything runs), ``driver`` (the
search of each shape: engines, baseline, strategy, row), ``strategies`` (measure, predict, hybrid,
exhaustive: one signature), ``decide`` (the confirmation and the no-gain rule), ``pricing`` (the
model over an enumeration), ``study`` (Optuna studies), ``ranges`` (M-range rows), ``results``.
"""

from fo_tune.search.decide import CONFIRM_TOP, MIN_GAIN, decide
from fo_tune.search.driver import check_exhaustive_size, run_search
from fo_tune.search.ranges import plans_everywhere, range_rows
from fo_tune.search.request import (
    DEFAULT_TOP_K,
    DEFAULT_TRIALS,
    MODES,
    SearchError,
    SearchRequest,
    check_request,
    expand_shapes,
    m_values,
    select_engines,
)
from fo_tune.search.results import (
    BaselineResult,
    Candidate,
    SearchInterrupted,
    SearchResult,
    ShapeResult,
    TrialRecord,
    model_error,
)
from fo_tune.search.storage import default_storage_file

__all__ = [
    "CONFIRM_TOP",
    "DEFAULT_TOP_K",
    "DEFAULT_TRIALS",
    "MIN_GAIN",
    "MODES",
    "BaselineResult",
    "Candidate",
    "SearchError",
    "SearchInterrupted",
    "SearchRequest",
    "SearchResult",
    "ShapeResult",
    "TrialRecord",
    "check_exhaustive_size",
    "check_request",
    "decide",
    "default_storage_file",
    "expand_shapes",
    "m_values",
    "model_error",
    "plans_everywhere",
    "range_rows",
    "run_search",
    "select_engines",
]
