"""The calibrate stage: measure one machine and keep what the model reads.

    run_calibration(request, reporter) -> Calibration        (``run``: the measurements, on the ranks)
    write_calibration_dir(cal, out_dir)                      (``files``: CSVs, YAML, plots, all or nothing)
    load_calibration(path), find_calibration(key, world)     (``calibration``, ``find``)

Modules: ``calibration`` (the dataclasses and the YAML format), ``run`` (``fo-tune calibrate`` as a
library call), ``profile`` (``fo-tune profile``: one shape's tiles beside cuBLAS), ``files`` and
``plots`` (writing it), ``find`` (this machine's, the packaged one, the one a search reads),
``missing`` (a predicting search's refusal of a calibration that lacks a measurement, with the
commands that add it),
``extrapolate`` (a calibration for a larger world size on the same NVLink board, for offline plans). Each
engine's own part of the calibration lives with the engine (``fo_tune.engines.copy_engine.calibrate``).
"""
