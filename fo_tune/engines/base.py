"""The tuner side of an engine: what the search, the space, the model and the calibration ask it.

An ``EngineTuner`` is stateless and registered by the exact name its runtime settings carry
(``fo_kernels.engines.ENGINES``; ``fo_tune.engines.get_tuner``). Call order:

1. ``read_space`` (``read_space_v1`` for a schema-1 file) when a search space file is loaded: the
   engine's section of ``engines:``, validated, errors naming the key;
2. per search: ``blocker(fingerprint, collective, dtype)``, why the engine cannot run on that
   machine ("" when it can: world size, peer access from the fingerprint's interconnect), and,
   when the search predicts, ``calibration_gap(calibration, collective)``, what its cost-model
   term misses ("" when nothing: the section and the command that measures it otherwise);
3. per shape, on a ``ShapeTask``: ``choices`` (the study's digest), ``points`` (the enumeration),
   ``seeds`` (a new study's warm start), ``suggest`` then ``build`` per Optuna trial, ``params_of``
   (a schedule to the parameters that build it);
4. ``term(model)`` once per cost model, then ``term.predict(schedule, m, n, k)`` per prediction.

Parameters are plain mappings of the engine's own names; the union encoding
(``fo_tune.search.encoding``) prefixes them with the engine's name in the Optuna study, under the
``engine`` choice, so two engines never share a parameter. ``overlap: false`` is no engine: it is
the baseline every engine is judged against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from fo_kernels.errors import FoTuneError
from fo_kernels.schedule import SHARDED_COLLECTIVES, EngineSettings, Problem, Schedule, settings_type

if TYPE_CHECKING:
    from fo_kernels.fingerprint import Fingerprint
    from fo_tune.calibrate.calibration import Calibration
    from fo_tune.model import CostModel
    from fo_tune.space import SearchSpace, SpaceReader


class Infeasible(FoTuneError, ValueError):
    """A point of the space that cannot run for this shape (the message says why)."""


class UnknownEngineError(FoTuneError, ValueError):
    """An engine name that no plug-in is registered under; the message lists the valid ones."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapeTask:
    """One (collective, dtype, world size, M, N, K) to search, and what searching it may use (M,
    N, K are the GEMM's: for all_gather M is the gathered M, w x a shard's rows).

    ``model`` is the cost model (None in a measured search without a calibration of these ranks);
    ``predictable``: every point must be priced by the model (predict and hybrid searches), so an
    engine offers only what its term can predict."""

    collective: str
    dtype: str
    world_size: int
    m: int
    n: int
    k: int
    sm_count: int
    cpu: bool
    space: SearchSpace
    model: CostModel | None = None
    predictable: bool = False
    # What engines derive from the task once per shape (their candidate values), by key.
    memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.m, self.n, self.k)

    @property
    def shards(self) -> int:
        """Shards of the GEMM's M (world size for reduce_scatter, whose output rows are scattered,
        and all_gather, whose A rows are gathered; else 1)."""
        return self.world_size if self.collective in SHARDED_COLLECTIVES else 1

    def schedule(
        self, settings: EngineSettings | None, provenance: Mapping[str, Any] | None = None
    ) -> Schedule:
        """The exact-shape schedule of ``settings`` (None: overlap: false)."""
        return Schedule(
            collective=self.collective,
            dtype=self.dtype,
            world_size=self.world_size,
            problem=Problem(m=self.m, n=self.n, k=self.k),
            settings=settings,
            provenance=dict(provenance or {}),
        )


class EngineTuner(ABC):
    """An engine's plug-in (see the module docstring for the call order)."""

    name: ClassVar[str]

    @property
    def settings_type(self) -> type[EngineSettings]:
        """The runtime's settings of this engine (``fo_kernels.schedule.settings_type``)."""
        return settings_type(self.name)

    # ------------------------------------------------------------------------------ the space
    @abstractmethod
    def read_space(self, reader: SpaceReader, node: Any, path: str) -> Any:
        """The engine's section of a schema-2 space (a dataclass with ``to_dict``)."""

    @abstractmethod
    def read_space_v1(self, reader: SpaceReader, data: Mapping[str, Any]) -> Any | None:
        """The section from a schema-1 file's top-level keys (None: the file has none)."""

    @abstractmethod
    def v1_keys(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(required, optional) top-level keys this engine had in schema 1."""

    # ------------------------------------------------------------------------------ feasibility
    @abstractmethod
    def blocker(self, fingerprint: Fingerprint, collective: str, dtype: str) -> str:
        """Why the engine cannot run ``collective`` on that machine, as a phrase after "engine
        NAME" ("" when it can)."""

    @abstractmethod
    def calibration_gap(self, cal: Calibration, collective: str) -> str:
        """What the engine's term needs that ``cal`` lacks, with the command that measures it
        ("" when nothing)."""

    # ------------------------------------------------------------------------------ the encoding
    @abstractmethod
    def choices(self, task: ShapeTask) -> dict[str, list[Any]]:
        """Every parameter's candidate values for this shape (names the study: a changed space
        is a new study)."""

    @abstractmethod
    def suggest(self, trial: Any, task: ShapeTask) -> dict[str, Any]:
        """Ask ``trial`` (an Optuna trial whose names the caller prefixes) for a point."""

    @abstractmethod
    def build(self, params: Mapping[str, Any], task: ShapeTask) -> EngineSettings:
        """The settings of ``params``; ``Infeasible`` when they cannot run this shape."""

    @abstractmethod
    def params_of(self, settings: EngineSettings, task: ShapeTask) -> dict[str, Any] | None:
        """Parameters that build ``settings`` exactly, or None when the space cannot."""

    @abstractmethod
    def points(self, task: ShapeTask, *, exhaustive: bool) -> Iterator[dict[str, Any]]:
        """The enumeration: the points a predict search prices (``exhaustive``: every point an
        exhaustive search visits, groupings included)."""

    def probe_task(self) -> Any | None:
        """A task (``fo_tune.ranks.pool.Task``) every rank of a measured search runs once: why the runtime
        there cannot run the engine ("" when it can; None: nothing to probe beyond ``blocker``)."""
        return None

    def seeds(self, task: ShapeTask) -> list[dict[str, Any]]:
        """Points a new study runs first (warm start); none by default."""
        return []

    def lower_bound(self, params: Mapping[str, Any], task: ShapeTask) -> float:
        """A time the model predicts no less than for ``params`` (ms; 0: no bound known). The
        predict search skips points whose bound is not below its best so far."""
        return 0.0

    # ------------------------------------------------------------------------------ the model
    @abstractmethod
    def term(self, model: CostModel) -> Any:
        """The engine's cost-model term over ``model`` (its ``predict(schedule, m, n, k)``)."""
