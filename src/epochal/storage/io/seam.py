"""The byte-level seam under every format: where a db file's bytes come from and go to.

A format (``native``, ``safetensors``) decides *what* the bytes are; a byte store decides
*where* they live and *how* they are moved. Formats only ever call these methods, never
``os.*``, so a second kind of store (object storage through fsspec) goes behind the same
seam without touching a format. Style after PyTorch DCP's ``StorageWriter``/``StorageReader``
(the docstrings give the call order) and torchsnapshot's ``StoragePlugin``.

Reading — a :class:`ByteSource` is expected to see this sequence of calls::

    src = store.open_read(path)     # CheckpointNotFoundError naming the path when absent
    src.size()                      # total bytes, once, before any read
    src.read(nbytes, offset)        # } any number, any order, from several threads at once
    src.read_into(views, offset)    # }
    src.map()                       # optional: a read-only map of the whole file, or None
    src.hint(offset, nbytes)        # optional: "these bytes are wanted soon"
    src.close()                     # once; maps already handed out stay valid

Writing — a :class:`ByteSink` is expected to see::

    sink = store.create(path, size)  # nothing is visible under ``path`` yet
                                     # (optional ``store.create_pinned(path, size)``: the
                                     # same, for data written with ``write_pinned``)
    sink.write(buffer_or_buffers)    # any number: an append-only stream, in file order
    sink.patch(offset, data)         # optional, after the last write: fill in a header
    sink.commit()                    # durable: ``path`` is now the whole new file
    # or sink.abort() on any error:  ``path`` keeps its old content (or stays absent)

A crash or an exception anywhere before ``commit`` returns leaves the previous file (or
none) under ``path``, never a partial one.

The fsspec store (:mod:`.fsspec_store`): ``size`` is ``fs.info(path)["size"]`` (a HEAD);
``read`` and ``read_into`` are ranged reads (``fs.cat_file(path, start, end)`` copied into the
views; thread-safe because each call is its own request; the first read also fetches the
object's tail, or a small object whole); ``map`` returns None, ``hint`` does nothing,
``nowait`` is False and ``remote`` is True (the formats then read in few big requests,
several in flight). ``create`` stages the stream in a local temp file, and
``commit`` uploads it whole or not at all (straight to the key on S3/GCS, elsewhere to a
temporary key, size-checked and moved into place), so a reader of the final key never sees a
partial object. Register it for its URL schemes with :func:`register_store`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

from .local import LocalStore

__all__ = [
    "ByteSink",
    "ByteSource",
    "ByteStore",
    "PinnedSink",
    "committed",
    "is_url",
    "local_path",
    "register_store",
    "store_for",
    "url_scheme",
]


def local_path(path: str | os.PathLike[str]) -> str:
    """The local path a ``file://`` URL names (``file:///a/b`` and ``file://localhost/a/b``:
    ``/a/b``; ``file://a/b``: the relative ``a/b``, as fsspec reads it); any other path or URL
    as it is. Every place a checkpoint location is opened calls this, so ``file://`` is the
    local disk everywhere (fsync, rename, flock), never object storage."""
    text = os.fspath(path)
    if not text.startswith("file://"):
        return text
    rest = text[len("file://"):]
    if rest.startswith("localhost/"):
        rest = rest[len("localhost"):]
    return rest or "."


def url_scheme(path: str | os.PathLike[str]) -> str:
    """The scheme of a URL (``"s3"`` for ``s3://b/k``); ``""`` for a local path and for a
    ``file://`` URL (the local disk). The one place that parses ``scheme://``; a
    :class:`~epochal.storage.io.location.Location` carries its result."""
    scheme, sep, _ = os.fspath(path).partition("://")
    return scheme if sep and scheme != "file" else ""


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for ``scheme://...`` locations other than ``file://`` (the one notion of local vs
    remote: a ``file://`` URL is a local path, see :func:`local_path`)."""
    return bool(url_scheme(path))


@runtime_checkable
class ByteSource(Protocol):
    """Random-access reads of one stored file (see the module docstring for the call order)."""

    #: the file's name in error messages (a path or a URL)
    name: str
    #: True when ``read_into(..., nowait=True)`` can tell "not cached" from "read" (a local
    #: file on Linux); a source without it is treated as never cached
    nowait: bool

    def size(self) -> int:
        """The file's length in bytes."""
        ...

    def read(self, nbytes: int, offset: int) -> bytes:
        """Up to ``nbytes`` bytes at ``offset`` (fewer only at the end of the file, or on an
        interrupted call); for small reads such as headers. Thread-safe."""
        ...

    def read_into(self, views: Sequence[memoryview], offset: int, *, nowait: bool = False) -> int:
        """Fill ``views`` in order with the bytes from ``offset`` on; return how many bytes
        were read (fewer only at the end of the file, or on an interrupted call: the caller
        continues). ``nowait``: read only what is at hand without waiting for the device
        (raises OSError, e.g. EAGAIN, or returns a short count when it would wait).
        Thread-safe."""
        ...

    def map(self, *, sequential: bool = False) -> Any | None:
        """A read-only memory map of the whole file (an ``mmap.mmap``: buffer protocol,
        ``close()``), or None when the store cannot map. ``sequential``: it will be read
        front to back once. The caller closes it."""
        ...

    def hint(self, offset: int, nbytes: int) -> bool:
        """Ask the store to start fetching ``[offset, offset + nbytes)``; False when the
        store takes no hints (then none are given again)."""
        ...

    def close(self) -> None:
        """Release the file (idempotent)."""
        ...


@runtime_checkable
class ByteSink(Protocol):
    """One new file, streamed then committed durably (see the module docstring)."""

    #: the final name in error messages
    name: str

    def write(self, buffer: Any) -> int:
        """Append one bytes-like object, or a list of them in order (written without copies
        where the store can: ``writev``); return the bytes appended."""
        ...

    def patch(self, offset: int, data: Any) -> None:
        """Overwrite bytes already written at ``offset`` (a header filled in at the end).
        Only after the last :meth:`write`."""
        ...

    def commit(self) -> None:
        """Make the whole file durable under its final name (atomically replacing any old one)."""
        ...

    def abort(self) -> None:
        """Drop everything written; the final name is untouched. Never raises."""
        ...


@runtime_checkable
class PinnedSink(ByteSink, Protocol):
    """A sink that can write a caller's buffer from its own memory, without a copy (the
    local ``O_DIRECT`` sink, :class:`~epochal.storage.io.direct.DirectSink`)."""

    #: ``write_pinned`` writes from the buffer's memory the parts whose address is congruent
    #: to their file offset modulo this (the page size); 0: it would copy everything
    pin_align: int

    def write_pinned(self, buffer: Any) -> int:
        """Append ``buffer`` like :meth:`write`, but its bytes may be read until
        :meth:`commit` or :meth:`abort` returns: they must stay alive and unchanged."""
        ...


class ByteStore(Protocol):
    """Where files live: opens sources and creates sinks by path."""

    def open_read(self, path: str, *, what: str = "db") -> ByteSource:
        """An open source for ``path``; CheckpointNotFoundError naming it when absent
        (``what``: the kind of file, for that message)."""
        ...

    def create(self, path: str, size: int | None = None) -> ByteSink:
        """A sink that becomes ``path`` on commit. ``size`` (when known) is checked against
        the free space first (OSError(ENOSPC) naming the file); a missing parent directory
        raises FileNotFoundError."""
        ...

    def exists(self, path: str) -> bool:
        """True when ``path`` can be opened for reading."""
        ...


_stores: dict[str, Callable[[], ByteStore]] = {}
_LOCAL_DISK = LocalStore()  # stateless: one for the process
_LOCAL: ByteStore = _LOCAL_DISK


def register_store(scheme: str, factory: Callable[[], ByteStore]) -> None:
    """Make paths ``scheme://...`` use the store ``factory()`` builds (e.g. an fsspec store)."""
    _stores[scheme] = factory


def store_for(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> ByteStore:
    """The store of ``path``: a registered one for its ``scheme://``, the fsspec store for
    any other URL (reached with ``storage_options``; None: the options of the active
    :class:`~epochal.storage.io.location.Location`, else this process's defaults), the
    local disk for a plain path. (A ``file://`` URL: see :func:`local_path`.)"""
    scheme, sep, _ = os.fspath(path).partition("://")
    if not sep:
        return _LOCAL
    if scheme in _stores:
        return _stores[scheme]()
    # any other URL is object storage through fsspec, loaded only now (the core imports
    # with numpy alone); never a local relative folder named "s3:"
    from .remote.fsspec_store import FsspecStore

    return FsspecStore(storage_options)


@contextmanager
def local_store(store: ByteStore) -> Iterator[ByteStore]:
    """Plain paths use ``store`` inside the ``with`` block, the local disk again after it: the
    place to inject faults (a full disk, an EIO at the k-th write, a failed commit) or to
    instrument I/O in tests and benches, at the seam every format goes through, instead of
    patching ``os`` or a module's internals. Usually ``store`` wraps the local one
    (:func:`disk_store`). Not for production code: it is process-wide while it lasts."""
    global _LOCAL
    previous, _LOCAL = _LOCAL, store
    try:
        yield store
    finally:
        _LOCAL = previous


def disk_store() -> ByteStore:
    """The local disk's store (what plain paths use outside :func:`local_store`)."""
    return _LOCAL_DISK


@contextmanager
def committed(sink: ByteSink) -> Iterator[ByteSink]:
    """``with committed(store.create(path, size)) as sink:``: commit on a clean exit, abort
    (and re-raise) on any exception."""
    try:
        yield sink
    except BaseException:
        sink.abort()
        raise
    sink.commit()
