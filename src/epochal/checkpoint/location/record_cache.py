"""A remembering :class:`~.records.RecordStore` over a URL's records, so that the cost of a
commit does not grow with the number of committed steps, and tools read thousands of records
with parallel requests.

Without it, every commit with a retention policy lists the location and re-reads every
manifest (about two requests per committed step: 98 s a commit at 5,000 steps on a loopback
S3 server). :class:`CachedRecords` wraps the URL's record store and remembers:

* each folder's listing, taken once (one LIST per 1,000 objects) and kept up to date by the
  writes and deletes made through it;
* the bytes of immutable records: manifests and stats reports (a manifest changes only by a
  write through this store while its user holds the location's lease; a stats report never
  changes). Pins and the lease are always read from the store.

A record missing from the remembered bytes is read once, when asked for; a caller that needs
many says which (:meth:`CachedRecords.prefetch`, as
:meth:`~.view.CheckpointDirectory.read_manifests` does) and they are fetched at once with
parallel requests. Nothing more is read than asked for: a resume reads the newest manifest
alone, retention the few its rules need, ``epochal ls`` those it shows.

What it may trust, and where it is used:

* the writer (:class:`~.directory.DirectoryMetadataHandler`) uses it only while it holds the
  lease, when no other job writes manifests there (``sizes_from_listing=False``: the size of a
  db is always asked of the store, since the job's nodes write dbs from other processes). The
  dbs the nodes write after the listing are not in it: retention still deletes a dropped
  step's dbs by the names its manifest lists, and an uncommitted db written meanwhile is found
  by the next job's listing. Whether a manifest exists before its epoch's dbs are deleted as
  uncommitted is asked of the store (``size``), never of the listing.
* read-only tools (``epochal ls/stats/verify``) use it for one command
  (``sizes_from_listing=True``: sizes from the listing, no request per db).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .manifest import MANIFEST_RE
from .records import STATS_DIR, RecordLock, RecordStore

__all__ = ["PARALLEL_REQUESTS", "CachedRecords"]

#: requests in flight at once when many records are read
PARALLEL_REQUESTS = 16


def _split(path: str) -> tuple[str, str]:
    folder, _, name = path.rstrip("/").rpartition("/")
    return folder, name


def _immutable(path: str) -> bool:
    """Records whose bytes never change once written (except by their writer through here)."""
    folder, name = _split(path)
    if MANIFEST_RE.match(name):
        return True
    return folder.rsplit("/", 1)[-1] == STATS_DIR and name.endswith(".jsonl")


class CachedRecords:
    """A :class:`~.records.RecordStore` over ``inner`` (a URL's) that remembers listings and
    immutable records (see the module doc)."""

    remote = True

    def __init__(self, inner: RecordStore, *, sizes_from_listing: bool = False,
                 workers: int | None = None) -> None:
        self.inner = inner
        self.sizes_from_listing = bool(sizes_from_listing)
        self.workers = max(1, int(workers if workers is not None else PARALLEL_REQUESTS))
        self._lock = threading.Lock()
        self._listings: dict[str, dict[str, tuple[str, int | None]]] = {}  # folder -> name -> (path, size)
        self._data: dict[str, bytes] = {}

    # -- reads
    def read(self, path: str) -> bytes:
        with self._lock:
            data = self._data.get(path)
        if data is not None:
            return data
        if not _immutable(path):
            return self.inner.read(path)
        data = self.inner.read(path)
        with self._lock:
            self._data[path] = data
        return data

    def prefetch(self, paths: Iterable[str]) -> None:
        """Read the records at ``paths`` not remembered yet, ``workers`` at a time (errors are
        left for the read that needs the record)."""
        with self._lock:
            todo = [p for p in dict.fromkeys(paths) if p not in self._data]
        if not todo:
            return

        def one(path: str) -> None:
            try:
                data = self.inner.read(path)
            except OSError:
                return
            with self._lock:
                self._data[path] = data

        if len(todo) == 1:
            one(todo[0])
            return
        with ThreadPoolExecutor(min(self.workers, len(todo)), thread_name_prefix="epochal-records") as pool:
            list(pool.map(one, todo))

    def files(self, folder: str) -> list[tuple[str, str]]:
        return [(name, path) for name, (path, _) in sorted(self._listing(folder).items())]

    def _listing(self, folder: str) -> dict[str, tuple[str, int | None]]:
        key = folder.rstrip("/")
        with self._lock:
            got = self._listings.get(key)
        if got is not None:
            return dict(got)
        listing = getattr(self.inner, "listing", None)
        rows = listing(folder) if listing is not None else [(n, p, None) for n, p in self.inner.files(folder)]
        fresh = {name: (path, size) for name, path, size in rows}
        with self._lock:
            self._listings[key] = fresh
        return dict(fresh)

    def size(self, path: str) -> int:
        if self.sizes_from_listing:
            folder, name = _split(path)
            with self._lock:
                listed = self._listings.get(folder)
            if listed is not None:
                hit = listed.get(name)
                if hit is None:
                    raise FileNotFoundError(2, "not in the listing", path)
                if hit[1] is not None:
                    return hit[1]
        return self.inner.size(path)

    def sizes(self, paths: Iterable[str]) -> dict[str, int | None]:
        """Size of each path (None: absent), asked ``workers`` at a time."""
        todo = list(dict.fromkeys(paths))

        def one(path: str) -> int | None:
            try:
                return self.size(path)
            except OSError:
                return None

        if len(todo) <= 1:
            return {p: one(p) for p in todo}
        with ThreadPoolExecutor(min(self.workers, len(todo)), thread_name_prefix="epochal-records") as pool:
            return dict(zip(todo, pool.map(one, todo)))

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def read_stats(self, records_dir: str) -> list[bytes]:
        folder = f"{records_dir.rstrip('/')}/{STATS_DIR}"
        paths = [p for name, p in self.files(folder) if name.endswith(".jsonl")]
        self.prefetch(paths)
        out = []
        for path in paths:
            try:
                out.append(self.read(path))
            except FileNotFoundError:  # deleted since the listing
                continue
        return out

    # -- writes: through to the store, then remembered
    def write(self, path: str, data: bytes) -> None:
        self.inner.write(path, data)
        self._written(path, bytes(data))

    def add_stats(self, records_dir: str, data: bytes) -> str:
        path = self.inner.add_stats(records_dir, data)
        self._written(path, bytes(data))
        return path

    def delete(self, path: str) -> bool:
        try:
            return self.inner.delete(path)
        finally:
            folder, name = _split(path)
            with self._lock:
                self._data.pop(path, None)
                listed = self._listings.get(folder)
                if listed is not None:
                    listed.pop(name, None)

    def note_written(self, path: str, data: bytes) -> None:
        """``data`` was written at ``path`` by another way than :meth:`write` (a
        create-only request): remember it as :meth:`write` would."""
        self._written(path, bytes(data))

    def _written(self, path: str, data: bytes) -> None:
        folder, name = _split(path)
        with self._lock:
            if _immutable(path):
                self._data[path] = data
            listed = self._listings.get(folder)
            if listed is not None:
                listed[name] = (path, len(data))

    # -- the rest as the store does it
    def makedirs(self, folder: str) -> None:
        self.inner.makedirs(folder)

    def sync_dir(self, folder: str) -> None:
        self.inner.sync_dir(folder)

    def writer_lock(self, path: str, seconds: float) -> RecordLock:
        return self.inner.writer_lock(path, seconds)

    def __getattr__(self, name: str) -> Any:  # anything else the store offers
        return getattr(self.inner, name)
