"""Object storage (any fsspec URL: ``s3://``, ``gs://``, ``memory://``, ...) as a
:mod:`byte store <epochal.storage.io.seam>`.

Reads are ranged requests (``fs.cat_file(path, start, end)``), each its own request, so a
partial load fetches only the index and the byte ranges it needs. Writes are staged to a
local temp file (bounded memory: the stream goes to disk as it comes), then uploaded at
commit to a temporary key next to the final one, size-checked and moved into place; an
abort (or a failed upload) removes the temp file and the temp key, so a reader of the final
key never sees a partial object. Staging files are named ``epochal-stage.<host>.<pid>.*``: a
killed process's are removed by the next process of its host that stages a write there
(:func:`clean_stage_dir`); a killed upload's temp key (:data:`TEMP_KEY_RE`) by the next holder
of the location's lease (:func:`epochal.checkpoint.handler.cleanup.clean_temp_keys`).

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
import secrets
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ...errors import CheckpointCorruptError, CheckpointNotFoundError
from . import atomic

logger = logging.getLogger("epochal")

__all__ = [
    "FsspecSink",
    "FsspecSource",
    "FsspecStore",
    "TEMP_KEY_RE",
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
    try:
        os.unlink(path)
    except OSError:
        pass


def _not_found(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError) or getattr(exc, "errno", None) == errno.ENOENT


class FsspecSource:
    """One object open for ranged reads (see :class:`~epochal.storage.io.seam.ByteSource`)."""

    nowait = False

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
        #: bytes asked of the store so far (all reads; for tests and stats)
        self.bytes_requested = 0
        self._count = threading.Lock()

    def size(self) -> int:
        return self._size

    def read(self, nbytes: int, offset: int) -> bytes:
        end = min(offset + nbytes, self._size)
        if nbytes <= 0 or offset >= end:
            return b""
        data = bytes(self.fs.cat_file(self.path, start=offset, end=end))
        with self._count:
            self.bytes_requested += end - offset
        return data

    def read_into(self, views: Sequence[memoryview], offset: int, *, nowait: bool = False) -> int:
        want = sum(v.nbytes for v in views)
        data = self.read(want, offset)
        pos = 0
        for v in views:
            n = min(v.nbytes, len(data) - pos)
            if n <= 0:
                break
            v.cast("B")[:n] = data[pos:pos + n]
            pos += n
        return pos

    def map(self, *, sequential: bool = False) -> Any | None:
        return None

    def hint(self, offset: int, nbytes: int) -> bool:
        return False

    def close(self) -> None:
        return None


class FsspecSink:
    """A new object: staged in a local temp file, uploaded on commit (see the module doc)."""

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
        """Upload to a temp key, check its size, move it into place; abort on any error."""
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


def upload_to_key(fs: Any, path: str, local: str, size: int, name: str) -> None:
    """Upload the local file ``local`` (``size`` bytes) to ``path`` through a temp key beside
    it (size-checked, then moved); the temp key is removed whatever happens. ``name``: the
    URL, for errors."""
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp.upload.{secrets.token_hex(4)}"
    try:
        fs.put_file(local, tmp)
        got = int(fs.info(tmp)["size"])
        if got != size:
            raise CheckpointCorruptError(name, f"uploaded {got} bytes, expected {size}")
        fs.mv(tmp, path)
    finally:
        try:
            if fs.exists(tmp):
                fs.rm(tmp)
        except Exception:  # a failed cleanup must not hide the real error
            pass
        fs.invalidate_cache(parent or None)


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
