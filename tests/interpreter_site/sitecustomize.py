"""Makes Triton's CPU interpreter cheaper for the test processes, and decodes fp8 NaN codes as the GPU does.

Triton's interpreter (3.6-3.7) re-patches ``triton.language`` on every call of a ``@triton.jit``
device function (``_patch_lang``), and each patch lists the modules' members with
``inspect.getmembers``: ~1.3 ms per call. fo-tune's GEMM calls ~300 small device functions per
launch, so on the CPU that listing is ~35% of an op's interpreter time (cProfile of
``gemm_all_reduce`` 64x96x64 on 2 gloo ranks: 0.42 of 1.14 s; CPU time per call ~360 -> ~220 ms).

Here ``_patch_builtin`` keeps, per module, the list of builtins it saw the first time (before any
patch) and patches those of them that are still builtins, exactly the members the original
patches; only the listing is cached. And a device function called inside a launch skips the
patch that the launch made already (``_skip_nested_patches``; another ~12% of the GEMM tests'
interpreter time). The test setup (``tests/conftest.py``) puts this folder on
``PYTHONPATH``, so Python runs this file at the start of every process the tests start (pytest's
workers, gloo ranks, CLI subprocesses); it acts only once ``triton.runtime.interpreter`` is
imported, and leaves Triton as it is where its internals differ from what it expects.

One conversion is corrected rather than sped up (``_fp8_nan_codes``): the interpreter decodes
float8_e4m3fn by its bits alone, so its NaN codes (0x7F, 0xFF; the format has no inf) read as
+-480 where the GPU's conversion, and torch's, give NaN; a NaN in an fp8 operand would vanish
from a CPU test of the kernels while it reaches the output on the GPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

INTERPRETER = "triton.runtime.interpreter"


def speed_up(interpreter: ModuleType) -> bool:
    """Replace ``interpreter._patch_builtin`` by its cached twin; False (nothing changed) when the
    module lacks what the twin calls."""
    import inspect

    tl = getattr(interpreter, "tl", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if tl is None or patch_attr is None or not hasattr(interpreter, "_patch_builtin"):
        return False
    is_builtin = tl.core.is_builtin
    seen: dict[int, tuple[Any, list[str]]] = {}

    def _patch_builtin(pkg: Any, builder: Any, scope: Any) -> None:
        entry = seen.get(id(pkg))
        if entry is None or entry[0] is not pkg:
            entry = seen[id(pkg)] = (pkg, [n for n, m in inspect.getmembers(pkg) if is_builtin(m)])
        for name in entry[1]:
            member = getattr(pkg, name, None)
            if is_builtin(member):  # (a member this scope or an outer one patched already stays)
                patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = _patch_builtin
    _skip_nested_patches(interpreter)
    _fp8_nan_codes(interpreter)
    return True


def _fp8_nan_codes(interpreter: ModuleType) -> None:
    """Make the interpreter's float conversion (``_convert_float``: loads cast up, and ``tl.dot`` of
    fp8 blocks, which it runs in float16) give NaN for float8_e4m3fn's NaN codes, as the GPU does;
    every other code converts as before."""
    import numpy as np

    convert = getattr(interpreter, "_convert_float", None)
    if convert is None:
        return

    def _convert_float(input: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> Any:
        out = convert(input, input_dtype, output_dtype, rounding_mode)
        # (by name: triton.language is still being imported when this is installed)
        if getattr(input_dtype, "name", None) != "fp8e4nv" or output_dtype.primitive_bitwidth <= 8:
            return out
        codes = np.frombuffer(input.tobytes(), dtype=np.uint8).reshape(out.shape)
        nan = (codes & 0x7F) == 0x7F
        if not nan.any():
            return out
        mantissa = output_dtype.fp_mantissa_width
        exponent = output_dtype.primitive_bitwidth - mantissa - 1
        quiet_nan = (((1 << exponent) - 1) << mantissa) | (1 << (mantissa - 1))
        return np.where(nan, np.array(quiet_nan, dtype=out.dtype), out)

    interpreter._convert_float = _convert_float


def _skip_nested_patches(interpreter: ModuleType) -> None:
    """A device function called inside a launch finds ``triton.language`` patched by the launch
    already (the patches are on the shared module objects, undone when the launch ends), so its
    own ``_patch_lang`` is skipped when it would patch no module the launch did not. Per thread,
    as the launch's own state is."""
    import inspect
    import threading

    executor = getattr(interpreter, "GridExecutor", None)
    patch_lang, scope_type = (
        getattr(interpreter, "_patch_lang", None),
        getattr(interpreter, "_LangPatchScope", None),
    )
    if executor is None or patch_lang is None or scope_type is None:
        return
    tl = interpreter.tl
    state = threading.local()
    langs_of: dict[Any, frozenset[int]] = {}

    def langs(fn: Any) -> frozenset[int]:
        got = langs_of.get(fn)
        if got is None:
            got = langs_of[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
            )
        return got

    def _patch_lang(fn: Any) -> Any:
        done = getattr(state, "patched", None)
        if done is not None and langs(fn) <= done:
            return scope_type()  # (nothing to undo)
        scope = patch_lang(fn)
        if getattr(state, "depth", 0) > 0:
            state.patched = (done or frozenset()) | langs(fn)
        return scope

    launch = executor.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(state, "patched", None)
        state.patched, state.depth = None, getattr(state, "depth", 0) + 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.patched, state.depth = outer, state.depth - 1

    interpreter._patch_lang = _patch_lang
    executor.__call__ = __call__


class _WhenImported(importlib.abc.MetaPathFinder):
    """Calls ``speed_up`` on the interpreter module right after Python executes it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != INTERPRETER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, run = spec.loader, spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            speed_up(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Speed up the interpreter now if it is loaded, else as soon as it is."""
    if INTERPRETER in sys.modules:
        speed_up(sys.modules[INTERPRETER])
    elif not any(isinstance(f, _WhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported())


install()
