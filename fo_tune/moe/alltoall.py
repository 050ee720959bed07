"""The All-to-All the MoE model reads: the calibration's own curve, else one derived from another
collective's curve, with a ``basis`` saying which.

Sizes follow nccl-tests (``fo_tune.calibrate.calibration``): an All-to-All of ``size`` bytes is
each rank's whole send buffer, of which (w - 1) / w crosses its links. The derivations match the
bytes each rank moves over its links:

    all_to_all      its own curve (measured with uneven splits, 1 : 2 : ... : w shares)
    all_gather      the same size: (w - 1) / w x size on each rank's links (nccl-tests' bus factor
    reduce_scatter  (n - 1) / n for all three); a ReduceScatter also adds, so it is an upper bound
    all_reduce      half the size: its bus factor is 2 (n - 1) / n

and never faster than the NVLink wire (``NVLINK_GBS``) where the fingerprint says NVLink. A step
of the Triton ring moves one peer's rows: ``step_ms(b)`` prices ``b`` bytes to one peer as an
All-to-All whose (w - 1) / w share is ``b`` (on NVSwitch machines one peer's traffic reaches the
GPU's whole link bandwidth; at w = 2 it is the All-to-All itself).
"""

from __future__ import annotations

from dataclasses import dataclass

from fo_tune.calibrate.calibration import Calibration, CalibrationError
from fo_tune.calibrate.missing import missing_curves
from fo_tune.model.profiles import Curves

# NVLink per direction on H100 / H200 (NV18: 18 links x 25 GB/s; the design brief's "What others
# reach at TP=4/8 on Hopper": 450 GB/s per direction, a copy-engine peer copy ~380 GB/s one way on
# H100). The wire floor of a derived curve: no collective moves bytes faster than this.
NVLINK_GBS = 450.0
# The curves an All-to-All is derived from, in order of preference, with the size each is read at
# (its bus bytes equal to the All-to-All's: see the module docstring).
DERIVED_FROM = (("all_gather", 1.0), ("reduce_scatter", 1.0), ("all_reduce", 0.5))


@dataclass(frozen=True, slots=True)
class AllToAllCurve:
    """An All-to-All's time per size on one calibration (see the module docstring)."""

    curves: Curves
    source: str  # the collective whose curve is read
    scale: float  # the size it is read at, over the All-to-All's
    world_size: int
    wire_gbs: float  # the wire floor's bandwidth (0: none)
    basis: str

    def time(self, nbytes: int, cap: int = 0) -> float:
        """ms of an All-to-All of ``nbytes`` (each rank's send buffer; 0 bytes: no call)."""
        if nbytes <= 0 or self.world_size < 2:
            return 0.0
        t = self.curves.time(self.source, cap, max(1, round(nbytes * self.scale)))
        if self.wire_gbs > 0:
            wire = nbytes * (self.world_size - 1) / self.world_size / (self.wire_gbs * 1e6)
            t = max(t, wire)
        return t

    def step_ms(self, nbytes: int, cap: int = 0) -> float:
        """ms of one ring step moving ``nbytes`` to one peer."""
        if nbytes <= 0 or self.world_size < 2:
            return 0.0
        return self.time(round(nbytes * self.world_size / (self.world_size - 1)), cap)


def all_to_all_curve(cal: Calibration) -> AllToAllCurve:
    """The All-to-All of ``cal``: its own curve, else derived (``DERIVED_FROM``); a
    ``CalibrationError`` naming the command that measures it when ``cal`` has no curve at all."""
    curves = Curves(cal)
    nvlink = cal.fingerprint.interconnect.startswith("nvlink")
    wire = NVLINK_GBS if nvlink else 0.0
    if curves.knows("all_to_all"):
        return AllToAllCurve(
            curves, "all_to_all", 1.0, cal.world_size, 0.0, "all_to_all: the calibration's curve"
        )
    for name, scale in DERIVED_FROM:
        if curves.knows(name):
            size = "the same size" if scale == 1.0 else f"{scale:g} x the size"
            floor = f", at most NVLink's {NVLINK_GBS:g} GB/s a direction" if nvlink else ""
            basis = f"all_to_all from the {name} curve ({size}: the same bytes on each rank's links{floor})"
            return AllToAllCurve(curves, name, scale, cal.world_size, wire, basis)
    raise CalibrationError(missing_curves(cal, ["all_to_all"]))
