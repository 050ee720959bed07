"""The copy engine's plug-in: library GEMM chunks and copy-engine pulls between peers, no NCCL.

Its section of a search space, one subsection per mode of the runtime (``fo_kernels.schedule
.COPY_ENGINE_MODES``), each optional::

    engines:
      copy_engine:
        ring:                      cuBLAS chunks around the ring of peers
          chunks: [1, 2, 3, 4, 6]  equal chunks per shard
          weights: [[2, 1], ...]   other chunk weightings (optional; e.g. a light last chunk)
        tiled:                     one persistent Triton GEMM per phase (world size 2, 16-bit inputs)
          chunks: [1, 2]
          tiles: [{block_m: 128, ...}, ...]

Parameters of one point: ``mode``, then ``ring.weights`` or ``tiled.weights`` and ``tiled.tile``
(labels: ``1-1-1-1``, ``Tile.label``). The space is small (a few dozen points at most), so every
point is enumerated, and a new measured study runs all of them first. The engine needs world size
>= 2 and peer access between the GPUs (the fingerprint's interconnect: NVLink or PCIe P2P).

all_gather (AllGather + GEMM) runs in the ring mode only (the runtime's tiled mode refuses it,
``CopyEngineSettings.check``): its points are the ring's weightings, each cutting every peer's
shard into the chunks that are pulled and multiplied one by one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fo_kernels.engines.copy_engine.settings import MAX_CHUNKS, CopyEngineSettings
from fo_kernels.plan import cdiv
from fo_kernels.schedule import EngineSettings
from fo_kernels.tile import Tile
from fo_tune.engines.base import EngineTuner, Infeasible, ShapeTask
from fo_tune.space import Section, listed, plain

if TYPE_CHECKING:
    from fo_kernels.fingerprint import Fingerprint
    from fo_tune.calibrate.calibration import Calibration
    from fo_tune.model import CostModel
    from fo_tune.space import SpaceReader

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
# The modes that run each collective (fo_kernels.engines.copy_engine.modes: TiledMode.blocker).
TILED_COLLECTIVES = ("all_reduce", "reduce_scatter")
# Interconnects (fo_kernels.fingerprint.interconnect_summary) whose GPUs read each other's memory.
PEER_INTERCONNECTS = ("nvlink", "p2p")
# The tiled mode's protocol connects exactly two peers (fo_kernels.engines.copy_engine).
TILED_WORLD = 2
# The command that measures the copy engine's calibration section (two GPUs: peer copies and
# flags; the library GEMM and the clock need one GPU, `--world-size 1`).
CALIBRATE = "fo-tune calibrate --world-size 2 --only copy_engine"


# What the copy engine's calibration section holds, for the refusal of a calibration without one.
SECTION_HOLDS = "library GEMM chunks, peer copies, flags, host times, the sustained clock"


def params_gap(cal: Calibration, params: Iterable[str]) -> str:
    """Why ``cal`` cannot price a copy-engine term that reads ``params`` ("" when it can): it has no
    copy_engine section, or the section lacks one of them; then the command that measures them into
    a file the user owns. The one wording of the dense term's gap and the MoE term's."""
    from fo_tune.calibrate.missing import measure_into

    section = cal.copy_engine
    if section is None:
        what = f"the calibration's copy_engine section ({SECTION_HOLDS})"
    else:
        missing = [name for name in params if name not in section.params]
        if not missing:
            return ""
        what = f"copy_engine.params.{missing[0]} in the calibration"
    return f"needs {what}; {measure_into(cal, CALIBRATE, 'two GPUs')}"


def peer_blocker(fingerprint: Fingerprint, moves: str) -> str:
    """Why the copy engine cannot move ``moves`` (data, rows) between ``fingerprint``'s GPUs ("" when
    it can): it needs two or more of them, with peer access."""
    if fingerprint.world_size < 2:
        return f"moves {moves} between GPUs; world size 1 has none"
    if not fingerprint.interconnect.startswith(PEER_INTERCONNECTS):
        return (
            f"needs peer access between the GPUs (NVLink or PCIe P2P); {fingerprint.device_key} "
            f"has interconnect {fingerprint.interconnect}"
        )
    return ""


@dataclass(frozen=True, kw_only=True, slots=True)
class RingSpace(Section):
    """The ring mode's chunkings: equal ``chunks`` and extra ``weights``."""

    chunks: tuple[int, ...]
    weights: tuple[tuple[int, ...], ...] = ()

    def weightings(self) -> list[tuple[int, ...]]:
        out = [(1,) * c for c in self.chunks]
        return out + [w for w in self.weights if w not in out]


@dataclass(frozen=True, kw_only=True, slots=True)
class TiledSpace(Section):
    """The tiled mode's chunk counts and GEMM tiles."""

    chunks: tuple[int, ...]
    tiles: tuple[Tile, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class CopyEngineSpace:
    """The copy engine's section: its modes' subsections, by mode name."""

    modes: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {name: plain(section) for name, section in self.modes.items()}


def _chunk_count(r: SpaceReader, node: Any, path: str) -> int:
    count = r.integer(node, path, minimum=1)
    if count > MAX_CHUNKS:
        r.fail(path, f"{count} > {MAX_CHUNKS}, the most chunks a schedule may cut")
    return count


def _weights(r: SpaceReader, node: Any, path: str) -> tuple[int, ...]:
    """One schedule's chunk weights: 2 to MAX_CHUNKS positive integers (repeats allowed)."""
    if not isinstance(node, list) or not 2 <= len(node) <= MAX_CHUNKS:
        r.fail(path, f"expected a list of 2 to {MAX_CHUNKS} chunk weights, got {node!r}")
    return tuple(r.integer(w, f"{path}[{i}]", minimum=1) for i, w in enumerate(node))


def _read_ring(r: SpaceReader, node: Any, path: str) -> RingSpace:
    data = r.mapping(node, path, ("chunks",), ("weights",))
    weights = listed(_weights)(r, data["weights"], f"{path}.weights") if "weights" in data else ()
    return RingSpace(chunks=listed(_chunk_count)(r, data["chunks"], f"{path}.chunks"), weights=weights)


def _read_tiled(r: SpaceReader, node: Any, path: str) -> TiledSpace:
    data = r.section(node, path, {"chunks": listed(_chunk_count), "tiles": listed(type(r).tile)})
    return TiledSpace(**data)


# mode name -> the reader of its subsection (the runtime's modes:
# fo_kernels.engines.copy_engine.settings.COPY_ENGINE_MODES)
_MODES = {"ring": _read_ring, "tiled": _read_tiled}


def weights_label(weights: tuple[int, ...]) -> str:
    """``(2, 2, 1)`` -> ``"2-2-1"``: a weighting as a categorical parameter value."""
    return "-".join(map(str, weights))


def _parse_weights(label: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in str(label).split("-"))
    except ValueError:
        raise Infeasible(f"weights {label!r}: expected integers joined by '-'") from None


class CopyEngineTuner(EngineTuner):
    """The ``copy_engine`` engine's plug-in (see the module docstring)."""

    name: ClassVar[str] = "copy_engine"

    # ------------------------------------------------------------------------------ the space
    def read_space(self, reader: SpaceReader, node: Any, path: str) -> CopyEngineSpace:
        data = reader.mapping(node, path, (), tuple(_MODES))
        if not data:
            reader.fail(path, f"expected at least one mode of {', '.join(_MODES)}")
        return CopyEngineSpace(
            modes={name: _MODES[name](reader, data[name], f"{path}.{name}") for name in data}
        )

    def read_space_v1(self, reader: SpaceReader, data: Mapping[str, Any]) -> CopyEngineSpace | None:
        if "copy_engine_exchange_chunks" in data:
            reader.fail(
                "copy_engine_exchange_chunks",
                "the copy engine's exchange mode was removed; delete the key (the ring and tiled "
                "modes are searched)",
            )
        modes: dict[str, Any] = {}
        if "copy_engine_chunks" in data:
            weights = data.get("copy_engine_weights")
            modes["ring"] = RingSpace(
                chunks=listed(_chunk_count)(reader, data["copy_engine_chunks"], "copy_engine_chunks"),
                weights=listed(_weights)(reader, weights, "copy_engine_weights") if weights else (),
            )
        tiled_keys = ("copy_engine_tiled_chunks", "copy_engine_tiles")
        if any(key in data for key in tiled_keys):
            missing = [key for key in tiled_keys if key not in data]
            if missing:
                reader.fail(
                    missing[0], "the tiled mode needs both copy_engine_tiled_chunks and copy_engine_tiles"
                )
            modes["tiled"] = TiledSpace(
                chunks=listed(_chunk_count)(
                    reader, data["copy_engine_tiled_chunks"], "copy_engine_tiled_chunks"
                ),
                tiles=listed(type(reader).tile)(reader, data["copy_engine_tiles"], "copy_engine_tiles"),
            )
        return CopyEngineSpace(modes=modes) if modes else None

    def v1_keys(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        optional = (
            "copy_engine_chunks",
            "copy_engine_weights",
            "copy_engine_tiled_chunks",
            "copy_engine_tiles",
        )
        return (), (*optional, "copy_engine_exchange_chunks")

    # ------------------------------------------------------------------------------ feasibility
    def blocker(self, fingerprint: Fingerprint, collective: str, dtype: str) -> str:
        if collective not in COLLECTIVES:
            return f"does not run {collective} (it runs {', '.join(COLLECTIVES)})"
        return peer_blocker(fingerprint, "data")

    def calibration_gap(self, cal: Calibration, collective: str) -> str:
        from fo_tune.engines.copy_engine.model import PARAMS as TERM_PARAMS
        from fo_tune.model.library import PARAMS as LIBRARY_PARAMS

        return params_gap(cal, (*LIBRARY_PARAMS, *TERM_PARAMS))

    def probe_task(self) -> Any:
        from fo_tune.engines.copy_engine.probe import CopyEngineProbeTask

        return CopyEngineProbeTask()

    # ------------------------------------------------------------------------------ the encoding
    def _candidates(self, task: ShapeTask) -> dict[str, Any]:
        """mode -> its candidate values for this shape (only modes with at least one)."""
        if self.name not in task.memo:
            task.memo[self.name] = self._make_candidates(task)
        return task.memo[self.name]

    def _make_candidates(self, task: ShapeTask) -> dict[str, Any]:
        section: CopyEngineSpace | None = task.space.engine(self.name)
        if section is None:
            return {}
        shard_rows = cdiv(task.m, task.world_size)
        out: dict[str, Any] = {}
        ring = section.modes.get("ring")
        if ring is not None:
            weightings = [w for w in ring.weightings() if len(w) <= shard_rows]
            if weightings:
                out["ring"] = {"weights": [weights_label(w) for w in weightings]}
        tiled = section.modes.get("tiled")
        if (
            tiled is not None
            and task.collective in TILED_COLLECTIVES
            and task.world_size == TILED_WORLD
            and task.dtype != "float32"
        ):
            tiles = [t for t in tiled.tiles if not task.predictable or task.model.knows_tile(t)]  # type: ignore[union-attr]
            counts = [
                c for c in tiled.chunks if tiles and c <= cdiv(cdiv(task.m, 2), max(t.block_m for t in tiles))
            ]
            if tiles and counts:
                out["tiled"] = {
                    "weights": [weights_label((1,) * c) for c in counts],
                    "tile": [t.label() for t in tiles],
                }
        return out

    def choices(self, task: ShapeTask) -> dict[str, list[Any]]:
        cands = self._candidates(task)
        out: dict[str, list[Any]] = {"mode": list(cands)}
        for mode, values in cands.items():
            out.update({f"{mode}.{name}": list(v) for name, v in values.items()})
        return out

    def suggest(self, trial: Any, task: ShapeTask) -> dict[str, Any]:
        cands = self._candidates(task)
        if not cands:
            raise Infeasible("the search space offers no copy-engine schedule for this shape")
        mode = trial.suggest_categorical("mode", list(cands))
        params: dict[str, Any] = {"mode": mode}
        for name, values in cands[mode].items():
            params[f"{mode}.{name}"] = trial.suggest_categorical(f"{mode}.{name}", list(values))
        return params

    def build(self, params: Mapping[str, Any], task: ShapeTask) -> EngineSettings:
        mode = str(params.get("mode"))
        cands = self._candidates(task)
        if mode not in cands:
            raise Infeasible(
                f"copy-engine mode {mode!r} is not offered for this shape (offered: {list(cands)})"
            )
        label = str(params.get(f"{mode}.weights"))
        if label not in cands[mode]["weights"]:
            raise Infeasible(f"copy-engine weights {label!r} are not offered for {mode} on this shape")
        tile = None
        if mode == "tiled":
            tile_label = str(params.get("tiled.tile"))
            section = task.space.engine(self.name)
            tile = next((t for t in section.modes["tiled"].tiles if t.label() == tile_label), None)
            if tile is None or tile_label not in cands[mode]["tile"]:
                raise Infeasible(f"tile {tile_label!r} is not offered for the tiled mode")
        return CopyEngineSettings(mode=mode, weights=_parse_weights(label), tile=tile)

    def params_of(self, settings: EngineSettings, task: ShapeTask) -> dict[str, Any] | None:
        if not isinstance(settings, CopyEngineSettings):
            return None
        cands = self._candidates(task).get(settings.mode)
        label = weights_label(settings.weights)
        if cands is None or label not in cands["weights"]:
            return None
        params: dict[str, Any] = {"mode": settings.mode, f"{settings.mode}.weights": label}
        if settings.tile is not None:
            if settings.tile.label() not in cands.get("tile", ()):
                return None
            params["tiled.tile"] = settings.tile.label()
        return params

    def points(self, task: ShapeTask, *, exhaustive: bool) -> Iterator[dict[str, Any]]:
        for mode, values in self._candidates(task).items():
            for label in values["weights"]:
                if mode == "tiled":
                    for tile in values["tile"]:
                        yield {"mode": mode, "tiled.weights": label, "tiled.tile": tile}
                else:
                    yield {"mode": mode, f"{mode}.weights": label}

    def seeds(self, task: ShapeTask) -> list[dict[str, Any]]:
        """Every point: the space is small, and a measured study should time all of it."""
        return list(self.points(task, exhaustive=True))

    # ------------------------------------------------------------------------------ the model
    def term(self, model: CostModel) -> Any:
        from fo_tune.calibrate.calibration import CalibrationError
        from fo_tune.engines.copy_engine.model import CopyEngineTerm

        gap = self.calibration_gap(model.cal, "all_reduce")
        if gap:
            raise CalibrationError(f"engine copy_engine {gap}")
        section = model.cal.copy_engine
        assert section is not None
        return CopyEngineTerm(model, section.values(), section.host)
