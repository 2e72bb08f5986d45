"""A remote copy of every committed epoch, so a job whose machine (and local disk) is gone
resumes from the bucket.

:class:`RemoteMirror` keeps, at a URL of any fsspec filesystem (``s3://bucket/run``,
``gs://...``, ``memory://...``), the same layout as the local checkpoint directory: each
node's db under its file name, and the epoch's manifest under ``.epochal/``.

* **Push** (after the local commit): the dbs first, each uploaded whole or not at all and
  size-checked (:func:`epochal.storage.formats.remote.upload_file`: on S3/GCS straight to its
  key, elsewhere through a temp key moved into place); the manifest last. A remote
  epoch exists only once its manifest does, exactly as on local disk, so a reader of the
  bucket never sees an epoch whose dbs are not all there.
* **Pull** (when the remote has a newer committed epoch than the local directory, or one
  asked for that is not on local disk): each db is downloaded to a local temp name, its size
  and digest are checked against the remote manifest and every checksum is verified, then it
  is fsynced and renamed into place; the manifest is written last. A damaged or incomplete
  remote epoch is skipped with a warning, and an older one tried.
* **Delete** (retention): manifest first, then the dbs.

Requires the ``s3`` extra (fsspec, plus s3fs for S3).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from ...errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ...storage.formats.base import get_db_type
from ...storage.formats.remote import filesystem, upload_file
from ...storage.io import atomic
from ..location.manifest import Manifest, decode_manifest, manifest_name, parse_manifest_name
from ..location.naming import RECORDS_DIR

logger = logging.getLogger("epochal")


class RemoteMirror:
    """The committed epochs of one checkpoint directory, mirrored at ``url``.

    ``storage_options`` go to fsspec (for S3: ``endpoint_url``, ``key``, ``secret``, ...)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self._fs: Any = None
        self._root = ""

    def __repr__(self) -> str:
        return f"RemoteMirror({self.url!r})"

    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs, self._root = filesystem(self.url, **self.storage_options)
            self._root = self._root.rstrip("/")
        return self._fs

    def _key(self, name: str) -> str:
        _ = self.fs
        return f"{self._root}/{name}"

    def url_of(self, name: str) -> str:
        """The URL of ``name`` (a db file name, or ``.epochal/manifest.<epoch>.json``)."""
        return f"{self.url}/{name}"

    @staticmethod
    def manifest_name(epoch: int) -> str:
        return f"{RECORDS_DIR}/{manifest_name(epoch)}"

    # -- reading the remote side
    def epochs(self) -> list[int]:
        """Epochs with a manifest at the remote, oldest first (their contents not checked)."""
        fs = self.fs
        records = self._key(RECORDS_DIR)
        try:
            names = fs.ls(records, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            epoch = parse_manifest_name(str(name).rstrip("/").rsplit("/", 1)[-1])
            if epoch is not None:
                out.append(epoch)
        return sorted(out)

    def manifest(self, epoch: int) -> dict[str, Any]:
        """The remote manifest of ``epoch`` as a JSON dict, validated like a local one.

        CheckpointNotFoundError when the remote has none; CheckpointCorruptError naming the URL
        when it is not a valid manifest of that epoch."""
        name = self.manifest_name(epoch)
        url = self.url_of(name)
        try:
            raw = self.fs.cat_file(self._key(name))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"epoch {epoch} is not committed at {url}") from None
        return decode_manifest(bytes(raw), url, int(epoch))

    def read_manifest(self, epoch: int) -> Manifest:
        """:meth:`manifest`, typed (the same errors)."""
        return Manifest.from_dict(self.manifest(epoch))

    # -- writing the remote side
    def push(self, db_dir: str, epoch: int, manifest: Manifest) -> int:
        """Upload the dbs that ``manifest`` lists (from ``db_dir``), then the manifest; return
        the bytes uploaded. Raises on any failure (the remote epoch is then not committed)."""
        total = 0
        for entry in manifest.nodes.values():
            local = os.path.join(db_dir, entry.file)
            if os.path.getsize(local) != entry.size:
                raise CheckpointCorruptError(local, "changed since it was committed")
            total += upload_file(local, self.url_of(entry.file), **self.storage_options)
        self.put_manifest(epoch, manifest)
        return total

    def put_manifest(self, epoch: int, manifest: Manifest) -> None:
        """Write the remote manifest of ``epoch`` (one object: it appears whole or not)."""
        raw = manifest.encode()
        fs = self.fs
        fs.makedirs(self._key(RECORDS_DIR), exist_ok=True)
        fs.pipe_file(self._key(self.manifest_name(epoch)), raw)

    def delete(self, epoch: int) -> None:
        """Remove a remote epoch: its manifest first (it then no longer exists), then its dbs."""
        try:
            files = [e.file for e in self.read_manifest(epoch).nodes.values()]
        except CheckpointError:
            files = []
        for key in [self.manifest_name(epoch), *files]:
            try:
                self.fs.rm(self._key(key))
            except FileNotFoundError:
                pass  # already gone (an earlier, interrupted delete)

    # -- bringing an epoch back
    def pull(
        self, db_dir: str, records_dir: str, epoch: int, db_type: str | None, nodes: list[str] | None
    ) -> Manifest:
        """Download remote ``epoch`` into ``db_dir`` and commit it there (manifest last);
        return its manifest. ``db_type``/``nodes``: what the epoch must have been written with
        (None: whatever its manifest says). Every db is verified (size, digest, every
        checksum) before it is renamed into place; on any problem nothing is committed
        locally and CheckpointError names the URL (and node)."""
        manifest = self.read_manifest(epoch)
        url = self.url_of(self.manifest_name(epoch))
        db_type = db_type or manifest.db_type
        if manifest.db_type != db_type:
            raise CheckpointCorruptError(url, f"written with db_type {manifest.db_type!r}, this job uses {db_type!r}")
        if nodes and sorted(manifest.nodes) != sorted(nodes):
            raise CheckpointCorruptError(
                url, f"nodes {sorted(manifest.nodes)} do not match this job's {sorted(nodes)}"
            )
        backend = get_db_type(db_type)
        fs = self.fs
        os.makedirs(db_dir, exist_ok=True)
        # room for the whole epoch before the first byte (OSError ENOSPC naming a db)
        if manifest.nodes:
            first = next(iter(manifest.nodes.values())).file
            atomic.check_free_space(os.path.join(db_dir, first), manifest.size)
        for node, entry in manifest.nodes.items():
            final = os.path.join(db_dir, entry.file)
            db_url = self.url_of(entry.file)
            tmp = atomic.temp_path_for(final)
            try:
                try:
                    fs.get_file(self._key(entry.file), tmp)
                except FileNotFoundError:
                    raise CheckpointNotFoundError(f"the db of node {node!r} ({db_url}) does not exist") from None
                size = os.path.getsize(tmp)
                if size != entry.size:
                    raise CheckpointCorruptError(db_url, f"{size} bytes, the manifest says {entry.size}")
                digest = backend.digest(tmp)
                if entry.digest is not None and digest != entry.digest:
                    raise CheckpointCorruptError(db_url, "digest does not match the manifest")
                try:
                    backend.verify(tmp)
                except CheckpointCorruptError as ex:
                    raise CheckpointCorruptError(db_url, f"node {node!r}: {ex}") from None
                atomic.fsync_file(tmp)
                os.replace(tmp, final)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        atomic.fsync_dir(db_dir)
        os.makedirs(records_dir, exist_ok=True)
        atomic.atomic_write_bytes(os.path.join(records_dir, manifest_name(epoch)), manifest.encode())
        return manifest


class MirrorQueue:
    """One daemon thread that runs mirror work (pushes, remote retention) in submission
    order, so training does not wait for the network; :meth:`flush` waits for all of it.
    A call that raises is logged as a warning (the calls handle their own errors)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Callable[[], None]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="epochal-mirror", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            try:
                fn()
            except Exception as ex:  # noqa: BLE001 - never kill the worker
                logger.warning("Mirror work failed: %s", ex)
            finally:
                self._queue.task_done()

    def submit(self, fn: Callable[[], None]) -> None:
        self._queue.put(fn)

    def flush(self) -> None:
        """Wait until everything submitted so far has run."""
        self._queue.join()


__all__ = ["MirrorQueue", "RemoteMirror"]
