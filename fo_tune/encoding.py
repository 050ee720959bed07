"""The search's encoding: Optuna parameters <-> a ``Schedule`` for one shape.

Parameters (every one categorical unless said):

    tile           a tile config of the space, by its label ("128x256x64 gm8 w8 s3 ws")
    sms_free       SMs left to communication (grid = SMs - sms_free)
    nccl_max_ctas  the NCCL CTA cap (0: NCCL's default)
    signal         "band1", "wave2", ...: a signal unit is multiple x (a band of group_m tile rows of
                   every shard | a wave of the grid, rounded up to a multiple of the shards)
    layout         row_band | tile_major;  wait_mode: stream_wait | spin
    grouping       "dp": the cost model's optimal composition for this config (dynamic program);
                   "custom": num_groups (int 1..max_groups) and num_groups - 1 cut points
                   cut_0.. in [0, 1] (floats): the cuts are round(cut * units) clamped to
                   [1, units - 1], deduplicated.

"custom" reaches any composition of U units into at most max_groups groups with one trial (FlashOverlap
enumerates all 2^(W-1)); "dp" seeds each config with the model-optimal grouping. A configuration
that cannot run (a grid of no program, a row_band cut inside a band of tile rows, ...) raises
``Infeasible``, which the search turns into a pruned trial before anything runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from fo_kernels.errors import FoTuneError, ScheduleError
from fo_kernels.heuristics import split_decreasing
from fo_kernels.plan import cdiv, make_plan
from fo_kernels.schedule import Problem, Schedule, Tile

from .calibration import CalibrationError
from .space import SearchSpace

GROUPINGS = ("dp", "custom")
# Group counts the exhaustive enumeration tries besides "dp" (near-equal, larger first).
ENUMERATED_GROUP_COUNTS = (1, 2, 4)


class Infeasible(FoTuneError, ValueError):
    """A point of the space that cannot run for this shape (the message says why)."""


class GroupingModel(Protocol):
    def best_grouping(
        self, schedule: Schedule, m: int, n: int, k: int, *, max_groups: int
    ) -> tuple[int, ...]: ...


def schedule_key(schedule: Schedule) -> str:
    """What identifies a schedule's behaviour (everything but the provenance), as a JSON string."""
    data = schedule.to_dict()
    data.pop("provenance", None)
    return json.dumps(data, sort_keys=True)


@dataclass(frozen=True, slots=True)
class Encoding:
    """The candidate values for one (collective, dtype, world size, shape) on ``sm_count`` SMs."""

    collective: str
    dtype: str
    world_size: int
    m: int
    n: int
    k: int
    sm_count: int
    tiles: tuple[Tile, ...]
    sms_free: tuple[int, ...]
    caps: tuple[int, ...]
    signals: tuple[str, ...]
    layouts: tuple[str, ...]
    wait_modes: tuple[str, ...]
    max_groups: int
    groupings: tuple[str, ...] = GROUPINGS

    @classmethod
    def from_space(
        cls,
        space: SearchSpace,
        *,
        collective: str,
        dtype: str,
        world_size: int,
        shape: tuple[int, int, int],
        sm_count: int,
        cpu: bool,
        tiles: tuple[Tile, ...] | None = None,
        with_dp: bool = True,
    ) -> Encoding:
        m, n, k = shape
        signals = tuple(f"{kind}{mult}" for kind in space.signal.kinds for mult in space.signal.multiples)
        return cls(
            collective=collective,
            dtype=dtype,
            world_size=world_size,
            m=m,
            n=n,
            k=k,
            sm_count=sm_count,
            tiles=tuple(tiles if tiles is not None else space.tile_candidates(cpu=cpu)),
            sms_free=tuple(r for r in space.sms_free_candidates(cpu=cpu) if r < sm_count),
            caps=tuple(space.caps(cpu=cpu)),
            signals=signals,
            layouts=tuple(space.layouts),
            wait_modes=tuple(space.wait_modes),
            max_groups=space.grouping.max_groups,
            groupings=GROUPINGS if with_dp else ("custom",),
        )

    # ----------------------------------------------------------------------------- identity
    def fingerprint(self) -> dict[str, Any]:
        """The choices, for naming the study (a changed space gets a new study)."""
        return {
            "tiles": [t.label() for t in self.tiles],
            "sms_free": list(self.sms_free),
            "caps": list(self.caps),
            "signals": list(self.signals),
            "layouts": list(self.layouts),
            "wait_modes": list(self.wait_modes),
            "max_groups": self.max_groups,
            "groupings": list(self.groupings),
        }

    @property
    def shards(self) -> int:
        return self.world_size if self.collective == "reduce_scatter" else 1

    # ----------------------------------------------------------------------------- params
    def suggest(self, trial: Any) -> dict[str, Any]:
        """Ask ``trial`` (an ``optuna.Trial``) for a point; returns the params."""
        p: dict[str, Any] = {
            "tile": trial.suggest_categorical("tile", [t.label() for t in self.tiles]),
            "sms_free": trial.suggest_categorical("sms_free", list(self.sms_free)),
            "nccl_max_ctas": trial.suggest_categorical("nccl_max_ctas", list(self.caps)),
            "signal": trial.suggest_categorical("signal", list(self.signals)),
            "layout": trial.suggest_categorical("layout", list(self.layouts)),
            "wait_mode": trial.suggest_categorical("wait_mode", list(self.wait_modes)),
            "grouping": trial.suggest_categorical("grouping", list(self.groupings)),
        }
        if p["grouping"] == "custom":
            p["num_groups"] = trial.suggest_int("num_groups", 1, self.max_groups)
            for i in range(p["num_groups"] - 1):
                p[f"cut_{i}"] = trial.suggest_float(f"cut_{i}", 0.0, 1.0)
        return p

    def _tile(self, label: str) -> Tile:
        for t in self.tiles:
            if t.label() == label:
                return t
        raise Infeasible(f"tile {label!r} is not in the search space")

    def unit_tiles(self, tile: Tile, sms_free: int, signal: str) -> int:
        """Tiles per signal unit for this tile, grid and signal kind."""
        kind, mult = signal.rstrip("0123456789"), int(signal[len(signal.rstrip("0123456789")) :])
        s = self.shards
        rows = self.m // s
        tiles = s * cdiv(rows, tile.block_m) * cdiv(self.n, tile.block_n)
        if kind == "band":
            return s * tile.group_m * cdiv(self.n, tile.block_n) * mult
        grid = min(self.sm_count - sms_free, tiles)
        return cdiv(grid, s) * s * mult

    def build(self, params: Mapping[str, Any], model: GroupingModel | None) -> Schedule:
        """The schedule of ``params``; ``Infeasible`` when it cannot run on this shape."""
        tile = self._tile(str(params["tile"]))
        sms_free = int(params["sms_free"])
        if sms_free >= self.sm_count:
            raise Infeasible(f"sms_free {sms_free} leaves no SM of {self.sm_count} for the GEMM")
        unit = self.unit_tiles(tile, sms_free, str(params["signal"]))
        shards = self.shards
        tiles = shards * cdiv(self.m // shards, tile.block_m) * cdiv(self.n, tile.block_n)
        units = cdiv(tiles, unit)
        base = Schedule(
            collective=self.collective,
            dtype=self.dtype,
            world_size=self.world_size,
            problem=Problem(m=self.m, n=self.n, k=self.k),
            tile=tile,
            sms_free=sms_free,
            nccl_max_ctas=int(params["nccl_max_ctas"]),
            signal_tiles=unit,
            groups=(units,),
            layout=str(params["layout"]),
            wait_mode=str(params["wait_mode"]),
        )
        if params["grouping"] == "dp":
            if model is None:
                raise Infeasible("grouping 'dp' needs the cost model (a calibration)")
            try:
                groups = model.best_grouping(base, self.m, self.n, self.k, max_groups=self.max_groups)
            except CalibrationError as exc:  # measure mode: a tile the calibration did not profile
                raise Infeasible(f"grouping 'dp': {exc}") from None
        else:
            count = int(params.get("num_groups", 1))
            cuts = sorted(
                {min(units - 1, max(1, round(float(params[f"cut_{i}"]) * units))) for i in range(count - 1)}
            )
            cuts = [c for c in cuts if 0 < c < units]
            bounds = [0, *cuts, units]
            groups = tuple(b - a for a, b in itertools.pairwise(bounds))
        schedule = dataclasses.replace(base, groups=tuple(groups))
        try:
            make_plan(schedule, self.m, self.n, self.k, sm_count=self.sm_count)
        except ScheduleError as exc:
            raise Infeasible(str(exc)) from None
        return schedule

    def params_of(self, schedule: Schedule) -> dict[str, Any] | None:
        """Params that build ``schedule`` exactly (grouping "custom"), or None if the space cannot."""
        if not schedule.overlap or schedule.tile is None or schedule.tile not in self.tiles:
            return None
        if schedule.sms_free not in self.sms_free or schedule.nccl_max_ctas not in self.caps:
            return None
        if schedule.layout not in self.layouts or schedule.wait_mode not in self.wait_modes:
            return None
        signal = next(
            (
                s
                for s in self.signals
                if self.unit_tiles(schedule.tile, schedule.sms_free, s) == schedule.signal_tiles
            ),
            None,
        )
        if signal is None or "custom" not in self.groupings or len(schedule.groups) > self.max_groups:
            return None
        units = sum(schedule.groups)
        params: dict[str, Any] = {
            "tile": schedule.tile.label(),
            "sms_free": schedule.sms_free,
            "nccl_max_ctas": schedule.nccl_max_ctas,
            "signal": signal,
            "layout": schedule.layout,
            "wait_mode": schedule.wait_mode,
            "grouping": "custom",
            "num_groups": len(schedule.groups),
        }
        acc = 0
        for i, g in enumerate(schedule.groups[:-1]):
            acc += g
            params[f"cut_{i}"] = acc / units
        return params

    # ----------------------------------------------------------------------------- enumeration
    def enumerate(self) -> Iterator[dict[str, Any]]:
        """Every config with grouping "dp" (when offered) and near-equal splits into
        ``ENUMERATED_GROUP_COUNTS`` groups: the exhaustive search's points."""
        for tile, r, cap, signal, layout, wait in itertools.product(
            self.tiles, self.sms_free, self.caps, self.signals, self.layouts, self.wait_modes
        ):
            head = {
                "tile": tile.label(),
                "sms_free": r,
                "nccl_max_ctas": cap,
                "signal": signal,
                "layout": layout,
                "wait_mode": wait,
            }
            if "dp" in self.groupings:
                yield {**head, "grouping": "dp"}
            if "custom" not in self.groupings:
                continue
            unit = self.unit_tiles(tile, r, signal)
            shards = self.shards
            units = cdiv(shards * cdiv(self.m // shards, tile.block_m) * cdiv(self.n, tile.block_n), unit)
            seen: set[tuple[int, ...]] = set()
            for count in ENUMERATED_GROUP_COUNTS:
                groups = split_decreasing(units, min(count, self.max_groups))
                if groups in seen:
                    continue
                seen.add(groups)
                params = {**head, "grouping": "custom", "num_groups": len(groups)}
                acc = 0
                for i, g in enumerate(groups[:-1]):
                    acc += g
                    params[f"cut_{i}"] = acc / units
                yield params
