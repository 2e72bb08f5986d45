"""Workspaces: the name -> value stores that tasks work on.

A child workspace (``Workspace(parent=ws)``) sees its parents' blobs: reading or writing a name
that a parent holds goes to that parent and persists; a new name lives in the child only and
vanishes with it. That is how PRIVATE tasks update global state while their scratch disappears.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

from ..errors import MissingBlobError


class Workspace(MutableMapping[str, Any]):
    """A mapping of blob name (str) to value, optionally backed by a parent workspace."""

    def __init__(self, parent: Workspace | None = None) -> None:
        self.parent = parent
        self._blobs: dict[str, Any] = {}

    def _owner(self, name: str) -> Workspace | None:
        ws: Workspace | None = self
        while ws is not None:
            if name in ws._blobs:
                return ws
            ws = ws.parent
        return None

    def __getitem__(self, name: str) -> Any:
        owner = self._owner(name)
        if owner is None:
            raise MissingBlobError(f"blob {name!r} is not in the workspace")
        return owner._blobs[name]

    def __setitem__(self, name: str, value: Any) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"blob names are non-empty strings, got {name!r}")
        (self._owner(name) or self)._blobs[name] = value

    def __delitem__(self, name: str) -> None:
        owner = self._owner(name)
        if owner is None:
            raise MissingBlobError(f"blob {name!r} is not in the workspace")
        del owner._blobs[name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._owner(name) is not None

    def _visible(self) -> list[str]:
        names: set[str] = set()
        ws: Workspace | None = self
        while ws is not None:
            names.update(ws._blobs)
            ws = ws.parent
        return sorted(names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._visible())

    def __len__(self) -> int:
        return len(self._visible())

    def __repr__(self) -> str:
        return f"Workspace({self.blobs!r}{', parent' if self.parent is not None else ''})"

    @property
    def blobs(self) -> list[str]:
        """Sorted names this workspace holds itself (not its parents')."""
        return sorted(self._blobs)

    def has_blob(self, name: str) -> bool:
        return name in self

    def fetch_blob(self, name: str) -> Any:
        return self[name]

    def feed_blob(self, name: str, value: Any) -> None:
        self[name] = value
