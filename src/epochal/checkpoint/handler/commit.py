"""What a commit records of each node's db: its file name, size and digest (a
:class:`~.manifest.DbEntry`), once the db is durable. The file name is the one its writer
reported (at a URL it carries the writer's token, see
:mod:`~epochal.checkpoint.location.naming`); a db reported without one is ``<node>.<epoch>``.

A node that reported its db (:class:`~.metadata.DbReport`, through the manager) is taken at
its word: the driver never opens that file (it may be on another machine, or at a URL). A
db nobody reported (a handler driven without a manager) is fsynced and measured here, or at
a URL asked of the store; the directory is synced after, so the dbs are durable before the
manifest that names them is written. The manifest itself is written by
:func:`commit_manifest` (create-only at a URL).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...errors import CheckpointError, CheckpointNotFoundError
from ...storage.formats.base import DbBackend
from ...storage.io import atomic
from ..location.manifest import DbEntry
from ..location.naming import db_token, names_db_of
from ..location.record_cache import CachedRecords
from ..location.records import RecordStore
from ..location.view import CheckpointDirectory
from .metadata import DbReport

__all__ = ["commit_manifest", "durable_entries"]


def durable_entries(
    d: CheckpointDirectory, backend: DbBackend, epoch: int, node_names: Sequence[str],
    reported: Mapping[str, DbReport],
) -> dict[str, DbEntry]:
    """The manifest entry of each of ``node_names``' db of ``epoch`` in ``d``, every one
    durable. CheckpointNotFoundError naming the node and file when a db does not exist."""
    nodes: dict[str, DbEntry] = {}
    for node in node_names:
        got = reported.get(node)
        if got is not None and got.file is not None and db_token(got.file) is not None:  # a writer's own name
            if not names_db_of(got.file, node, epoch, d.file_prefix):
                raise CheckpointError(f"cannot commit epoch {epoch}: node {node!r} reported db {got.file!r}, "
                                      f"not a db name of that node and epoch")
            path = d.path_of(got.file)
        else:
            path = d.plain_db_path(node, epoch)
        if node in reported or d.records.remote:  # the node said (or the store will)
            nodes[node] = _entry(d, backend, node, path, reported.get(node))
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"cannot commit epoch {epoch}: the db of node {node!r} ({path}) does not exist"
            ) from None
        try:
            atomic.fsync(fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        nodes[node] = DbEntry(os.path.basename(path), size, backend.digest(path))
    d.records.sync_dir(d.db_dir)
    return nodes


def _entry(d: CheckpointDirectory, backend: DbBackend, node: str, path: str, got: DbReport | None) -> DbEntry:
    """A manifest entry from a node's report; without one, from the store: its size, and the
    digest read from the db's header."""
    if got is None:
        try:
            size = d.records.size(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"cannot commit epoch: the db of node {node!r} ({path}) does not exist"
            ) from None
        got = DbReport(size, backend.digest(path))
    return DbEntry(os.path.basename(path), int(got.size), got.digest)


def commit_manifest(records: RecordStore, path: str, data: bytes, storage_options: dict[str, Any] | None,
                    fence: Callable[[], None] | None) -> bytes | None:
    """Write the manifest ``data`` that commits an epoch at ``path``. At a URL it is created
    only where none is (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``): a writer paused
    past its lease between its fence and this write (a GC pause, a frozen VM) cannot replace
    the manifest the new holder committed meanwhile. When one is there, ``fence`` (the lease's)
    is asked again: a job that lost the lease fails with CheckpointLockedError and nothing
    changes; the holder replaces it (a save of the same epoch again) and gets back the bytes
    of the manifest it replaced (None: none was there), whose dbs no manifest names any more.
    On a local disk the writer lock is a flock: written atomically in place."""
    if not records.remote:
        records.write(path, data)
        return None
    from ...storage.io.remote.conditional import conditional_for

    objects = conditional_for(path, storage_options)
    if objects.create(path, data) is not None:
        objects.fs.invalidate_cache(path.rsplit("/", 1)[0].split("://", 1)[-1])
        if isinstance(records, CachedRecords):
            records.note_written(path, data)
        return None
    if fence is not None:
        fence()  # CheckpointLockedError naming the new holder
    try:
        replaced: bytes | None = records.read(path)
    except OSError:  # (gone meanwhile, or unreadable: its dbs are left to the cleanups)
        replaced = None
    records.write(path, data)
    return replaced
