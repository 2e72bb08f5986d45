"""What is deleted from a checkpoint directory, and the rules that keep each delete safe.

* **Retention** (:func:`apply_retention`, after a commit): the epochs the policy of
  :mod:`epochal.checkpoint.location.retention` drops go manifest first (the epoch then no longer
  exists), then their dbs, so an interrupted delete never leaves a manifest naming missing
  files; dbs of older epochs that were never committed (killed or failed saves) go too,
  but only of epochs with no manifest file at all: an epoch whose manifest exists and cannot
  be read at that moment (EIO, EMFILE, a failed GET) or parsed is kept, named in a warning.
  Only files named exactly as an epoch's db of a known node are ever deleted.
* **Temp files** (:func:`clean_temp_files`, when a handler starts): the ``*.tmp.<host>.<pid>.*``
  files of killed saves of this host whose process is gone. Another host's are never touched.
  At a URL (:func:`clean_temp_keys`, once the lease is held): the ``*.tmp.upload.<hex>`` keys
  of uploads that never finished, and on S3 the multipart uploads left in progress.

:class:`~epochal.checkpoint.handler.directory.DirectoryMetadataHandler` calls both.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from ...errors import CheckpointError, CheckpointNotFoundError
from ...storage.io import atomic
from ..location.lock import pid_alive
from ..location.manifest import Manifest
from ..location.retention import RetentionPolicy, epochs_to_delete, metric_unreadable, metric_value
from ..location.view import CheckpointDirectory

logger = logging.getLogger("epochal")

__all__ = ["apply_retention", "clean_temp_files", "clean_temp_keys", "read_manifests"]


def read_manifests(d: CheckpointDirectory, epochs: Iterable[int]) -> tuple[dict[int, Manifest], dict[int, str]]:
    """Each manifest of ``epochs`` read once: ``({epoch: manifest}, {epoch: why it cannot be
    read or parsed})``. An epoch whose manifest vanished since the listing is in neither."""
    good: dict[int, Manifest] = {}
    bad: dict[int, str] = {}
    for epoch in epochs:
        try:
            good[epoch] = d.read_manifest(epoch)
        except CheckpointNotFoundError:
            continue
        except CheckpointError as ex:
            bad[epoch] = str(ex)
    return good, bad


def _read_needed(d: CheckpointDirectory, manifests: list[int], newest: int, pins: set[int],
                 policy: RetentionPolicy) -> tuple[dict[int, Manifest], dict[int, str], set[int]]:
    """The manifests keep_last/keep_every need, read once: from ``newest`` down until
    ``keep_last`` of them are valid, then every older epoch the rules would drop (each is read
    before it is deleted: an unreadable one is kept). The older epochs the rules keep anyway
    (pinned, multiples of ``keep_every``) are not read: ``assumed`` committed. So the reads
    of a commit grow with what it deletes, not with the history."""
    good: dict[int, Manifest] = {}
    bad: dict[int, str] = {}
    older = [e for e in sorted(manifests, reverse=True) if e <= newest]
    want = max(policy.keep_last or 0, 1)
    i = 0
    while i < len(older) and len(good) < want:
        g, b = read_manifests(d, [older[i]])
        good.update(g)
        bad.update(b)
        i += 1
    rest = older[i:]
    kept = {e for e in rest if e in pins or (policy.keep_every is not None and e % policy.keep_every == 0)}
    g, b = read_manifests(d, [e for e in rest if e not in kept])
    good.update(g)
    bad.update(b)
    return good, bad, kept


def _manifest_absent(d: CheckpointDirectory, epoch: int) -> bool:
    """True only when the store says the manifest file of ``epoch`` does not exist (an error
    asking it means: it may exist, keep the epoch)."""
    try:
        d.records.size(d.manifest_path(epoch))
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def apply_retention(d: CheckpointDirectory, newest: int, policy: RetentionPolicy, node_names: Iterable[str]) -> list[int]:
    """Delete what ``policy`` drops from ``d`` now that ``newest`` is committed; return the
    epochs deleted, oldest first. Epochs newer than ``newest`` (about to be overwritten) and
    pinned ones are kept; dbs of older epochs that have no manifest file at all are removed.
    An epoch whose manifest file exists but cannot be read (an I/O error at that moment) or
    parsed (damage) is kept, named in a warning: only what is known may be deleted is.
    ``node_names``: the job's nodes (with those the manifests list, the only db names touched)."""
    if policy.keeps_everything:
        return []
    try:
        pins = d.pins()
    except CheckpointError as ex:
        logger.warning("Retention skipped: %s", ex)
        return []
    manifests = d.manifest_epochs()
    if policy.keep_best is None:  # only what keep_last/keep_every decide on is read
        good, unreadable, assumed = _read_needed(d, manifests, newest, set(pins), policy)
    else:  # every candidate's recorded metric
        (good, unreadable), assumed = read_manifests(d, manifests), set()
    if unreadable:
        logger.warning(
            "Retention keeps epoch(s) %s: their manifest exists but cannot be read or is damaged (%s)",
            ", ".join(map(str, sorted(unreadable))), "; ".join(unreadable[e] for e in sorted(unreadable)),
        )
    committed = sorted(set(good) | assumed)
    newer = {e for e in manifests if e > newest}
    metrics = None
    if policy.keep_best is not None:  # epochs whose manifest could not be read are absent: kept
        metrics = {e: metric_value(m.metrics.get(str(policy.metric))) for e, m in good.items()
                   if not metric_unreadable(m.metrics.get(str(policy.metric)))}
    doomed = epochs_to_delete(committed, newest, pins, policy, protect=newer | set(unreadable), metrics=metrics)
    # only files named exactly as an epoch's dbs of a known node are ever deleted (a
    # README.1 beside the dbs is not one; nor a file a damaged manifest names: refused)
    known = set(node_names)
    for m in good.values():
        known.update(m.nodes)
    scanned = d.scan()

    def on_disk(e: int) -> dict[str, str]:  # (asked only of the epochs deleted: CPU per commit)
        return {n: p for n, p in scanned.get(e, {}).items()
                if n in known and os.path.basename(p) == os.path.basename(d.db_path(n, e))}

    for epoch in doomed:
        nodes = good[epoch].nodes
        files = [d.db_path(n, epoch) for n, entry in nodes.items()
                 if entry.file == os.path.basename(d.db_path(n, epoch))]
        d.records.delete(d.manifest_path(epoch))
        d.records.sync_dir(d.records_dir)
        for path in {*files, *on_disk(epoch).values()}:
            d.records.delete(path)
        logger.info("Retention: deleted the checkpoint of epoch %d", epoch)
    # leftovers of saves that never committed (or of a delete that was interrupted): dbs of
    # epochs older than the newest commit with no manifest file at all (asked once more)
    listed = set(manifests)
    for epoch in scanned:
        if epoch >= newest or epoch in listed or epoch in pins:
            continue
        dbs = on_disk(epoch)
        if dbs and _manifest_absent(d, epoch):
            for path in dbs.values():
                d.records.delete(path)
            logger.info("Retention: removed the uncommitted dbs of epoch %d: %s", epoch, sorted(dbs.values()))
    d.records.sync_dir(d.db_dir)
    return doomed


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def clean_temp_files(d: CheckpointDirectory) -> list[str]:
    """Remove temp files (``*.tmp.<host>.<pid>.<token>``) in the checkpoint and records
    directories of ``d`` whose host is this one and whose process is gone; return their
    paths. Another host's temp files are never touched (its process may still be writing);
    at a URL nothing is (staged uploads clean up after themselves)."""
    if d.records.remote:
        return []
    me, removed = atomic.hostname(), []
    for folder in (d.db_dir, d.records_dir):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            parsed = atomic.parse_temp_path(name)
            if parsed is None:
                continue
            _, host, pid = parsed
            if host != me or pid == os.getpid() or pid_alive(pid):
                continue
            path = os.path.join(folder, name)
            try:
                if _unlink(path):
                    removed.append(path)
            except OSError as ex:
                logger.warning("Cannot remove the leftover temp file %s: %s", path, ex)
    if removed:
        logger.info("Removed %d leftover temp file(s) of killed saves: %s", len(removed), removed)
    return removed


def clean_temp_keys(d: CheckpointDirectory) -> list[str]:
    """At a URL: remove the temporary keys of uploads that never finished
    (``<db>.tmp.upload.<hex>``: their writer was killed mid-upload) beside the dbs and the
    records, and on S3 abort the multipart uploads left in progress there; return their URLs. Called by the lease holder when it starts, so no save of its
    own is in flight; a writer that lost the lease may lose an upload in flight (it could not
    commit it anyway)."""
    if not d.records.remote:
        return []
    from ...storage.io.fsspec_store import TEMP_KEY_RE

    removed = []
    for folder in (d.db_dir, d.records_dir):
        abort = getattr(d.records, "abort_uploads", None)
        if abort is not None:
            removed.extend(abort(folder))
        for name, path in d.records.files(folder):
            if TEMP_KEY_RE.search(name) is None:
                continue
            try:
                if d.records.delete(path):
                    removed.append(path)
            except OSError as ex:
                logger.warning("Cannot remove the leftover upload %s: %s", path, ex)
    if removed:
        logger.info("Removed %d leftover upload key(s) of killed saves: %s", len(removed), removed)
    return removed
