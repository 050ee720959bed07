"""``Registry``: plug-ins registered by exact name as ``"module:attribute"`` strings, imported on
first use. One helper serves every registry of both packages (the runtime's engines, the tuner's
engine plug-ins, the search's strategies), so each says what it holds in one mapping and an unknown
name is refused the same way everywhere."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from fo_kernels.errors import install_hint


class Registry:
    """Names mapped to ``"module:attribute"`` (or a module with ``attribute`` given on load).

    ``kind`` starts the error for an unknown name (``"engine:"`` gives "engine: 'x' is not one of
    a, b"); ``error`` is the exception type raised; ``extra`` maps a name to the pip extra its
    module needs, named when its import fails."""

    def __init__(
        self,
        kind: str,
        entries: Mapping[str, str],
        *,
        error: type[Exception] = ValueError,
        extra: Mapping[str, str] | None = None,
    ) -> None:
        self.kind = kind
        self._entries = dict(entries)
        self._error = error
        self._extra = dict(extra or {})

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def check(self, name: object) -> str:
        """``name`` when it is registered; else the registry's error listing the valid names."""
        if not isinstance(name, str) or name not in self._entries:
            raise self._error(f"{self.kind} {name!r} is not one of {', '.join(self.names())}")
        return name

    def where(self, name: object) -> str:
        """The ``"module[:attribute]"`` string registered as ``name``."""
        return self._entries[self.check(name)]

    def load(self, name: object, attribute: str | None = None) -> Any:
        """Import the module registered as ``name`` and return its registered attribute, or its
        ``attribute`` (an attribute or a submodule) when one is given."""
        module, _, registered = self.where(name).partition(":")
        try:
            loaded = importlib.import_module(module)
        except ImportError as exc:
            extra = self._extra.get(str(name))
            if extra is None:
                raise
            raise ImportError(f"{self.kind} {name!r} needs {install_hint(extra)} ({exc})") from exc
        wanted = attribute or registered
        if not wanted:
            return loaded
        if not hasattr(loaded, wanted):  # a submodule not imported yet
            importlib.import_module(f"{module}.{wanted}")
        return getattr(loaded, wanted)
