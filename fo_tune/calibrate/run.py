"""``fo-tune calibrate`` as a library call: measure one machine and build its ``Calibration``.

    run_calibration(CalibrationRequest(world_size=2, quick=True), reporter)
      1. fingerprint of every rank (they must agree)
      2. bandwidth: every collective x every NCCL CTA cap of the space x message sizes
      3. interference: the collective beside the signalled GEMM on SMs - r, for r in the space
         (each r paired with the largest cap that leaves NCCL_SM_MARGIN SMs spare, and with r
         itself, which docs/design.md saw stall the collective)
      4. GEMM profiles: tile configs x grids for the space's shape set, next to cuBLAS
      5. latency/bandwidth fits
      6. the copy engine's section (``fo_tune.engines.copy_engine.calibrate``): the library GEMM of its
         chunk shapes paced and sustained (one GPU), peer copies, flags and host times (two GPUs)
      7. ``copy_engine_n`` (only when asked for: ``--only copy_engine_n``): the copy engine at N
         peers on one GPU (``fo_tune.engines.copy_engine.calibrate_n``): host times per rank at
         N = 2..8 with virtual ranks, chunk GEMMs at TP=4/8 layer shapes; merged (``merge_into``)
         into a calibration of the same GPU model, or of another model of the same die with
         ``sibling`` (``--into-sibling``), its points then recording where they were measured
      8. ``moe_host``: the expert-parallel FFN's host times on rank 0 (``fo_tune.moe.host``)

A GEMM profile in another dtype than the calibration's (fp8) may come from a sibling too, measured
here or read from ``fo-tune profile`` CSVs without a GPU (``fo_tune.calibrate.from_profiles``).

``parts`` selects stages by name (``PARTS``); world size 1 has no collective, so its default is
``gemm``, ``copy_engine`` and ``moe_host`` (the one-GPU measurements: ``fo-tune calibrate
--world-size 1``).

All of it runs in one worker pool (``fo_tune.ranks.launch``); writing the files is
``fo_tune.calibrate.files``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field

from fo_kernels.errors import EnvironmentMismatchError, FoTuneError
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.tile import Tile
from fo_tune.calibrate.calibration import (
    CALIBRATED_COLLECTIVES,
    BandwidthPoint,
    Calibration,
    EngineCalibration,
    GemmPoint,
    InterferencePoint,
    Quantity,
    fit_all,
)
from fo_tune.calibrate.missing import gemm_only_refusal
from fo_tune.calibrate.profile import profile_shape
from fo_tune.engines.triton.defaults import NCCL_SM_MARGIN
from fo_tune.output import Reporter, SilentReporter, size_label
from fo_tune.ranks.collectives import CollectiveSweepTask, InterferenceTask
from fo_tune.ranks.launch import fingerprinted_pool
from fo_tune.ranks.pool import LaunchError, Pool
from fo_tune.ranks.timing import Timing
from fo_tune.space import SearchSpace, space_for


class CalibrationRequestError(FoTuneError, ValueError):
    """A calibration request that cannot be measured as asked; the message says what to do."""


# The stages a calibration can run, by name (--only).
PARTS = ("bandwidth", "interference", "gemm", "copy_engine", "copy_engine_n", "moe_host")
# What a calibration measures unless told (copy_engine_n only when asked for: it adds the N-peer
# measurements to a calibration measured before, with --into). moe_host is measured by rank 0 on
# a group of its own: the host's times, whatever the world size.
DEFAULT_PARTS = (*PARTS[:4], "moe_host")
# Without a collective between ranks, world size 1 measures these.
ONE_GPU_PARTS = ("gemm", "copy_engine", "moe_host")
# What a calibration in another operand dtype than its communication's measures: the GEMM profile
# (fp8: the signalled GEMM beside torch._scaled_mm), merged into a calibration's ``gemm_dtypes``
# with --into; the collectives, the interference and the copy engine are measured in bfloat16.
OTHER_DTYPE_PARTS = ("gemm",)
GEMM_ONLY_DTYPES = ("float8_e4m3fn",)
# What a sibling GPU (another model of the same die: the fingerprint fields of SAME_DIE equal, its
# name not) may merge into a calibration, with --into-sibling: the copy engine at N peers, whose
# host times and chunk GEMMs the die decides (its memory bandwidth aside), the MoE path's host
# times (the host's, not the GPU's), and a GEMM profile in another dtype than the calibration's
# (OTHER_DTYPE_PARTS: fp8, whose plans then say they rest on it); each point merged records the
# sibling's device key (``measured_on``).
SIBLING_PARTS = ("copy_engine_n", "moe_host")
SAME_DIE = ("compute_capability", "sm_count")
# The parts that time collectives between all the ranks: their curves and slowdowns describe one
# world size, so --into merges them only into a calibration of that world size (the others are
# measured on one GPU, or between two peers whatever the world size).
WORLD_PARTS = ("bandwidth", "interference")


@dataclass(frozen=True, kw_only=True)
class CalibrationRequest:
    world_size: int = 2
    collectives: tuple[str, ...] = CALIBRATED_COLLECTIVES
    quick: bool = False
    dtype: str = "bfloat16"
    backend: str | None = None
    space: SearchSpace | None = None  # None: the space for this device's compute capability
    interference_collectives: tuple[str, ...] = field(default=("all_reduce", "reduce_scatter"))
    parts: tuple[str, ...] | None = None  # None: every part (world size 1: ONE_GPU_PARTS)

    def __post_init__(self) -> None:
        unknown = [c for c in self.collectives if c not in CALIBRATED_COLLECTIVES]
        if unknown:
            raise EnvironmentMismatchError(
                f"unknown collective(s) {', '.join(unknown)}; choose from {', '.join(CALIBRATED_COLLECTIVES)}"
            )
        bad = [p for p in self.parts or () if p not in PARTS]
        if bad:
            raise CalibrationRequestError(f"--only {bad[0]!r} is not one of {', '.join(PARTS)}")
        if self.world_size == 1 and set(self.parts or ()) & {"bandwidth", "interference"}:
            raise CalibrationRequestError(
                "--only bandwidth/interference measure collectives between ranks; world size 1 has none"
            )
        if self.dtype in GEMM_ONLY_DTYPES and tuple(self.parts or ()) != OTHER_DTYPE_PARTS:
            raise CalibrationRequestError(gemm_only_refusal(self.dtype, self.world_size))

    def selected(self) -> tuple[str, ...]:
        """The parts this request measures."""
        if self.parts is not None:
            return self.parts
        return ONE_GPU_PARTS if self.world_size == 1 else DEFAULT_PARTS


def interference_pairs(sms_free: Sequence[int], caps: Sequence[int], quick: bool) -> list[tuple[int, int]]:
    """(r, cap) pairs for r > 0: the largest cap <= r - NCCL_SM_MARGIN, and (full runs) the cap
    equal to r, which docs/design.md saw stall the collective. Without any positive cap in the space
    (the CPU), each r is paired with NCCL's default (0)."""
    pairs: list[tuple[int, int]] = []
    usable = sorted(c for c in caps if c > 0)
    for r in sorted(x for x in sms_free if x > 0):
        spare = [c for c in usable if c <= r - NCCL_SM_MARGIN]
        if spare:
            pairs.append((r, spare[-1]))
        elif usable:
            pairs.append((r, usable[0]))
        else:
            pairs.append((r, 0))
        if not quick and r in usable and (r, r) not in pairs:
            pairs.append((r, r))
    return pairs


def run_calibration(request: CalibrationRequest, reporter: Reporter | None = None) -> Calibration | None:
    """Measure everything a calibration holds on ``request.world_size`` local ranks.

    Returns None on a torchrun rank other than 0 (it served rank 0's tasks; rank 0 has the result).
    """
    rep = reporter or SilentReporter()
    with fingerprinted_pool(request.world_size, backend=request.backend, purpose="calibrate") as (pool, fp):
        if fp is None:
            return None
        cpu = pool.backend != "nccl"
        space = request.space or space_for(fp.compute_capability)
        cal = Calibration(
            fingerprint=fp,
            world_size=request.world_size,
            dtype=request.dtype,
            space=space.name,
            quick=request.quick,
            created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        )
        parts = request.selected()
        if "bandwidth" in parts:
            cal.bandwidth = _bandwidth(pool, request, space, cpu, rep)
            cal.fits = fit_all(cal.bandwidth)
        if "interference" in parts:
            cal.interference = _interference(pool, request, space, cpu, fp.sm_count, rep)
        if "gemm" in parts:
            cal.gemm = _gemm_profiles(pool, request, space, cpu, rep)
        if "copy_engine" in parts:
            cal.copy_engine = _copy_engine(pool, request, space, cpu, fp, rep)
        if "copy_engine_n" in parts:
            from fo_tune.engines.copy_engine.calibrate_n import merge_points

            cal.copy_engine = merge_points(cal.copy_engine, _copy_engine_n(pool, request, cpu, rep))
        if "moe_host" in parts:
            from fo_tune.moe.host import measure_moe_host

            cal.moe_host = measure_moe_host(pool, request.quick, cpu, rep)
        return cal


def _bandwidth(pool: Pool, req: CalibrationRequest, space: SearchSpace, cpu: bool, rep: Reporter):
    sizes = tuple(space.message_sizes(quick=req.quick, cpu=cpu))
    caps = space.caps(cpu=cpu)
    rep.stage("bandwidth", len(req.collectives) * len(caps))
    points = []
    for collective in req.collectives:
        for cap in caps:
            per_rank = pool.run(CollectiveSweepTask(collective, sizes, cap, req.dtype))
            for i, size in enumerate(sizes):
                t = Timing.max_over([r[i] for r in per_rank])
                points.append(
                    BandwidthPoint.measured(collective, cap, size, t.median_ms, t.spread_ms, pool.world_size)
                )
            rep.step("bandwidth", f"{collective} cap {cap or 'default'}")
    return points


def _interference(
    pool: Pool, req: CalibrationRequest, space: SearchSpace, cpu: bool, sms: int, rep: Reporter
):
    pairs = tuple(
        (r, c)
        for r, c in interference_pairs(
            space.interference_sms_free(quick=req.quick, cpu=cpu), space.caps(cpu=cpu), req.quick
        )
        if r < sms
    )
    collectives = [c for c in req.interference_collectives if c in req.collectives] or list(
        req.collectives[:1]
    )
    if req.quick:
        collectives = collectives[:1]
    sizes = space.interference_sizes(quick=req.quick, cpu=cpu)
    gemm = tuple(space.interference_gemm(cpu=cpu))
    tile: Tile = space.tile_candidates(quick=True, cpu=cpu)[0]
    rep.stage("interference", len(collectives) * len(sizes))
    points = []
    for collective in collectives:
        for size in sizes:
            per_rank = pool.run(InterferenceTask(collective, size, pairs, gemm, tile, req.dtype))
            for i, (r, cap) in enumerate(pairs):
                rows = [p[i] for p in per_rank]
                g_alone = max(x["gemm_alone"].median_ms for x in rows)
                c_alone = max(x["comm_alone"].median_ms for x in rows)
                g_with = max(x["gemm_with"] for x in rows)
                c_with = max(x["comm_with"] for x in rows)
                points.append(
                    InterferencePoint(
                        collective=collective,
                        sms_free=r,
                        nccl_max_ctas=cap,
                        size_bytes=size,
                        gemm_m=gemm[0],
                        gemm_n=gemm[1],
                        gemm_k=gemm[2],
                        gemm_alone_ms=g_alone,
                        gemm_contended_ms=g_with,
                        comm_alone_ms=c_alone,
                        comm_contended_ms=c_with,
                        gemm_slowdown=g_with / g_alone,
                        comm_slowdown=c_with / c_alone,
                        comm_during_gemm=all(x["comm_during_gemm"] for x in rows),
                        concurrent=all(x["concurrent"] for x in rows),
                    )
                )
            rep.step("interference", f"{collective} {size_label(size)}")
    return points


def _gemm_profiles(pool: Pool, req: CalibrationRequest, space: SearchSpace, cpu: bool, rep: Reporter):
    shapes = space.gemm_shapes(quick=req.quick, cpu=cpu)
    tiles = tuple(space.tile_candidates(dtype=req.dtype, quick=req.quick, cpu=cpu))
    grids = tuple(space.interference_sms_free(quick=req.quick, cpu=cpu))
    frees = tuple(sorted({0, *grids}))
    rep.stage("gemm", len(shapes))
    points = []
    for m, n, k in shapes:
        points += profile_shape(pool, m, n, k, tiles, frees, req.dtype)
        rep.step("gemm", f"{m}x{n}x{k}")
    return points


def _copy_engine(
    pool: Pool, req: CalibrationRequest, space: SearchSpace, cpu: bool, fp: Fingerprint, rep: Reporter
) -> EngineCalibration:
    """The copy engine's section (``fo_tune.engines.copy_engine.calibrate``): what this world size
    measures."""
    from fo_tune.engines.copy_engine import calibrate as ce

    source = ce.measured_by(fp.device_key)
    section = space.engine("copy_engine")
    ring = section.modes.get("ring") if section is not None else None
    chunks = sorted({1, *(ring.chunks if ring is not None else ())})
    shapes = tuple(
        ce.chunk_shapes(space.gemm_shapes(quick=req.quick, cpu=cpu), chunks, max(2, req.world_size))
    )
    two = req.world_size >= 2
    rep.stage("copy engine", 1 + 3 * two)
    points = ce.library_points(pool.run(ce.LibraryGemmTask(shapes, req.dtype)))
    params = ce.fit_library_params(points, fp.sm_count, source)
    rep.step("copy engine", f"library GEMM, {len(points)} shapes")
    copies: list = []
    if two:
        copy, copies = ce.copy_params(pool.run(ce.PeerCopyTask()), source)
        params.update(copy)
        rep.step("copy engine", "peer copies" if copy else "peer copies: not on these ranks")
        flags = pool.run(ce.FlagTask())
        if not any(r["why"] for r in flags):
            params["flag_ms"] = Quantity(
                value=max(r["flag_ms"] for r in flags), source=f"measured by {source} (FlagTask)"
            )
        rep.step("copy engine", "flags" if "flag_ms" in params else f"flags: {flags[0]['why']}")
        m, n, k = space.gemm_shapes(quick=True, cpu=cpu)[0]
        params.update(ce.host_params(pool.run(ce.HostTask(m, n, k, "all_reduce", req.dtype)), source))
        rep.step("copy engine", "host times")
    return EngineCalibration(params=params, library_gemm=points, copies=copies)


def _copy_engine_n(pool: Pool, req: CalibrationRequest, cpu: bool, rep: Reporter) -> EngineCalibration:
    """The copy engine at N peers on one GPU (``fo_tune.engines.copy_engine.calibrate_n``)."""
    from fo_tune.engines.copy_engine import calibrate as ce
    from fo_tune.engines.copy_engine import calibrate_n as cn

    rep.stage("copy engine at N peers", 2)
    points = ce.library_points(pool.run(cn.layer_task(cpu, req.dtype)))
    rep.step("copy engine at N peers", f"chunk GEMMs at TP=4/8 layers, {len(points)} shapes")
    eager = pool.run(cn.HostNTask(dtype=req.dtype))
    host: list = []
    if any(r["why"] for r in eager):
        rep.step("copy engine at N peers", f"host times: {eager[0]['why']}")
        return EngineCalibration(library_gemm=points)
    try:
        graphs = pool.run(cn.HostNTask(dtype=req.dtype, graphs=True), timeout_s=cn.GRAPH_TASK_TIMEOUT_S)
        host = cn.host_points(eager[0]["points"], graphs[0]["points"])
        rep.step("copy engine at N peers", f"host times, {len(host)} points, eager and replayed")
    except LaunchError as exc:  # (the eager times and the GEMMs are kept)
        host = cn.host_points(eager[0]["points"], [])
        rep.step("copy engine at N peers", f"host times eager only; the replays failed: {exc}")
    return EngineCalibration(library_gemm=points, host=host)


def sibling_may_merge(parts: Sequence[str], dtype: str, target_dtype: str) -> bool:
    """Whether ``--into-sibling`` may merge ``parts`` measured in ``dtype`` into a calibration in
    ``target_dtype``: ``SIBLING_PARTS``, or another dtype's GEMM profile (``OTHER_DTYPE_PARTS``)."""
    chosen = set(parts)
    return (bool(chosen) and chosen <= set(SIBLING_PARTS)) or (
        tuple(parts) == OTHER_DTYPE_PARTS and dtype != target_dtype
    )


def check_mergeable(
    target: Calibration,
    fingerprint: Fingerprint,
    dtype: str,
    parts: Sequence[str] = PARTS,
    *,
    sibling: bool = False,
    measured_by: str = "this machine is",
) -> None:
    """Refuse (``CalibrationRequestError``) to merge measurements of ``fingerprint``'s machine in
    ``dtype`` into ``target``: another GPU model (name, compute capability, SM count), a part of
    ``WORLD_PARTS`` at another world size than the target's, or another dtype than the target's
    unless only its GEMM profile (``OTHER_DTYPE_PARTS``, kept apart in ``gemm_dtypes``). With
    ``sibling`` (``--into-sibling``) another GPU name is accepted where the ``SAME_DIE`` fields
    match, for what ``sibling_may_merge`` allows. The CLI asks this with the local fingerprint
    before any rank starts; ``measured_by`` names that machine in the messages."""
    theirs = target.fingerprint
    if sibling and not sibling_may_merge(parts, dtype, target.dtype):
        raise CalibrationRequestError(
            "--into-sibling merges --only copy_engine_n alone (the copy engine at N peers), --only "
            "moe_host (the MoE path's host times) or the two, or --only "
            f"{','.join(OTHER_DTYPE_PARTS)} in another dtype than the calibration's "
            f"{target.dtype} (e.g. --dtype {GEMM_ONLY_DTYPES[0]}): what a GPU of the same die "
            "measures alike; pass one of those, or drop --into-sibling"
        )
    same_die = all(getattr(theirs, name) == getattr(fingerprint, name) for name in SAME_DIE)
    for name in SAME_DIE if sibling else ("gpu_name", *SAME_DIE):
        if getattr(theirs, name) == getattr(fingerprint, name):
            continue
        if sibling:
            raise CalibrationRequestError(
                f"--into-sibling: the calibration is for {theirs.device_key}, {measured_by} "
                f"{fingerprint.device_key} ({name} differs): not the same die; measure on a GPU of "
                "the same compute capability and SM count, or write a calibration of its own"
            )
        hint = ""
        if name == "gpu_name" and same_die and sibling_may_merge(parts, dtype, target.dtype):
            hint = ", or pass --into-sibling (the same die: its points record measured_on)"
        raise CalibrationRequestError(
            f"--into: the calibration is for {theirs.device_key}, {measured_by} "
            f"{fingerprint.device_key} ({name} differs); measure on the same GPU model, or write a "
            f"calibration of its own{hint}"
        )
    between = [p for p in parts if p in WORLD_PARTS]
    if between and theirs.world_size != fingerprint.world_size:
        raise CalibrationRequestError(
            f"--into: the calibration is for world size {theirs.world_size}, and {', '.join(between)} "
            f"would be measured at world size {fingerprint.world_size} (collectives between "
            f"another number of ranks); pass --world-size {theirs.world_size}, or write a "
            "calibration of its own with --out"
        )
    if dtype != target.dtype and tuple(parts) != OTHER_DTYPE_PARTS:
        raise CalibrationRequestError(
            f"--into: the calibration was measured with {target.dtype}, this run with {dtype}; "
            f"pass --dtype {target.dtype} (or --only gemm: another dtype's GEMM profile is kept beside)"
        )


def merge_into(
    target: Calibration, measured: Calibration, parts: Sequence[str], *, sibling: bool = False
) -> Calibration:
    """``target`` with the ``parts`` of ``measured`` replacing its own (the copy engine's section
    merged: a parameter no measurement gives keeps its value and source). Refused when the two
    were measured on different GPUs (name, compute capability, SM count): the numbers would not
    describe ``target``'s machine; with ``sibling``, ``copy_engine_n``, ``moe_host`` or another
    dtype's GEMM profile of another GPU model of the same die is merged, its points (and the
    ``moe_host`` record) recording ``measured``'s device key (``measured_on``)."""
    check_mergeable(target, measured.fingerprint, measured.dtype, parts, sibling=sibling)
    from fo_tune.engines.copy_engine.calibrate import merge_section

    other = measured.fingerprint.gpu_name != target.fingerprint.gpu_name
    source = measured.fingerprint.device_key if other else ""
    if measured.dtype != target.dtype:  # another dtype's GEMM profile, beside the target's own
        return merge_gemm_dtype(target, measured.dtype, measured.gemm, source)
    if "bandwidth" in parts:
        target.bandwidth, target.fits = measured.bandwidth, measured.fits
    if "interference" in parts:
        target.interference = measured.interference
    if "gemm" in parts:
        target.gemm = measured.gemm
    if "copy_engine" in parts and measured.copy_engine is not None:
        target.copy_engine = merge_section(target.copy_engine, measured.copy_engine)
    if "copy_engine_n" in parts and measured.copy_engine is not None:
        from fo_tune.engines.copy_engine.calibrate_n import merge_points

        target.copy_engine = merge_points(target.copy_engine, measured.copy_engine, source)
    if "moe_host" in parts and measured.moe_host is not None:
        target.moe_host = dataclasses.replace(measured.moe_host, measured_on=source)
    return target


def merge_gemm_dtype(
    target: Calibration, dtype: str, points: Sequence[GemmPoint], measured_on: str = ""
) -> Calibration:
    """``target`` with ``points`` as its GEMM profile in ``dtype`` (``gemm_dtypes``, replacing one
    there), each recording ``measured_on`` (a sibling's device key; "": ``target``'s GPU)."""
    kept = [dataclasses.replace(p, measured_on=measured_on) for p in points]
    target.gemm_dtypes = {**target.gemm_dtypes, dtype: kept}
    return target
