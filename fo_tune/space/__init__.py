"""Search spaces: what the tuner and the calibration explore on one GPU family.

This module owns the format of ``search_spaces/*.yaml``, its validation and the choice of file for
a device. A file (``schema_version: 2``, ``kind: fo-tune-search-space``)::

    name: hopper
    compute_capability: ["9.0"]
    tiles: [...]          # GEMM tile candidates: the Triton engine's, the copy engine's tiled
                          # mode's and the calibration's tile profiles
    dtype_tiles:          # optional: an operand dtype whose candidates differ, and its own list,
      float8_e4m3fn: [...]  # which replaces `tiles` for it (1-byte operands afford deeper K tiles)
    engines:              # one section per engine plug-in (fo_tune.engines), by its exact name;
      triton: {...}       # an engine left out is not searched
      copy_engine: {...}
    calibration: {...}    # what `fo-tune calibrate` measures (full and --quick)
    cpu: {...}            # tiny sizes for runs on the CPU (gloo and the Triton interpreter)

Each engine validates its own section (``EngineTuner.read_space``); an unknown engine names the
valid ones. A schema-1 file (the Triton keys ``sms_free`` ... ``wait_modes`` and the
``copy_engine_*`` lists at the top level) is read into the same structure; its removed
``copy_engine_exchange_chunks`` is refused with what to do. ``SearchSpace`` methods return the
effective candidates for CPU vs GPU and quick vs full.

``space_for(cc)`` loads every ``*.yaml`` of a folder and returns the one whose
``compute_capability`` list names ``cc`` (``"9.0"``), else the catch-all (``["*"]``, the shipped
``default.yaml``); ``"cpu"`` gets the catch-all too. Every error is a ``SpaceError`` whose message
starts with the file and the key path (``search_spaces/x.yaml: engines.triton.sms_free[3]: ...``).
"""

from fo_tune.space import core, files
from fo_tune.space.core import *  # noqa: F403  (its __all__: the types and readers)
from fo_tune.space.files import *  # noqa: F403  (its __all__: loading, the file for a device)

__all__ = [*core.__all__, *files.__all__]
