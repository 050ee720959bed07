"""Planning MoE table rows from the model: ``plan_moe`` prices every point of the MoE space per
(experts' shape, M bucket) and keeps the best where it beats the no-overlap path; ``write_moe_rows``
merges the rows into the MoE table under the dense tables' file lock (a new bucket takes its tokens
from the rows it overlaps, which keep the rest: ``fo_tune.tables.merge.merge_moe_into``).

M buckets: ascending tokens per rank T_1 < T_2 < ...; bucket i's row covers tokens (T_{i-1}, T_i]
(the first from 0) and is priced at T_i, its token bound (the copy engine sizes its buffers for
it, and the most tokens a bucket holds is its slowest call). A row overlaps only when its best
point is predicted faster than the no-overlap path by ``MIN_GAIN`` (the dense search's rule,
``fo_tune.search.decide``), else it says ``engine: null``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fo_kernels.errors import FoTuneError, ScheduleError, TableNotFoundError
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.moe.routing import MOE_DTYPES
from fo_kernels.moe.schedule import MoeProblem, MoeSchedule
from fo_kernels.moe.table import (
    MoeRow,
    MoeTable,
    load_moe_table,
    moe_table_path,
    save_moe_table,
)
from fo_tune.calibrate.calibration import Calibration, CalibrationError
from fo_tune.moe.model import MoeCall, MoeCostModel, MoePrediction
from fo_tune.moe.space import MoeSpace, load_moe_space, moe_space_for
from fo_tune.output import Reporter, SilentReporter
from fo_tune.ranks.limits import GB, INT32_MAX, Target, fingerprint_target
from fo_tune.search.decide import MIN_GAIN
from fo_tune.tables.merge import LOCK_TIMEOUT_S, lock_path, merge_moe_into


class MoeSearchError(FoTuneError, ValueError):
    """Bad MoE search input (experts' shapes, buckets, mode, calibration); the message says what to do."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertsShape:
    """The experts' shape a table row is keyed by: H, I, E_local, k."""

    hidden: int
    intermediate: int
    experts: int
    top_k: int

    @classmethod
    def parse(cls, text: str) -> ExpertsShape:
        """``H,I,E_local,k`` (``x`` also separates)."""
        parts = text.replace("x", ",").split(",")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 4 or min(values) < 1:
            raise MoeSearchError(f"--experts {text!r}: expected H,I,E_local,k (four integers >= 1)")
        return cls(hidden=values[0], intermediate=values[1], experts=values[2], top_k=values[3])

    def label(self) -> str:
        return f"H {self.hidden}, I {self.intermediate}, E_local {self.experts}, k {self.top_k}"

    def check_world(self, world_size: int, where: str = "--world-size") -> None:
        """``MoeSearchError`` unless a token can pick its k distinct experts (a router's torch.topk
        over E = ``world_size`` x E_local logits); ``where`` names what set the world size."""
        total = self.experts * world_size
        if self.top_k > total:
            raise MoeSearchError(
                f"--experts {self.hidden},{self.intermediate},{self.experts},{self.top_k}: k = "
                f"{self.top_k} is above the {total} experts at {where} {world_size} (E = "
                f"{world_size} x E_local {self.experts}), and a token picks k distinct experts; give "
                f"k <= {total}, or E_local >= {-(-self.top_k // world_size)}"
            )

    def call(self, tokens: int, world: int, dtype: str) -> MoeCall:
        """The model's call of these experts at ``tokens`` per rank on ``world`` ranks."""
        return MoeCall(
            tokens=tokens,
            hidden=self.hidden,
            intermediate=self.intermediate,
            experts=self.experts,
            top_k=self.top_k,
            world=world,
            dtype=dtype,
        )


# An MoE suite model's sizes (suites/moe/experts.yaml), in ExpertsShape's order, and the keys an
# entry may hold (its name besides; the bench scripts read the same entries).
_SUITE_SIZES = ("hidden", "intermediate", "experts", "top_k")
_SUITE_KEYS = ("name", *_SUITE_SIZES)


def check_moe_dtype(dtype: str) -> None:
    """``MoeSearchError`` unless the MoE FFN runs ``dtype`` (the --dtype of an -c moe command)."""
    if dtype not in MOE_DTYPES:
        raise MoeSearchError(f"-c moe --dtype {dtype}: the MoE FFN runs {', '.join(MOE_DTYPES)}")


def experts_from_suite(path: Path, world_size: int) -> list[ExpertsShape]:
    """The experts' shapes of an MoE suite's ``models`` (``suites/moe/experts.yaml``: hidden,
    intermediate, experts E, top_k) at EP = ``world_size``: E / w local experts, the models whose
    E the world size does not divide left out."""
    from fo_kernels.files import read_yaml

    data = read_yaml(path, error=MoeSearchError, missing=MoeSearchError, missing_hint="no such MoE suite")
    models = data.get("models") if isinstance(data, Mapping) else None
    if models is None and isinstance(data, Mapping) and "shapes" in data:
        raise MoeSearchError(
            f"{path}: a suite of dense shapes, which `fo-tune search` without -c moe reads; -c moe reads "
            "an MoE suite's models (suites/moe/experts.yaml), or give --experts H,I,E_local,k"
        )
    if not isinstance(models, list) or not models:
        raise MoeSearchError(f"{path}: models: expected a list of {{hidden, intermediate, experts, top_k}}")
    out, counts = [], []
    for i, m in enumerate(models):
        try:
            h, inter, e, k = (m[key] for key in _SUITE_SIZES)
        except (KeyError, TypeError):
            raise MoeSearchError(f"{path}: models[{i}]: needs hidden, intermediate, experts, top_k") from None
        unknown = [str(key) for key in m if key not in _SUITE_KEYS]
        if unknown:  # (a misspelt optional key would otherwise pass unread)
            raise MoeSearchError(
                f"{path}: models[{i}]: unknown key(s) {', '.join(unknown)}; an entry holds "
                f"{', '.join(_SUITE_KEYS)}"
            )
        wrong = [
            f"{key} {v!r}"
            for key, v in zip(_SUITE_SIZES, (h, inter, e, k), strict=True)
            if type(v) is not int
        ]
        if wrong:  # (int() took 64.7 as 64, "64" as 64 and true as 1)
            raise MoeSearchError(f"{path}: models[{i}]: {', '.join(wrong)}: sizes are whole numbers")
        if min(h, inter, e, k) < 1:
            raise MoeSearchError(
                f"{path}: models[{i}]: hidden, intermediate, experts and top_k must be >= 1, got "
                f"{h}, {inter}, {e}, {k}"
            )
        if k > e:  # (checked here: the shape's own check names --experts and E_local, not the file)
            raise MoeSearchError(
                f"{path}: models[{i}]: top_k {k} is above its {e} experts, and a token picks top_k "
                f"distinct experts; give top_k <= {e}"
            )
        counts.append(e)
        if e % world_size == 0:
            out.append(ExpertsShape(hidden=h, intermediate=inter, experts=e // world_size, top_k=k))
    if not out:
        raise MoeSearchError(
            f"{path}: no model's experts (E = {', '.join(map(str, sorted(set(counts))))}) divide among "
            f"{world_size} ranks; give a --world-size that divides one, or --experts H,I,E_local,k"
        )
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedRow:
    """One planned row, its prediction and the no-overlap path's, and how many points were priced."""

    row: MoeRow
    prediction: MoePrediction
    fallback: MoePrediction
    priced: int

    @property
    def speedup(self) -> float:
        return self.fallback.total_ms / self.prediction.total_ms if self.prediction.total_ms > 0 else 1.0


@dataclass(kw_only=True, slots=True)
class MoePlan:
    """Every planned row, and the engines left out with why."""

    rows: list[PlannedRow] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def parse_tokens(text: str) -> list[int]:
    """``T[,T...]`` (the --tokens option) as integers; ``MoeSearchError`` naming the option."""
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise MoeSearchError(
            f"--tokens {text!r}: expected comma-separated integers (tokens per rank)"
        ) from None


def buckets(tokens: Sequence[int]) -> list[tuple[int, int]]:
    """(tokens_min, tokens_max) of each M bucket (see the module docstring)."""
    values = list(tokens)
    if not values or values != sorted(set(values)) or values[0] < 1:
        raise MoeSearchError(f"--tokens {values}: expected ascending, distinct integers >= 1")
    return [(0 if i == 0 else values[i - 1] + 1, t) for i, t in enumerate(values)]


def moe_call_bytes(shape: ExpertsShape, tokens: int, itemsize: int) -> int:
    """Bytes one rank holds for an MoE call of ``tokens`` tokens, routing balanced (each rank
    receives the ``tokens x k`` rows it sends): its experts' weights (w13 (E, H, 2I), w2 (E, I, H)),
    x and y (T, H) and the rows' tensors: dispatched and combined (R, H) each, the up projection
    (R, 2I) and its activation (R, I), the down projection (R, H)."""
    h, i, rows = shape.hidden, shape.intermediate, tokens * shape.top_k
    weights = 3 * shape.experts * h * i
    return (weights + 2 * tokens * h + rows * (3 * h + 3 * i)) * itemsize


def check_moe_size(
    experts: Sequence[ExpertsShape], tokens: Sequence[int], dtype: str, target: Target
) -> None:
    """``MoeSearchError`` for the first experts' shape whose call at the largest bucket cannot exist
    on ``target``: a size (H, 2I, the rows T x k) above ``INT32_MAX`` (the grouped GEMMs' sizes and
    the kernels' row indices are int32), or more bytes (``moe_call_bytes``) than its memory, as the
    dense search refuses a shape."""
    from fo_kernels.schedule import torch_dtype

    most = max(tokens)
    itemsize = torch_dtype(dtype).itemsize
    for shape in experts:
        sizes = {"H": shape.hidden, "2I": 2 * shape.intermediate, "the rows T x k": most * shape.top_k}
        for name, size in sizes.items():
            if size > INT32_MAX:
                raise MoeSearchError(
                    f"--experts {shape.label()} at {most} tokens a rank: {name} = {size} is above "
                    f"{INT32_MAX}, the largest size the grouped GEMMs take; give a smaller shape or --tokens"
                )
        need = moe_call_bytes(shape, most, itemsize)
        if target.memory_bytes is not None and need > target.memory_bytes:
            raise MoeSearchError(
                f"--experts {shape.label()} at {most} tokens a rank: the experts' weights and the "
                f"call's rows need {need / GB:.1f} GB a rank in {dtype}, more than the "
                f"{target.memory_bytes / GB:.1f} GB of {target.name}; give a smaller shape or --tokens"
            )


def plan_moe(
    model: MoeCostModel,
    space: MoeSpace,
    experts: Sequence[ExpertsShape],
    tokens: Sequence[int],
    *,
    dtype: str,
    engines: Mapping[str, str],
    provenance: Mapping[str, Any] | None = None,
    reporter: Reporter | None = None,
) -> MoePlan:
    """The planned rows. ``engines``: each MoE engine's reason it cannot be searched ("" when it
    can); the space's section of every searchable one is priced point by point. ``reporter``
    advances a step per row (a line per experts' shape where the output is a log)."""
    plan = MoePlan(skipped={name: why for name, why in engines.items() if why})
    ranges = buckets(tokens)
    rep, stage = reporter or SilentReporter(), "plan (moe)"
    rep.stage(stage, len(experts) * len(ranges))
    for shape in experts:
        what = f"{shape.hidden},{shape.intermediate},{shape.experts},{shape.top_k}"
        for i, (lo, hi) in enumerate(ranges):
            call = shape.call(hi, model.world_size, dtype)
            problem = MoeProblem(
                hidden=shape.hidden,
                intermediate=shape.intermediate,
                experts=shape.experts,
                top_k=shape.top_k,
                tokens_min=lo,
                tokens_max=hi,
            )
            plan.rows.append(_plan_bucket(model, space, call, problem, dtype, engines, provenance or {}))
            rep.step(stage, f"{what} tokens {lo}..{hi}", log=i == len(ranges) - 1)
    return plan


def plan_moe_search(
    cal: Calibration,
    experts: Sequence[ExpertsShape],
    tokens: Sequence[int] | None,
    *,
    dtype: str,
    engines: Sequence[str],
    space_file: Path | None = None,
    reporter: Reporter | None = None,
) -> tuple[MoePlan, MoeCostModel]:
    """What ``fo-tune search -c moe --mode predict`` plans: the MoE space (``space_file``, else the
    packaged one of the calibration's GPU), the model of ``cal`` and ``plan_moe`` over ``engines``
    (each left out, with why, where its blocker, its calibration gap or the space says so);
    ``tokens`` None: the space's M buckets."""
    from fo_tune.engines import moe_cost_model, moe_engine_names, moe_term

    keys = {name: moe_term(name).SPACE_KEYS for name in moe_engine_names()}  # the file's sections
    if space_file is not None:
        space = load_moe_space(space_file, keys)
    else:
        space = moe_space_for(cal.fingerprint.compute_capability, keys, device_key=cal.fingerprint.device_key)
    check_moe_size(experts, tokens or space.tokens_per_rank, dtype, fingerprint_target(cal.fingerprint))
    model = moe_cost_model(cal)
    reasons = {}
    for name in engines:
        term = moe_term(name)
        why = term.blocker(cal.fingerprint) or term.calibration_gap(cal)
        reasons[name] = why or ("" if name in space.engines else f"has no section in {space.source}")
    _check_fallback_priced(cal, model, experts, tokens or space.tokens_per_rank, dtype)
    provenance = {"calibration": f"{cal.fingerprint.device_key} {cal.created}", "space": space.name}
    plan = plan_moe(
        model,
        space,
        experts,
        tokens or space.tokens_per_rank,
        dtype=dtype,
        engines=reasons,
        provenance=provenance,
        reporter=reporter,
    )
    return plan, model


def _check_fallback_priced(
    cal: Calibration, model: MoeCostModel, experts: Sequence[ExpertsShape], tokens: Sequence[int], dtype: str
) -> None:
    """``MoeSearchError`` where the no-overlap path has no finite price: every row is decided
    against it, so a calibration without library GEMM times (no GEMM profile's cuBLAS column, no
    copy-engine section) would write rows whose times are infinite."""
    call = experts[0].call(max(tokens), model.world_size, dtype)
    if math.isfinite(model.fallback(call).total_ms):
        return
    from fo_tune.calibrate.missing import measure_into

    how = measure_into(cal, f"fo-tune calibrate --world-size 1 --only gemm --dtype {dtype}", "one GPU")
    raise MoeSearchError(
        f"-c moe: the calibration cannot price the no-overlap path's grouped GEMMs (it has no library "
        f"GEMM times in {dtype}); {how}"
    )


def _plan_bucket(
    model: MoeCostModel,
    space: MoeSpace,
    call: MoeCall,
    problem: MoeProblem,
    dtype: str,
    engines: Mapping[str, str],
    provenance: Mapping[str, Any],
) -> PlannedRow:
    base = MoeSchedule(dtype=dtype, world_size=call.world, problem=problem)
    fallback = model.fallback(call)
    best, best_pred, priced = base, fallback, 0
    for name, why in engines.items():
        section = space.engines.get(name)
        if why or section is None:
            continue
        term = model.term(name)
        for point in term.points(section, call):
            try:
                schedule = MoeSchedule(dtype=dtype, world_size=call.world, problem=problem, **point)
                pred = term.predict(schedule, call)
            except (ScheduleError, CalibrationError):
                continue  # a point this shape or calibration cannot run or price
            priced += 1
            if pred.total_ms < best_pred.total_ms:
                best, best_pred = schedule, pred
    if best.engine is not None and best_pred.total_ms > fallback.total_ms * (1 - MIN_GAIN):
        best, best_pred = base, fallback
    note = {
        **provenance,
        "mode": "predict",
        "predicted_ms": round(best_pred.total_ms, 6),
        "fallback_ms": round(fallback.total_ms, 6),
        "tokens_priced": call.tokens,
        "basis": best_pred.basis,
    }
    return PlannedRow(
        row=MoeRow(schedule=best, provenance=note), prediction=best_pred, fallback=fallback, priced=priced
    )


def write_moe_rows(
    root: str | os.PathLike[str],
    fingerprint: Fingerprint,
    rows: Sequence[MoeRow],
    *,
    world_size: int,
    dtype: str,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
) -> Path:
    """Merge ``rows`` into ``<root>/<device key>/moe-w<W>-<dtype>.yaml`` under its lock, by
    ``fo_tune.tables.merge.merge_moe_into``'s rules: a row takes its token range from the rows of its
    experts' shape it overlaps, which keep the tokens outside it; a predicted row takes no tokens
    from a measured one. Returns the path."""
    from filelock import FileLock  # the tuner's dependency, never the runtime's

    from fo_tune.output import check_writable_file

    path = moe_table_path(root, fingerprint.device_key, world_size, dtype)
    # OutputError (exit 2 in the CLI) naming the path, not an OSError
    check_writable_file(path, what="table file")
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_path(path)), timeout=lock_timeout_s):
        try:
            table = load_moe_table(path)
        except TableNotFoundError:
            table = MoeTable(fingerprint=fingerprint, world_size=world_size, dtype=dtype)
        if table.fingerprint.device_key != fingerprint.device_key:
            raise MoeSearchError(
                f"{path}: holds rows of {table.fingerprint.device_key}, not {fingerprint.device_key}"
            )
        table = merge_moe_into(table, rows)
        save_moe_table(table, path)
    return path
