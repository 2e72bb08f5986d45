"""The db backend interface and the ``db_type`` registry.

A backend stores one db (the blobs of one node at one epoch) at a path. It is small on
purpose: ``write``, ``read``, ``exists``, ``describe`` and ``verify``. Backends are picked by
name (the seed's ``db_type``) from a registry, as fsspec picks filesystems by protocol.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError
from .io.seam import store_for

#: A callback ``fn(nbytes_done_increment)`` that backends call as data moves (per segment or
#: chunk) during a write or read; set by progress displays. None: no progress reporting.
IO_PROGRESS: ContextVar[Callable[[int], None] | None] = ContextVar("epochal_io_progress", default=None)


def report_progress(nbytes: int) -> None:
    """Tell the active progress display (if any) that ``nbytes`` more were written or read."""
    cb = IO_PROGRESS.get()
    if cb is not None:
        cb(nbytes)


@dataclass(frozen=True)
class BlobInfo:
    """What a db says about one blob, without reading its data."""

    name: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    nbytes: int
    checksum: str | None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass
class ReadStats:
    """Filled in by ``read`` when passed: bytes read and blobs loaded."""

    nbytes: int = 0
    blobs: int = 0


class DbBackend(abc.ABC):
    """One storage format for a node's db. Subclasses register themselves with
    :func:`register_db_type`."""

    name: str = "?"

    @abc.abstractmethod
    def write(self, path: str, blobs: Mapping[str, Any]) -> int:
        """Write every blob to ``path`` atomically (a crash leaves the old file or none, never a
        partial one) and durably; return the bytes written. Creates or replaces the file; the
        parent directory must exist."""

    @abc.abstractmethod
    def read(
        self,
        path: str,
        names: Sequence[str] | None = None,
        *,
        allow_incomplete: bool = False,
        existing: Mapping[str, Any] | None = None,
        verify: bool = True,
        stats: ReadStats | None = None,
    ) -> dict[str, Any]:
        """Read ``names`` (all when None) from the db at ``path``.

        A name missing from the db raises :class:`~epochal.errors.MissingBlobError` naming the file
        and blob, unless ``allow_incomplete`` (then it is skipped). ``existing`` maps names to
        live objects that codecs may restore in place. Every checksum is verified before any
        value is decoded, unless ``verify`` is False."""

    def exists(self, path: str) -> bool:
        """True when the db can be opened for reading (asks the path's byte store)."""
        return store_for(path).exists(path)

    @abc.abstractmethod
    def describe(self, path: str) -> list[BlobInfo]:
        """The blobs of the db, in file order, from its index alone."""

    def digest(self, path: str) -> str | None:
        """A cheap identity of the db's content (read from its header, not its data), recorded
        in manifests; None when the backend has none."""
        return None

    def verify(self, path: str) -> None:
        """Re-check every checksum; raise :class:`~epochal.errors.CheckpointCorruptError`
        naming the file and blob on the first damage."""
        self.read(path)


_registry: dict[str, Callable[[], DbBackend]] = {}
_instances: dict[str, DbBackend] = {}


def register_db_type(name: str, factory: Callable[[], DbBackend]) -> None:
    """Make ``db_type=name`` use the backend that ``factory()`` builds."""
    _registry[name] = factory
    _instances.pop(name, None)


def get_db_type(name: str) -> DbBackend:
    """The backend registered under ``name``; CheckpointError listing the known ones otherwise."""
    if not name:
        raise CheckpointError("db_type must not be empty")
    if name not in _registry:
        _load_builtin(name)
    if name not in _registry:
        raise CheckpointError(f"unknown db_type {name!r} (known: {', '.join(sorted(_registry))})")
    if name not in _instances:
        _instances[name] = _registry[name]()
    return _instances[name]


def available_db_types() -> list[str]:
    for builtin in _BUILTINS:
        _load_builtin(builtin)
    return sorted(_registry)


_BUILTINS = {"native": "epochal.storage.native", "safetensors": "epochal.storage.safetensors_db"}


def _load_builtin(name: str) -> None:
    module = _BUILTINS.get(name)
    if module is not None:
        import importlib

        try:
            importlib.import_module(module)
        except ImportError:
            pass
