"""A calibration for a world size no machine here has measured: derived from a measured one of a
smaller world size on the same NVLink board and stated NVLink facts (``extrapolate``), for offline
plans (``fo-tune search --mode predict --world-size 4|8``). It owns the facts and the rule.

What changes with N, per collective bandwidth point (size S, time t at the measured world size W):

    t_N(S) = t_W(S) + (steps(N) - steps(W)) x RING_HOP_LATENCY_MS
                    + S x (bus(N) - bus(W)) / busbw_W          (busbw_W capped at the NVLink link)

- ``bus``: nccl-tests' bus factor (``bus_factor``: 2(n-1)/n for AllReduce, (n-1)/n for the others):
  the bytes each GPU moves over its link per byte of buffer. ``busbw_W``: the curve's asymptotic
  bus bandwidth at W (its fit's algbw x bus(W)). On an NVSwitch board every GPU pair runs at the
  full per-GPU NVLink bandwidth, so a ring's hops are as fast at N as at W and busbw carries over;
  it cannot exceed one direction of the GPU's NVLink (``nvlink_gbs``).
- ``steps``: a ring's steps (NCCL's latency model: 2(n-1) for AllReduce, n-1 for ReduceScatter and
  AllGather); each one more costs NCCL's per-hop NVLink latency.
- AllGather, where W measured none, takes ReduceScatter's curve: a ring AllGather moves the same
  bytes in the same steps (the reduction aside), and nccl-tests sizes both by the full buffer.

Carried unchanged, because one GPU measures them whatever N is: the GEMM tile profile (``gemm``,
``gemm_dtypes``), the interference table (NCCL's CTAs beside the GEMM: the same channels and CTA cap
at any N), the engine sections (``copy_engine``: library GEMM chunks, peer copies at one GPU's link
speed, flags, host times; ``triton``: host times) and any field the ``Calibration`` type grows for
measurements per world size (``dataclasses.replace`` keeps every field it is not given).

The result's fingerprint is the board's at N (``device_key`` ``...-w<N>-nvlink18``), and ``basis``
says what it rests on (naming the sibling GPU whose copy-engine points at N peers were merged with
``--into-sibling``, if any); every row a search writes from it carries that ``basis`` (in another
dtype, ``Calibration.for_dtype`` adds the GPU its GEMM profile was measured on, where a sibling).
"""

from __future__ import annotations

import dataclasses
import re

from fo_kernels.fingerprint import make_device_key
from fo_tune.calibrate.calibration import (
    BandwidthPoint,
    Calibration,
    CalibrationError,
    bus_factor,
    fit_all,
)

# NVLink 4 (Hopper, compute capability 9.0: H100 / H200 SXM): 18 links, 900 GB/s a GPU both
# directions together, so 25 GB/s a link a direction (NVIDIA H100 and H200 datasheets; the Hopper
# architecture whitepaper, "fourth-generation NVLink"). docs/design.md's brief: 450 GB/s a direction.
NVLINK4_LINK_GBS = 25.0
NVLINK4_CAPABILITY = "9.0"
# GPUs of one HGX H100 / H200 board: 8, all on NVSwitch (four NVSwitch chips), every pair at the full
# per-GPU NVLink bandwidth (NVIDIA DGX H100 / HGX H200 system documentation). Beyond 8 the ranks
# span boards and the network: not extrapolated.
NVSWITCH_BOARD_GPUS = 8
# NCCL's ring latency per step on NVLink with the Simple protocol, 3.4 us (src/graph/tuning.cc,
# hwLat[NCCL_HW_NVLINK][NCCL_ALGO_RING][NCCL_PROTO_SIMPLE], the same in the NCCL 2.x releases read;
# LL 0.6, 0.47 in older ones; LL128 1.9): the protocol of the MiB-sized buffers a layer's collective
# moves. For buffers small enough for LL it over-counts by at most 2.8 us a step.
RING_HOP_LATENCY_MS = 0.0034
# How a basis names a collective's curve taken from reduce_scatter's ("all_gather" + this).
DERIVED_CLAUSE = " from reduce_scatter's curve"
# The ``interconnect`` of a fingerprint with NVLink: ``nvlink<active links>``.
_NVLINK = re.compile(r"^nvlink(\d+)$")


class ExtrapolationError(CalibrationError):
    """A calibration that cannot be extrapolated to the world size asked for; says what is needed."""


def ring_steps(collective: str, world_size: int) -> int:
    """Steps of NCCL's ring for ``collective`` on ``world_size`` ranks (its latency model)."""
    if world_size <= 1:
        return 0
    return 2 * (world_size - 1) if collective == "all_reduce" else world_size - 1


def nvlink_gbs(cal: Calibration) -> float:
    """One direction of a GPU's NVLink (GB/s) on the calibration's machine; ``ExtrapolationError``
    where it is not NVLink 4 with its link count in the fingerprint."""
    fp = cal.fingerprint
    match = _NVLINK.match(fp.interconnect)
    if match is None or int(match.group(1)) < 1 or fp.compute_capability != NVLINK4_CAPABILITY:
        raise ExtrapolationError(
            f"extrapolating needs a calibration of NVLink 4 GPUs on NVSwitch (compute capability "
            f"{NVLINK4_CAPABILITY}, interconnect nvlink<links>); {fp.device_key} has compute capability "
            f"{fp.compute_capability}, interconnect {fp.interconnect}"
        )
    return int(match.group(1)) * NVLINK4_LINK_GBS


def basis_text(cal: Calibration, derived: tuple[str, ...] = ()) -> str:
    """What an extrapolation of ``cal`` rests on, as rows and reports say it: with the GPUs that
    measured its copy engine at N peers where they are another model than ``cal``'s (the points'
    ``measured_on``, merged with ``--into-sibling``)."""
    text = f"extrapolated from world size {cal.world_size} ({cal.fingerprint.device_key}) and NVLink facts"
    for name in derived:
        text += f"; {name}{DERIVED_CLAUSE}"
    siblings = sibling_devices(cal)
    if siblings:
        text += f"; copy-engine host and chunk-GEMM terms at N peers measured on {', '.join(siblings)}"
    return text


def basis_for(basis: str, collective: str) -> str:
    """``basis`` (a calibration's) as a row or report of ``collective`` states it: without the
    clause of a curve derived for another collective ("all_gather from reduce_scatter's curve"
    is what an all_gather plan rests on, not an all_reduce or reduce_scatter one)."""
    clauses = basis.split("; ") if basis else []
    derived = {c: c.removesuffix(DERIVED_CLAUSE) for c in clauses if c.endswith(DERIVED_CLAUSE)}
    return "; ".join(c for c in clauses if derived.get(c, collective) == collective)


def sibling_devices(cal: Calibration) -> tuple[str, ...]:
    """The device keys (sorted) that measured points of ``cal``'s copy-engine section other than
    its own GPU model (``measured_on``)."""
    section = cal.copy_engine
    if section is None:
        return ()
    keys = {p.measured_on for p in [*section.host, *section.library_gemm] if p.measured_on}
    return tuple(sorted(keys))


def _scaled_points(cal: Calibration, world_size: int, link_gbs: float) -> list[BandwidthPoint]:
    """Every bandwidth point of ``cal`` at ``world_size`` (the module docstring's rule)."""
    out = []
    for p in cal.bandwidth:
        fit = cal.fit_for(p.collective, p.nccl_max_ctas)
        algbw = fit.bandwidth_gbs if fit is not None and fit.bandwidth_gbs > 0 else p.algbw_gbs
        busbw = min(algbw * bus_factor(p.collective, cal.world_size), link_gbs)
        extra_bus = bus_factor(p.collective, world_size) - bus_factor(p.collective, cal.world_size)
        steps = ring_steps(p.collective, world_size) - ring_steps(p.collective, cal.world_size)
        time_ms = p.time_ms + steps * RING_HOP_LATENCY_MS + p.size_bytes * extra_bus / (busbw * 1e6)
        out.append(
            BandwidthPoint.measured(
                p.collective, p.nccl_max_ctas, p.size_bytes, time_ms, p.spread_ms, world_size
            )
        )
    return out


def extrapolate(cal: Calibration, world_size: int) -> Calibration:
    """``cal`` (measured at a smaller world size on an NVLink 4 NVSwitch board) as the calibration of
    ``world_size`` GPUs of that board (the module docstring); ``ExtrapolationError`` saying what is
    needed where it cannot be."""
    if cal.basis:
        raise ExtrapolationError(
            f"the calibration is itself extrapolated ({cal.basis}); start from a measured one"
        )
    if not 2 <= cal.world_size < world_size <= NVSWITCH_BOARD_GPUS:
        raise ExtrapolationError(
            f"cannot extrapolate a calibration of world size {cal.world_size} to {world_size}: an "
            f"extrapolation goes from a measured world size >= 2 to a larger one of at most "
            f"{NVSWITCH_BOARD_GPUS} GPUs (one NVSwitch board); for {world_size} GPUs run `fo-tune "
            f"calibrate --world-size {world_size}` on them and pass that --calibration FILE"
        )
    link_gbs = nvlink_gbs(cal)
    if not cal.bandwidth:
        raise ExtrapolationError(
            f"the calibration ({cal.fingerprint.device_key}) has no bandwidth curve to extrapolate; "
            f"measure one with `fo-tune calibrate --world-size {cal.world_size}`"
        )
    points = _scaled_points(cal, world_size, link_gbs)
    have = {p.collective for p in points}
    derived: tuple[str, ...] = ()
    if "all_gather" not in have and "reduce_scatter" in have:
        scatter = [p for p in points if p.collective == "reduce_scatter"]
        points += [dataclasses.replace(p, collective="all_gather") for p in scatter]
        derived = ("all_gather",)
    fp = cal.fingerprint
    key = make_device_key(fp.gpu_name, fp.compute_capability, fp.sm_count, world_size, fp.interconnect)
    return dataclasses.replace(
        cal,
        fingerprint=dataclasses.replace(fp, world_size=world_size, device_key=key),
        world_size=world_size,
        bandwidth=points,
        fits=fit_all(points),
        basis=basis_text(cal, derived),
        file="",  # (read from no file: its device key names none; the refusals name ``origin``'s)
        origin=cal,
    )
