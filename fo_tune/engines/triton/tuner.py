"""The Triton engine's plug-in: the signalled persistent Triton GEMM and one NCCL call per group.

Its section of a search space::

    engines:
      triton:
        sms_free: [0, 4, ...]        SMs left to communication (grid = SMs - r)
        nccl_max_ctas: [0, 8, ...]   NCCL CTA caps (0: NCCL's default)
        signal: {kinds: [band, wave], multiples: [1, 2]}
        grouping: {max_groups: 8}
        layouts: [row_band, tile_major]
        wait_modes: [stream_wait, spin]

(the tiles are the space's top-level ``tiles``). Parameters of one point, every one categorical
unless said:

    tile           a tile config of the space, by its label ("128x256x64 gm8 w8 s3 ws")
    sms_free, nccl_max_ctas, layout, wait_mode
    signal         "band1", "wave2", ...: a signal unit is multiple x (a band of group_m tile rows of
                   every shard | a wave of the grid, rounded up to a multiple of the shards)
    grouping       "dp": the cost model's optimal composition for this config (dynamic program);
                   "custom": num_groups (int 1..max_groups) and num_groups - 1 cut points
                   cut_0.. in [0, 1] (floats): the cuts are round(cut * units) clamped to
                   [1, units - 1], deduplicated.

"custom" reaches any composition of U units into at most max_groups groups with one trial
(FlashOverlap enumerates all 2^(W-1)); "dp" seeds each config with the model-optimal grouping. A
point that cannot run (a grid of no program, a row_band cut inside a band of tile rows, ...) is
``Infeasible`` before anything runs. It runs on any machine with world size >= 2 (NCCL or gloo).

all_gather (AllGather + GEMM) is offered only what its runtime path takes
(``TritonSettings.check``, ``fo_kernels.engines.triton.executor``): layout ``row_band`` (a group's A rows
are whole bands of every shard), signal units of ``band`` kind only (``multiples`` of a band of
every shard: a multiple of the world size; nothing is signalled, a unit only fixes where groups
may be cut, so the space's ``kinds`` do not apply), and no ``wait_mode`` parameter (the GEMM's
stream waits on each gather's event; the settings keep the field's default, ``ALL_GATHER_WAIT``).
The space's other lists (tiles, sms_free, nccl_max_ctas, multiples, grouping) apply as they are.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fo_kernels.engines.triton.settings import LAYOUTS, WAIT_MODES, TritonSettings
from fo_kernels.errors import ScheduleError
from fo_kernels.plan import cdiv, make_plan
from fo_kernels.schedule import EngineSettings
from fo_kernels.tile import Tile
from fo_tune.calibrate.calibration import CalibrationError
from fo_tune.engines.base import EngineTuner, Infeasible, ShapeTask
from fo_tune.engines.triton.defaults import default_schedule, split_decreasing
from fo_tune.space import Section, choices, integers, listed, sectioned

if TYPE_CHECKING:
    from fo_kernels.fingerprint import Fingerprint
    from fo_tune.calibrate.calibration import Calibration
    from fo_tune.model import CostModel
    from fo_tune.space import SpaceReader

SIGNAL_KINDS = ("band", "wave")  # a unit = multiple x (a band of group_m tile rows | a wave of the grid)
GROUPINGS = ("dp", "custom")
# Group counts the exhaustive enumeration tries besides "dp" (near-equal, larger first).
ENUMERATED_GROUP_COUNTS = (1, 2, 4)
# The collectives this engine's runtime overlaps (fo_kernels.engines.triton.executor).
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
# The command that measures a calibration's GEMM tile profile: one GPU's, whatever world size the
# calibration is for (an extrapolated one's too), merged into its file with --into.
CALIBRATE_GEMM = "fo-tune calibrate --world-size 1 --only gemm"
# What an all_gather schedule keeps in its unused wait_mode field: TritonSettings' default.
ALL_GATHER_WAIT: str = next(f.default for f in dataclasses.fields(TritonSettings) if f.name == "wait_mode")
# all_gather's only layout and signal kind (TritonSettings.check: whole bands of every shard).
ALL_GATHER_LAYOUTS = ("row_band",)
ALL_GATHER_SIGNAL_KIND = "band"


@dataclass(frozen=True, kw_only=True, slots=True)
class SignalSpace(Section):
    """Signal granularities: a unit is ``multiple`` x (a band of group_m tile rows | a grid wave)."""

    kinds: tuple[str, ...]
    multiples: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupingSpace(Section):
    """How the signal units may be grouped: at most ``max_groups`` groups per call."""

    max_groups: int


@dataclass(frozen=True, kw_only=True, slots=True)
class TritonSpace(Section):
    """The Triton engine's section of a search space (see the module docstring)."""

    sms_free: tuple[int, ...]
    nccl_max_ctas: tuple[int, ...]
    signal: SignalSpace
    grouping: GroupingSpace
    layouts: tuple[str, ...]
    wait_modes: tuple[str, ...]


_SPEC = {
    "sms_free": listed(integers(0)),
    "nccl_max_ctas": listed(integers(0)),
    "signal": sectioned(SignalSpace, {"kinds": choices(SIGNAL_KINDS), "multiples": listed(integers(1))}),
    "grouping": sectioned(GroupingSpace, {"max_groups": integers(1)}),
    "layouts": choices(LAYOUTS),
    "wait_modes": choices(WAIT_MODES),
}


@dataclass(frozen=True, slots=True)
class _Choices:
    """The candidate values of one shape (what ``TritonTuner`` methods work on)."""

    task: ShapeTask
    tiles: tuple[Tile, ...]
    sms_free: tuple[int, ...]
    caps: tuple[int, ...]
    signals: tuple[str, ...]
    layouts: tuple[str, ...]
    wait_modes: tuple[str, ...]
    max_groups: int
    groupings: tuple[str, ...]

    def tile(self, label: str) -> Tile:
        for t in self.tiles:
            if t.label() == label:
                return t
        raise Infeasible(f"tile {label!r} is not in the search space")

    def tiles_of(self, tile: Tile) -> int:
        t = self.task
        return t.shards * cdiv(t.m // t.shards, tile.block_m) * cdiv(t.n, tile.block_n)

    def unit_tiles(self, tile: Tile, sms_free: int, signal: str) -> int:
        """Tiles per signal unit for this tile, grid and signal kind."""
        kind, mult = signal.rstrip("0123456789"), int(signal[len(signal.rstrip("0123456789")) :])
        s = self.task.shards
        if kind == "band":
            return s * tile.group_m * cdiv(self.task.n, tile.block_n) * mult
        grid = min(self.task.sm_count - sms_free, self.tiles_of(tile))
        return cdiv(grid, s) * s * mult


class TritonTuner(EngineTuner):
    """The ``triton`` engine's plug-in (see the module docstring)."""

    name: ClassVar[str] = "triton"

    # ------------------------------------------------------------------------------ the space
    def read_space(self, reader: SpaceReader, node: Any, path: str) -> TritonSpace:
        return TritonSpace(**reader.section(node, path, _SPEC))

    def read_space_v1(self, reader: SpaceReader, data: Mapping[str, Any]) -> TritonSpace:
        return TritonSpace(**{key: read(reader, data[key], key) for key, read in _SPEC.items()})

    def v1_keys(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return tuple(_SPEC), ()

    # ------------------------------------------------------------------------------ feasibility
    def blocker(self, fingerprint: Fingerprint, collective: str, dtype: str) -> str:
        if collective not in COLLECTIVES:
            return f"does not overlap {collective} (it runs {', '.join(COLLECTIVES)})"
        if fingerprint.world_size < 2:
            return "overlaps a collective between ranks; world size 1 has none (overlap: false runs there)"
        return ""

    def calibration_gap(self, cal: Calibration, collective: str) -> str:
        from fo_tune.calibrate.missing import missing_curves

        gap = missing_curves(cal, [collective])
        if gap:
            return f"needs the calibration's bandwidth curve of {collective}: {gap}"
        if not any(p.status == "ok" for p in cal.gemm):
            from fo_tune.calibrate.missing import measure_into

            how = measure_into(cal, CALIBRATE_GEMM, "one GPU")
            return f"needs the calibration's GEMM tile profile (section gemm); {how}"
        return ""

    # ------------------------------------------------------------------------------ the encoding
    def _choices(self, task: ShapeTask) -> _Choices:
        if self.name not in task.memo:
            task.memo[self.name] = self._make_choices(task)
        return task.memo[self.name]

    def _make_choices(self, task: ShapeTask) -> _Choices:
        section: TritonSpace | None = task.space.engine(self.name)
        if section is None:
            raise Infeasible("the search space has no engines.triton section")
        tiles = tuple(task.space.tile_candidates(dtype=task.dtype, cpu=task.cpu))
        if task.predictable:
            assert task.model is not None
            tiles = tuple(t for t in tiles if task.model.knows_tile(t))
        gather = task.collective == "all_gather"
        kinds = (ALL_GATHER_SIGNAL_KIND,) if gather else section.signal.kinds
        signals = tuple(f"{k}{m}" for k in kinds for m in section.signal.multiples)
        return _Choices(
            task=task,
            tiles=tiles,
            sms_free=tuple(r for r in task.space.sms_free_candidates(cpu=task.cpu) if r < task.sm_count),
            caps=tuple(task.space.caps(cpu=task.cpu)),
            signals=signals,
            layouts=ALL_GATHER_LAYOUTS if gather else section.layouts,
            wait_modes=() if gather else section.wait_modes,  # (): not a parameter
            max_groups=section.grouping.max_groups,
            groupings=GROUPINGS if task.model is not None else ("custom",),
        )

    def choices(self, task: ShapeTask) -> dict[str, list[Any]]:
        c = self._choices(task)
        out = {
            "tile": [t.label() for t in c.tiles],
            "sms_free": list(c.sms_free),
            "nccl_max_ctas": list(c.caps),
            "signal": list(c.signals),
            "layout": list(c.layouts),
            "wait_mode": list(c.wait_modes),
            "grouping": list(c.groupings),
            "max_groups": [c.max_groups],
        }
        if not c.wait_modes:
            del out["wait_mode"]
        return out

    def suggest(self, trial: Any, task: ShapeTask) -> dict[str, Any]:
        c = self._choices(task)
        if not c.tiles or not c.sms_free:
            raise Infeasible("the search space offers no tile or grid the search can use")
        p: dict[str, Any] = {
            "tile": trial.suggest_categorical("tile", [t.label() for t in c.tiles]),
            "sms_free": trial.suggest_categorical("sms_free", list(c.sms_free)),
            "nccl_max_ctas": trial.suggest_categorical("nccl_max_ctas", list(c.caps)),
            "signal": trial.suggest_categorical("signal", list(c.signals)),
            "layout": trial.suggest_categorical("layout", list(c.layouts)),
        }
        if c.wait_modes:
            p["wait_mode"] = trial.suggest_categorical("wait_mode", list(c.wait_modes))
        p["grouping"] = trial.suggest_categorical("grouping", list(c.groupings))
        if p["grouping"] == "custom":
            p["num_groups"] = trial.suggest_int("num_groups", 1, c.max_groups)
            for i in range(p["num_groups"] - 1):
                p[f"cut_{i}"] = trial.suggest_float(f"cut_{i}", 0.0, 1.0)
        return p

    def build(self, params: Mapping[str, Any], task: ShapeTask) -> EngineSettings:
        c = self._choices(task)
        tile = c.tile(str(params["tile"]))
        sms_free = int(params["sms_free"])
        if sms_free >= task.sm_count:
            raise Infeasible(f"sms_free {sms_free} leaves no SM of {task.sm_count} for the GEMM")
        for name, offered in (("signal", c.signals), ("layout", c.layouts), ("wait_mode", c.wait_modes)):
            value = params.get(name)
            if (value is not None or offered) and value not in offered:
                raise Infeasible(
                    f"{name} {value!r} is not offered for {task.collective} (offered: {list(offered)})"
                )
        unit = c.unit_tiles(tile, sms_free, str(params["signal"]))
        units = cdiv(c.tiles_of(tile), unit)
        base = TritonSettings(
            tile=tile,
            sms_free=sms_free,
            nccl_max_ctas=int(params["nccl_max_ctas"]),
            signal_tiles=unit,
            groups=(units,),
            layout=str(params["layout"]),
            wait_mode=str(params.get("wait_mode", ALL_GATHER_WAIT)),
        )
        if params["grouping"] == "dp":
            if task.model is None:
                raise Infeasible("grouping 'dp' needs the cost model (a calibration)")
            try:
                groups = task.model.term("triton").best_grouping(
                    task.schedule(base), task.m, task.n, task.k, max_groups=c.max_groups
                )
            except CalibrationError as exc:  # measure mode: a tile the calibration did not profile
                raise Infeasible(f"grouping 'dp': {exc}") from None
        else:
            count = int(params.get("num_groups", 1))
            cuts = sorted(
                {min(units - 1, max(1, round(float(params[f"cut_{i}"]) * units))) for i in range(count - 1)}
            )
            bounds = [0, *(x for x in cuts if 0 < x < units), units]
            groups = tuple(b - a for a, b in itertools.pairwise(bounds))
        settings = dataclasses.replace(base, groups=tuple(groups))
        try:
            make_plan(task.schedule(settings), task.m, task.n, task.k, sm_count=task.sm_count)
        except ScheduleError as exc:
            raise Infeasible(str(exc)) from None
        return settings

    def params_of(self, settings: EngineSettings, task: ShapeTask) -> dict[str, Any] | None:
        if not isinstance(settings, TritonSettings):
            return None
        c = self._choices(task)
        st = settings
        if st.tile not in c.tiles or st.sms_free not in c.sms_free or st.nccl_max_ctas not in c.caps:
            return None
        if st.layout not in c.layouts or st.wait_mode not in (c.wait_modes or (ALL_GATHER_WAIT,)):
            return None
        signal = next(
            (s for s in c.signals if c.unit_tiles(st.tile, st.sms_free, s) == st.signal_tiles), None
        )
        if signal is None or "custom" not in c.groupings or len(st.groups) > c.max_groups:
            return None
        wait = st.wait_mode if c.wait_modes else None
        params = self._head(st.tile, st.sms_free, st.nccl_max_ctas, signal, st.layout, wait)
        return params | _custom(st.groups)

    @staticmethod
    def _head(tile: Tile, r: int, cap: int, signal: str, layout: str, wait: str | None) -> dict[str, Any]:
        """A point's parameters but the grouping (``wait`` None: no wait_mode parameter)."""
        head = {"tile": tile.label(), "sms_free": r, "nccl_max_ctas": cap, "signal": signal, "layout": layout}
        return head if wait is None else head | {"wait_mode": wait}

    def points(self, task: ShapeTask, *, exhaustive: bool) -> Iterator[dict[str, Any]]:
        """Every config with grouping "dp" (when offered); ``exhaustive`` (or without a model)
        also near-equal splits into ``ENUMERATED_GROUP_COUNTS`` groups. Without ``exhaustive`` a
        model's enumeration leaves out the spin wait where stream_wait is offered: the model
        prices the spin wait's extra host time only, so it never predicts it faster."""
        c = self._choices(task)
        waits: tuple[str | None, ...] = c.wait_modes or (None,)
        if not exhaustive and task.model is not None and "stream_wait" in waits:
            waits = ("stream_wait",)  # the model prices spin's extra host time only: it never wins
        for tile, r, cap, signal, layout, wait in itertools.product(
            c.tiles, c.sms_free, c.caps, c.signals, c.layouts, waits
        ):
            head = self._head(tile, r, cap, signal, layout, wait)
            if "dp" in c.groupings:
                yield {**head, "grouping": "dp"}
            if "custom" not in c.groupings or (not exhaustive and "dp" in c.groupings):
                continue
            units = cdiv(c.tiles_of(tile), c.unit_tiles(tile, r, signal))
            seen: set[tuple[int, ...]] = set()
            for count in ENUMERATED_GROUP_COUNTS:
                groups = split_decreasing(units, min(count, c.max_groups))
                if groups not in seen:
                    seen.add(groups)
                    yield head | _custom(groups)

    def seeds(self, task: ShapeTask) -> list[dict[str, Any]]:
        """The heuristic default (``fo_tune.engines.triton.defaults.default_schedule``, its sms_free snapped
        to the nearest candidate) and the same config with the DP grouping."""
        c = self._choices(task)
        heuristic = default_schedule(
            task.collective,
            task.m,
            task.n,
            task.k,
            dtype=task.dtype,
            world_size=task.world_size,
            sm_count=task.sm_count,
            on_gpu=not task.cpu,
        )
        st = heuristic.settings
        if not isinstance(st, TritonSettings) or not c.sms_free:
            return []
        if st.sms_free not in c.sms_free:  # the heuristic's wave-aligned sms_free is rarely a candidate
            st = dataclasses.replace(st, sms_free=min(c.sms_free, key=lambda r: (abs(r - st.sms_free), r)))
        if task.predictable and st.tile not in c.tiles and c.tiles:
            st = dataclasses.replace(st, tile=c.tiles[0])
        try:
            params = self.params_of(st, task)
        except ScheduleError:
            return []
        if params is None:
            return []
        seeds = [params]
        if "dp" in c.groupings:
            seeds.append(
                {key: v for key, v in params.items() if not key.startswith(("cut_", "num_groups"))}
                | {"grouping": "dp"}
            )
        return seeds

    def lower_bound(self, params: Mapping[str, Any], task: ShapeTask) -> float:
        assert task.model is not None
        c = self._choices(task)
        tile = c.tile(str(params["tile"]))
        r = int(params["sms_free"])
        return task.model.term(self.name).lower_bound(
            task,
            tile,
            r,
            int(params["nccl_max_ctas"]),
            c.unit_tiles(tile, r, str(params["signal"])),
            str(params["layout"]),
            str(params.get("wait_mode", ALL_GATHER_WAIT)),
        )

    # ------------------------------------------------------------------------------ the model
    def term(self, model: CostModel) -> Any:
        from fo_tune.engines.triton.gather import TritonCollectivesTerm

        section = model.cal.triton
        return TritonCollectivesTerm(model, section.values() if section is not None else None)


def _custom(groups: tuple[int, ...]) -> dict[str, Any]:
    """The "custom" grouping parameters of ``groups``."""
    units = sum(groups)
    out: dict[str, Any] = {"grouping": "custom", "num_groups": len(groups)}
    acc = 0
    for i, g in enumerate(groups[:-1]):
        acc += g
        out[f"cut_{i}"] = acc / units
    return out


__all__ = ["GroupingSpace", "SignalSpace", "TritonSpace", "TritonTuner"]
