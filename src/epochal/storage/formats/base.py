"""The db backend interface and the ``db_type`` registry.

A backend stores one db (the blobs of one node at one epoch) at a path: ``write``, ``read``,
``exists``, ``describe``, ``digest`` and ``verify`` for the checkpoint layer, and ``stat``,
``check`` and ``sniff`` for tools (the CLI inspects any db through these alone). Backends
are picked by name (the seed's ``db_type``) from a registry, as fsspec picks filesystems by
protocol; :func:`sniff_db_type` asks every registered backend which one wrote a file. A
backend's bytes go through the byte-store seam of :mod:`epochal.storage.io`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import CheckpointCorruptError, CheckpointError
from ..io.extents import open_db
from ..io.progress import IO_PROGRESS, report_progress
from ..io.seam import store_for

__all__ = [
    "IO_PROGRESS",
    "BlobInfo",
    "DbBackend",
    "DbProblem",
    "DbStat",
    "ReadStats",
    "available_db_types",
    "error_line",
    "get_db_type",
    "register_db_type",
    "report_progress",
    "sniff_db_type",
]

#: bytes of a file's head that :meth:`DbBackend.sniff` is shown
SNIFF_BYTES = 16


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


@dataclass(frozen=True)
class DbStat:
    """A header-level summary of one db (no blob data read): what ``epochal inspect`` shows
    first. Fields a format does not record are None."""

    path: str
    db_type: str
    file_bytes: int
    blob_count: int
    data_bytes: int
    digest: str | None = None
    format_version: str | None = None
    checksum_algorithm: str | None = None


def error_line(e: BaseException, path: str) -> str:
    """One line about ``e`` (its first line; an OSError's file and reason) that names ``path``."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, OSError) and not isinstance(e, CheckpointError):
        text = f"{getattr(e, 'filename', None) or path}: {e.strerror or e}"
    if path not in text:
        text = f"{path}: {text}"
    return text


@dataclass(frozen=True)
class DbProblem:
    """One problem :meth:`DbBackend.check` found: the file, the blob at fault (None when the
    damage is in a header or the file cannot be read) and what is wrong."""

    path: str
    blob: str | None
    message: str

    @classmethod
    def of(cls, e: BaseException, path: str, blob: str | None = None) -> DbProblem:
        """The problem an exception describes, its message without the "path, blob: " prefix."""
        if isinstance(e, CheckpointCorruptError):
            text = str(e)
            where = e.path + (f", blob {e.blob!r}" if e.blob is not None else "")
            message = text[len(where) + 2 :] if text.startswith(where + ": ") else text
            return cls(e.path, e.blob if e.blob is not None else blob, message)
        return cls(path, blob, error_line(e, path))


@dataclass
class ReadStats:
    """Filled in by ``read`` when passed: bytes read and blobs loaded."""

    nbytes: int = 0
    blobs: int = 0


class DbBackend(abc.ABC):
    """One storage format for a node's db. Subclasses register themselves with
    :func:`register_db_type`."""

    name: str = "?"
    #: ``read(verify=True)`` checks every checksum of what it reads before any value is
    #: decoded or live object touched, as :meth:`verify` would: a resume may then skip the
    #: separate full check and read the checkpoint once
    load_verifies: bool = False
    #: ``read(existing=...)`` checks every live object it restores with
    #: :func:`~epochal.storage.encoding.fit.check_all_live` before touching any (with the index it
    #: opened): a loader may then skip its own check, one more open and parse of the db
    checks_live: bool = False

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

    def check(self, path: str) -> list[DbProblem]:
        """Re-check every checksum and return every problem found (empty: intact), each
        naming the file and blob; never raises for damage or an unreadable file. The default
        reports the first problem :meth:`verify` raises; formats that can go on past a damaged
        blob report each one."""
        try:
            self.verify(path)
        except (CheckpointError, OSError, ValueError) as e:
            return [DbProblem.of(e, path)]
        return []

    def stat(self, path: str) -> DbStat:
        """Header-level summary: sizes, counts and digest (no blob data read). The default
        builds it from :meth:`describe` and :meth:`digest`."""
        infos = self.describe(path)
        src = open_db(path)
        try:
            size = src.size()
        finally:
            src.close()
        return DbStat(path, self.name, size, len(infos), sum(i.nbytes for i in infos), self.digest(path))

    def sniff(self, head: bytes, size: int) -> bool:
        """True when a file starting with ``head`` (its first SNIFF_BYTES bytes, fewer for a
        short file) and ``size`` bytes long looks written by this backend. From the head
        alone: cheap, and a True is confirmed by opening the file."""
        return False


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


def sniff_db_type(path: str) -> str | None:
    """The db_type that wrote the file at ``path``, from its head (None: no registered
    backend recognises it, e.g. an empty file). CheckpointNotFoundError when it is missing;
    OSError when it cannot be read."""
    src = open_db(path, what="db")
    try:
        size = src.size()
        head = src.read(SNIFF_BYTES, 0)
    finally:
        src.close()
    for name in available_db_types():
        if get_db_type(name).sniff(head, size):
            return name
    return None


def available_db_types() -> list[str]:
    for builtin in _BUILTINS:
        _load_builtin(builtin)
    return sorted(_registry)


_BUILTINS = {"native": "epochal.storage.formats.native", "safetensors": "epochal.storage.formats.safetensors_db"}


def _load_builtin(name: str) -> None:
    module = _BUILTINS.get(name)
    if module is not None:
        import importlib

        try:
            importlib.import_module(module)
        except ImportError:
            pass
