"""The one guard every shim uses: fail loudly when the upstream line a shim works around is no longer there, so an
upgrade stops at the shim instead of misbehaving."""

from __future__ import annotations

import inspect
from pathlib import Path


class ShimOutdated(RuntimeError):
    """An upstream line a shim works around has changed: re-check the shim (named in the message)."""


def expect_source(obj, snippet: str, shim: str) -> None:
    """`obj`'s source (a function, class or module) must still contain `snippet`; `shim` names the shim and the
    version it is written for."""
    if snippet not in inspect.getsource(obj):
        raise ShimOutdated(f"{shim}: {obj.__module__}.{getattr(obj, '__qualname__', obj)} no longer contains "
                           f"{snippet!r}")


def expect_text(path: Path, snippet: str, shim: str) -> None:
    """expect_source for a file that must not be imported before its shim is in place (read from disk)."""
    if not path.exists() or snippet not in path.read_text(encoding="utf-8"):
        raise ShimOutdated(f"{shim}: {path} no longer contains {snippet!r}")
