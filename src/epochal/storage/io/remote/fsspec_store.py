"""Object storage (any fsspec URL: ``s3://``, ``gs://``, ``memory://``, ...) as a
:mod:`byte store <epochal.storage.io.seam>`.

Reads are ranged requests, so a partial load fetches only the index and the byte ranges it
needs (:class:`FsspecSource`: pieces in flight together, a full load in one round trip). Writes are staged in a local temp file (bounded
memory: the stream goes to disk as it comes), then uploaded at commit whole or not at all
(:func:`~epochal.storage.io.remote.uploads.upload_to_key`): on S3 and GCS straight to the final key (those
stores show an object whole or not at all; no temp key, no server-side copy), elsewhere to a
temporary key next to the final one, size-checked and moved into place; an abort (or a failed
upload) removes the temp file and the temp key, so a reader of the final key never sees a
partial object. Staging files are named ``epochal-stage.<host>.<pid>.*``: a killed process's
are removed by the next process of its host that stages a write there (:func:`clean_stage_dir`);
a killed upload's temp key (:data:`TEMP_KEY_RE`), or on S3 its multipart upload
(:func:`abort_uploads`), by the next holder of the location's lease
(:func:`epochal.checkpoint.handler.cleanup.clean_temp_keys`).

Credentials and endpoints (fsspec ``storage_options``) for a URL come, first found:
from the caller (a :class:`~epochal.storage.io.location.Location`'s store, ``FsspecStore(
storage_options)``, ``filesystem_for(url, options)``); from the Location active in this
thread / context (:func:`scoped_storage_options`: the checkpoint steps carry their Location
to each node's process and activate it around the format's calls); from this process's
defaults per URL prefix (:func:`set_storage_options`: the one process-wide registry, for
code that has only a URL: a handler or tool built without options for a URL a manager or
the CLI's ``--storage-options`` gave them for); else fsspec's own configuration
(``FSSPEC_S3_ENDPOINT_URL``, ``AWS_*`` environment variables, ...).

Imported only for URLs (the seam loads it lazily): the core needs numpy alone. Needs the
``s3`` extra (fsspec, plus s3fs for S3).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from typing import Any

import numpy as np

from ....errors import CheckpointNotFoundError
from .. import atomic, tuning
from .uploads import atomic_put, upload_to_key

logger = logging.getLogger("epochal")

__all__ = [
    "FsspecSink",
    "FsspecSource",
    "FsspecStore",
    "TEMP_KEY_RE",
    "abort_uploads",
    "atomic_put",
    "upload_to_key",
    "clean_stage_dir",
    "filesystem_for",
    "scoped_storage_options",
    "set_storage_options",
    "stage_dir",
    "storage_options_for",
]

_options: dict[str, dict[str, Any]] = {}
_options_lock = threading.Lock()
#: the options of the Locations active in this thread / context: ((url prefix, options), ...)
_scoped: ContextVar[tuple[tuple[str, dict[str, Any]], ...]] = ContextVar("epochal_storage_options", default=())


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - only without the extra
        raise ImportError("checkpoints at a URL need fsspec: pip install 'epochal[s3]'") from e
    return fsspec


def set_storage_options(url_prefix: str, options: dict[str, Any] | None) -> None:
    """Use fsspec ``options`` for every URL under ``url_prefix`` in this process (the longest
    matching prefix wins). ``None`` or ``{}`` forgets them (fsspec's own configuration)."""
    key = url_prefix.rstrip("/")
    with _options_lock:
        if options:
            _options[key] = dict(options)
        else:
            _options.pop(key, None)


@contextmanager
def scoped_storage_options(url_prefix: str, options: dict[str, Any]) -> Iterator[None]:
    """Use ``options`` for every URL under ``url_prefix`` opened by path inside this block,
    in this thread / context only (before this process's defaults); the innermost longest
    prefix wins. :meth:`epochal.storage.io.location.Location.active` uses it."""
    token = _scoped.set((*_scoped.get(), (url_prefix.rstrip("/"), dict(options))))
    try:
        yield
    finally:
        _scoped.reset(token)


def _under(url: str, prefix: str) -> bool:
    return url == prefix or url.startswith(prefix if prefix.endswith("/") else prefix + "/")


def storage_options_for(url: str) -> dict[str, Any]:
    """The options of ``url`` when the caller has none: those of the Location active in this
    context for the longest prefix of ``url``, else this process's defaults for its longest
    prefix (:func:`set_storage_options`), else ``{}`` (fsspec's own configuration)."""
    best, found = "", None
    for prefix, options in reversed(_scoped.get()):
        if _under(url, prefix) and (found is None or len(prefix) > len(best)):
            best, found = prefix, options
    if found is not None:
        return dict(found)
    with _options_lock:
        best = ""
        for prefix in _options:
            if _under(url, prefix) and len(prefix) > len(best):
                best = prefix
        return dict(_options[best]) if best else {}


def filesystem_for(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path within it, reached with
    ``storage_options`` (None: :func:`storage_options_for` ``url``)."""
    options = storage_options_for(url) if storage_options is None else storage_options
    fs, path = _fsspec().core.url_to_fs(url, **options)
    return fs, path


def stage_dir() -> str:
    """Where writes are staged before upload: ``$EPOCHAL_STAGE_DIR``, else the temp dir."""
    return os.environ.get("EPOCHAL_STAGE_DIR") or tempfile.gettempdir()


#: staged writes: ``epochal-stage.<host>.<pid>.<random>`` in :func:`stage_dir`
STAGE_PREFIX = "epochal-stage."
#: the temporary key of an upload in flight: ``<final key>.tmp.upload.<8 hex digits>``
TEMP_KEY_RE = re.compile(r"\.tmp\.upload\.[0-9a-f]{8}$")
_swept: set[str] = set()
_swept_lock = threading.Lock()


def _stage_owner(name: str) -> tuple[str, int] | None:
    """``(host, pid)`` of a staging file's name, else None."""
    if not name.startswith(STAGE_PREFIX):
        return None
    parts = name[len(STAGE_PREFIX):].rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def clean_stage_dir(folder: str | None = None) -> list[str]:
    """Remove the staging files in ``folder`` (default :func:`stage_dir`) left by killed
    processes of this host (their pid is gone); return their paths. Another host's files (a
    shared staging folder) and live processes' are never touched. Runs once per folder and
    process on its own, before the first staged write."""
    folder = folder or stage_dir()
    me, removed = atomic.hostname(), []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        owner = _stage_owner(name)
        if owner is None or owner[0] != me or owner[1] == os.getpid() or atomic.pid_alive(owner[1]):
            continue
        path = os.path.join(folder, name)
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            continue
        except OSError as ex:
            logger.warning("Cannot remove the leftover staging file %s: %s", path, ex)
    if removed:
        logger.info("Removed %d staging file(s) of killed saves: %s", len(removed), removed)
    return removed


def _sweep_once(folder: str) -> None:
    with _swept_lock:
        if folder in _swept:
            return
        _swept.add(folder)
    clean_stage_dir(folder)


def _unlink_quietly(path: str) -> None:
    with suppress(OSError):
        os.unlink(path)


def _not_found(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError) or getattr(exc, "errno", None) == errno.ENOENT


def scatter(parts: Sequence[memoryview], views: Sequence[memoryview]) -> int:
    """Copy ``parts`` (in order) into ``views`` (in order) until either ends; the bytes
    copied. numpy copies them (it releases the GIL: the reading threads copy at once)."""
    outs = (np.frombuffer(v, np.uint8) for v in views)
    dst, at, done = next(outs, None), 0, 0
    for part in parts:
        src, sat = np.frombuffer(part, np.uint8), 0
        while sat < src.size and dst is not None:
            n = min(src.size - sat, dst.size - at)
            dst[at:at + n] = src[sat:sat + n]
            sat, at, done = sat + n, at + n, done + n
            if at == dst.size:
                dst, at = next(outs, None), 0
    return done


class FsspecSource:
    """One object open for ranged reads (see :class:`~epochal.storage.io.seam.ByteSource`).

    ``remote`` tells the formats to read it in few big requests (tuning.REMOTE_*), several
    at once. The first read fetches ahead what every open reads next: an object of at most
    tuning.REMOTE_WHOLE bytes whole, else (a read at offset 0: a header) also its last
    tuning.REMOTE_TAIL bytes (where a native db keeps its index), both in one concurrent
    batch (``fs.cat_ranges``), so opening a db costs one round trip after the HEAD, not two.
    A reader that will read (nearly) every byte says so first with ``hint(0, size())``; an
    object of at most tuning.REMOTE_WHOLE_LOAD bytes is then fetched whole by the first read,
    in REMOTE_PIECE ranges all in flight at once: header, index and data in one round trip
    (a full load makes as many requests as s3fs's own ``cat_file`` of the object)."""

    nowait = False
    remote = True

    def __init__(self, url: str, what: str = "db", storage_options: dict[str, Any] | None = None) -> None:
        self.name = url
        self.fs, self.path = filesystem_for(url, storage_options)
        try:
            info = self.fs.info(self.path)
        except Exception as ex:
            if _not_found(ex):
                raise CheckpointNotFoundError(errno.ENOENT, f"no such {what} file", url) from None
            raise
        if info.get("type") not in (None, "file"):
            raise CheckpointNotFoundError(errno.ENOENT, f"no such {what} file (a directory)", url)
        self._size = int(info["size"])
        #: bytes asked of the store so far (all reads, those fetched ahead included)
        self.bytes_requested = 0
        self._count = threading.Lock()
        self._ahead: list[tuple[int, bytes]] | None = None  # (offset, bytes) fetched ahead
        self._whole = False  # hint(0, size): fetch it all ahead

    def size(self) -> int:
        return self._size

    def _fetch(self, starts: list[int], ends: list[int]) -> list[bytes]:
        if len(starts) == 1:
            out = [bytes(self.fs.cat_file(self.path, start=starts[0], end=ends[0]))]
        else:
            got = self.fs.cat_ranges([self.path] * len(starts), starts, ends, on_error="raise")
            out = [bytes(b) for b in got]
        with self._count:
            self.bytes_requested += sum(e - s for s, e in zip(starts, ends))
        return out

    def _fetch_ahead(self, offset: int, end: int) -> None:
        """On the first read: fetch the whole small object (or a hinted one, in pieces), or the
        header and the tail."""
        size = self._size
        if size <= tuning.REMOTE_WHOLE:
            starts, ends = [0], [size]
        elif self._whole:
            # REMOTE_PIECE ranges; a short remainder joins the last (a request costs more than
            # a few bytes more: on moto a ranged GET reads the whole object)
            starts = list(range(0, size, tuning.REMOTE_PIECE))
            if len(starts) > 1 and size - starts[-1] < tuning.REMOTE_PIECE // 4:
                starts.pop()
            ends = starts[1:] + [size]
        elif offset == 0 and end < size - tuning.REMOTE_TAIL:
            starts, ends = [0, size - tuning.REMOTE_TAIL], [end, size]
        else:
            self._ahead = []
            return
        self._ahead = list(zip(starts, self._fetch(starts, ends)))

    def read(self, nbytes: int, offset: int) -> bytes:
        end = min(offset + nbytes, self._size)
        if nbytes <= 0 or offset >= end:
            return b""
        if self._ahead is None:
            with self._count:
                first = self._ahead is None
                if first:
                    self._ahead = []  # (other threads read on their own meanwhile)
            if first:
                self._fetch_ahead(offset, end)
        parts = self._from_ahead(offset, end)
        if parts is not None:
            return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
        return self._fetch([offset], [end])[0]

    def _from_ahead(self, offset: int, end: int) -> list[memoryview] | None:
        """Views of the bytes fetched ahead that make up ``[offset, end)``, or None."""
        out: list[memoryview] = []
        pos = offset
        for start, data in self._ahead or ():  # (in file order)
            if start <= pos < start + len(data):
                take = min(start + len(data), end)
                out.append(memoryview(data)[pos - start:take - start])
                pos = take
                if pos >= end:
                    return out
        return None

    def read_into(self, views: Sequence[memoryview], offset: int, *, nowait: bool = False) -> int:
        want = min(sum(v.nbytes for v in views), max(0, self._size - offset))
        if self._ahead is None or (parts := self._from_ahead(offset, offset + want)) is None:
            parts = [memoryview(self.read(want, offset))]  # (slices of it copy nothing)
        return scatter(parts, views)

    def hint(self, offset: int, nbytes: int) -> bool:
        """``hint(0, size())`` before the first read: fetch the whole object ahead, if it is
        at most tuning.REMOTE_WHOLE_LOAD bytes (see the class doc). No other hints."""
        if self._ahead is None and offset == 0 and nbytes >= self._size and self._size <= tuning.REMOTE_WHOLE_LOAD:
            self._whole = True
            return True
        return False

    def map(self, *, sequential: bool = False) -> Any | None:
        return None

    def close(self) -> None:
        self._ahead = None


class FsspecSink:
    """A new object: staged in a local temp file, uploaded on commit (see the module doc;
    staged in memory, the upload was slower on s3fs/moto: bench/RESULTS.md, "bench_remote.py")."""

    def __init__(self, url: str, size: int | None = None, storage_options: dict[str, Any] | None = None) -> None:
        self.name = url
        self.fs, self.path = filesystem_for(url, storage_options)
        folder = stage_dir()
        if size is not None:
            free = shutil.disk_usage(folder).free
            if free < size:
                raise OSError(errno.ENOSPC, f"{free} bytes free in the staging directory {folder}, "
                              f"{size} needed to stage {url}")
        _sweep_once(folder)
        fd, self._local = tempfile.mkstemp(prefix=f"{STAGE_PREFIX}{atomic.hostname()}.{os.getpid()}.", dir=folder)
        # a sink dropped without commit or abort still removes its staging file
        self._finalizer = weakref.finalize(self, _unlink_quietly, self._local)
        self._file = os.fdopen(fd, "w+b")
        self._done = False

    def write(self, buffer: Any) -> int:
        parts = buffer if isinstance(buffer, (list, tuple)) else [buffer]
        n = 0
        for part in parts:
            n += self._file.write(part)
        return n

    def patch(self, offset: int, data: Any) -> None:
        end = self._file.tell()
        self._file.seek(offset)
        self._file.write(data)
        self._file.seek(end)

    def commit(self) -> None:
        """Upload (see :func:`upload_to_key`); abort on any error."""
        try:
            self._file.flush()
            size = os.fstat(self._file.fileno()).st_size
            self._file.close()
            upload_to_key(self.fs, self.path, self._local, size, self.name)
        except BaseException:
            self.abort()
            raise
        self._drop_local()

    def abort(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
        self._drop_local()

    def _drop_local(self) -> None:
        if not self._done:
            self._done = True
            self._finalizer()


def abort_uploads(folder: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Abort the multipart uploads in progress directly in ``folder`` (an ``s3://`` URL): the
    parts a writer killed mid-upload left (invisible, but stored and billed); return the URLs
    they were for. Only for the lease holder at its start (no upload of its own is in flight
    then). Other stores: nothing (their uploads are a temp key, :data:`TEMP_KEY_RE`)."""
    fs, path = filesystem_for(folder, storage_options)
    if not atomic_put(fs) or not hasattr(fs, "call_s3"):
        return []
    bucket, prefix, _ = fs.split_path(path.rstrip("/") + "/")
    base = folder.rstrip("/")
    done = []
    try:
        uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    except Exception as ex:  # a store without the call: nothing to abort that we can see
        logger.debug("Cannot list the uploads in progress in %s: %s", folder, ex)
        return []
    for up in uploads:
        name = str(up["Key"])[len(prefix):]
        if "/" in name:
            continue  # in a subfolder: not one of this folder's objects
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
            done.append(f"{base}/{name}")
        except Exception as ex:
            logger.warning("Cannot abort the leftover upload of %s/%s: %s", base, name, ex)
    return done


class FsspecStore:
    """Objects under fsspec URLs (see :class:`~epochal.storage.io.seam.ByteStore`), reached
    with ``storage_options`` (None: :func:`storage_options_for` each URL)."""

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = None if storage_options is None else dict(storage_options)

    def open_read(self, path: str, *, what: str = "db") -> FsspecSource:
        if self.storage_options is None:  # (a spy on FsspecSource(url, what) keeps working)
            return FsspecSource(path, what)
        return FsspecSource(path, what, self.storage_options)

    def create(self, path: str, size: int | None = None) -> FsspecSink:
        return FsspecSink(path, size, self.storage_options)

    def exists(self, path: str) -> bool:
        fs, p = filesystem_for(path, self.storage_options)
        try:
            return bool(fs.isfile(p))
        except Exception as ex:
            if _not_found(ex):
                return False
            raise
