"""What is deleted from a checkpoint directory, and the rules that keep each delete safe.

* **Retention** (:func:`apply_retention`, after a commit): the epochs the policy of
  :mod:`epochal.checkpoint.location.retention` drops go manifest first (the epoch then no longer
  exists), then their dbs, so an interrupted delete never leaves a manifest naming missing
  files; dbs of older epochs that were never committed (killed or failed saves) go too,
  but only of epochs with no manifest file at all: an epoch whose manifest exists and cannot
  be read at that moment (EIO, EMFILE, a failed GET) or parsed is kept, named in a warning.
  Only files named exactly as an epoch's db of a known node are ever deleted, and never one
  that a kept step's incremental db takes bytes from (:mod:`.references`): it goes in a
  later pass, once no kept step references it.
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
from typing import Any

from ...errors import CheckpointError
from ...storage.io import atomic
from ..location.index import MetricIndex
from ..location.lock import pid_alive
from ..location.manifest import Manifest, decode_manifest
from ..location.naming import db_token, names_db_of
from ..location.retention import RetentionPolicy, best_epochs, metric_unreadable
from ..location.view import CheckpointDirectory
from .references import referenced

logger = logging.getLogger("epochal")

__all__ = ["apply_retention", "clean_orphan_dbs", "clean_temp_files", "clean_temp_keys", "drop_replaced_dbs",
           "metric_index", "read_manifests"]


def read_manifests(d: CheckpointDirectory, epochs: Iterable[int]) -> tuple[dict[int, Manifest], dict[int, str]]:
    """Each manifest of ``epochs`` read once: ``({epoch: manifest}, {epoch: why it cannot be
    read or parsed})``. An epoch whose manifest vanished since the listing is in neither."""
    return d.read_manifests(epochs)


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


class _Reads:
    """The manifests retention has read so far (each once): good ones, and why the others
    cannot be read."""

    def __init__(self, d: CheckpointDirectory) -> None:
        self.d = d
        self.good: dict[int, Manifest] = {}
        self.bad: dict[int, str] = {}
        self.gone: set[int] = set()  # listed, but the manifest vanished since

    def read(self, epochs: Iterable[int]) -> None:
        todo = [e for e in epochs if e not in self.good and e not in self.bad and e not in self.gone]
        if todo:
            good, bad = self.d.read_manifests(todo)
            self.good.update(good)
            self.bad.update(bad)
            self.gone.update(e for e in todo if e not in good and e not in bad)

    def newest_valid(self, listed: list[int], n: int) -> list[int]:
        """The ``n`` newest epochs of ``listed`` whose manifest is valid, read from the newest
        down (an unreadable one is not counted)."""
        found: list[int] = []
        rest = sorted(listed, reverse=True)
        while len(found) < n and rest:
            batch, rest = rest[:n - len(found)], rest[n - len(found):]
            self.read(batch)
            found.extend(e for e in batch if e in self.good)
        return found


def _best(reads: _Reads, recorded: dict[int, dict[str, Any]], listed: list[int], policy: RetentionPolicy) -> set[int]:
    """The epochs ``keep_best`` keeps: the best ranked by the metric (``recorded``: from the
    index; the manifests already read are the truth), each best one's manifest read and valid
    (one that is not is kept as unreadable, and the next in rank takes its place), and every
    epoch whose value cannot be ranked at all (see :mod:`..location.retention`)."""
    assert policy.keep_best is not None
    metric = str(policy.metric)
    while True:
        known = {**recorded, **{e: m.metrics for e, m in reads.good.items()}}
        values = {e: m.get(metric) for e, m in known.items()
                  if e not in reads.bad and e not in reads.gone and not metric_unreadable(m.get(metric))}
        best = best_epochs(values, policy.keep_best, policy.mode)
        fresh = [e for e in best if e not in reads.good]
        if not fresh:  # every best one read, valid, and ranked by its manifest's own value
            return set(best) | {e for e in listed if e not in values}
        reads.read(fresh)  # (one damaged or gone is no longer ranked: the next takes its place)


def metric_index(d: CheckpointDirectory, policy: RetentionPolicy, index: MetricIndex | None) -> MetricIndex | None:
    """The metrics index a handler keeps across its commits: ``index`` while it is ``d``'s, a
    new one (read at its first use) otherwise; None when ``policy`` keeps no best epochs."""
    if policy.keep_best is None:
        return None
    return index if index is not None and index.d is d else MetricIndex(d)


def apply_retention(d: CheckpointDirectory, newest: int, policy: RetentionPolicy, node_names: Iterable[str],
                    index: MetricIndex | None = None) -> list[int]:
    """Delete what ``policy`` drops from ``d`` now that ``newest`` is committed; return the
    epochs deleted, oldest first. Epochs newer than ``newest`` (about to be overwritten) and
    pinned ones are kept; dbs of older epochs that have no manifest file at all are removed.
    An epoch whose manifest file exists but cannot be read (an I/O error at that moment) or
    parsed (damage) is kept, named in a warning: only what is known may be deleted is.
    ``node_names``: the job's nodes (with those the manifests read list, the only db names
    touched). ``index``: the metrics index ``keep_best`` ranks by (read when None), updated.

    What is read does not grow with the history: the listing (one LIST per 1,000 objects at
    a URL), the pins, the manifests of the ``keep_last`` newest steps (from the newest down),
    of the steps about to be deleted and of the ``keep_best`` best ones, and the metrics index;
    ``keep_every`` and pins decide by the step number alone."""
    if policy.keeps_everything:
        clean_orphan_dbs(d, newest)
        return []
    try:
        pins = d.pins()
    except CheckpointError as ex:
        logger.warning("Retention skipped: %s", ex)
        return []
    manifests = d.manifest_epochs()
    reads = _Reads(d)
    newer = {e for e in manifests if e > newest}
    keep = set(pins) | newer | {newest}
    if policy.keep_last is not None:
        keep.update(reads.newest_valid(manifests, policy.keep_last))
    if policy.keep_every is not None:
        keep.update(e for e in manifests if e % policy.keep_every == 0)
    if policy.keep_best is not None:
        index = index if index is not None else MetricIndex(d)
        reads.read([newest])  # the commit just made (its entry is refreshed: it may replace one)
        if newest in reads.good:
            index.note(newest, reads.good[newest])
    by_rules = set(keep)
    recorded: dict[int, dict[str, Any]] = {}
    while True:
        if index is not None and any(e not in keep for e in manifests):
            recorded = recorded or index.metrics(manifests, reads.bad)
            keep = by_rules | _best(reads, recorded, manifests, policy)
        candidates = [e for e in manifests if e not in keep and e not in reads.bad and e not in reads.gone]
        reads.read(candidates)  # each epoch about to be deleted is read first: only valid ones go
        stale = [e for e in candidates if e in reads.good and e in recorded
                 and recorded[e] != reads.good[e].metrics]
        if not stale:
            break
        for e in stale:  # the index was wrong about it (rewritten behind its back): rank again
            recorded[e] = dict(reads.good[e].metrics)
    if reads.bad:
        logger.warning(
            "Retention keeps epoch(s) %s: their manifest exists but cannot be read or is damaged (%s)",
            ", ".join(map(str, sorted(reads.bad))), "; ".join(reads.bad[e] for e in sorted(reads.bad)),
        )
    doomed = [e for e in candidates if e in reads.good]
    # only files named exactly as an epoch's dbs of a known node are ever deleted (a
    # README.1 beside the dbs is not one; nor a file a damaged manifest names: refused)
    known = set(node_names)
    for m in reads.good.values():
        known.update(m.nodes)
    scanned: dict[int, list[str]] = {}
    for e, n, p in d.db_files():
        if n in known:
            scanned.setdefault(e, []).append(p)

    in_use: list[set[str] | None] = []  # names kept steps' dbs take bytes from (read once, when needed)

    def unused(paths: Iterable[str]) -> list[str]:
        """``paths`` but those a kept step references (all of them when that is unknown)."""
        paths = sorted(paths)
        if paths and not in_use and not d.has_incremental():  # no step here references another's db
            in_use.append(set())
        if paths and not in_use:
            in_use.append(referenced(d.db_path(n, e) for e in manifests if e not in doomed for n in sorted(known)))
        names = in_use[0] if in_use else set()
        if names is None:
            return []
        return [p for p in paths if os.path.basename(p) not in names]

    for epoch in doomed:  # its manifest's dbs, and every writer's db of it (a token each, at a URL)
        files = [d.path_of(entry.file) for n, entry in reads.good[epoch].nodes.items()
                 if names_db_of(entry.file, n, epoch, d.file_prefix)]
        d.records.delete(d.manifest_path(epoch))
        d.records.sync_dir(d.records_dir)
        for path in unused({*files, *scanned.get(epoch, ())}):
            d.records.delete(path)
        logger.info("Retention: deleted the checkpoint of epoch %d", epoch)
    # leftovers of saves that never committed (or of a delete that was interrupted): dbs of
    # epochs older than the newest commit with no manifest file at all (asked once more)
    listed = set(manifests)
    for epoch, dbs in scanned.items():
        if epoch >= newest or epoch in listed or epoch in pins:
            continue
        if dbs and _manifest_absent(d, epoch):
            gone = unused(dbs)
            for path in gone:
                d.records.delete(path)
            if not gone:
                continue
            logger.info("Retention: removed the uncommitted dbs of epoch %d: %s", epoch, sorted(dbs))
    clean_orphan_dbs(d, newest, {e: m for e, m in reads.good.items() if e not in doomed})
    d.records.sync_dir(d.db_dir)
    if index is not None:
        for epoch, manifest in reads.good.items():  # what was read is the truth: the index follows
            index.note(epoch, manifest)
        index.forget(doomed)
        index.save()
    return doomed


def clean_orphan_dbs(d: CheckpointDirectory, newest: int | None = None,
                     known: dict[int, Manifest] | None = None) -> list[str]:
    """At a URL: delete the dbs of writers that lost the lease (paused inside an upload past
    it, or killed), named with their own token, of committed epochs (up to ``newest``) whose
    manifest names another file for that node; return their URLs. Only the lease holder
    calls this (after its commit, and as it takes the lease), so no save that could still
    commit such a db is in flight. Never deleted: a file a manifest names, a name without a
    writer token, a db of an epoch whose manifest is missing (retention's rule) or does not
    read, one that a kept incremental step takes bytes from. Only epochs with more than one
    db of a node are looked at (their manifests read, ``known``: those already read), so a
    commit in the steady state reads nothing more."""
    if not d.records.remote:
        return []
    by: dict[tuple[int, str], list[str]] = {}
    for e, n, p in d.db_files():
        if newest is None or e <= newest:
            by.setdefault((e, n), []).append(p)
    several = {e for (e, _), paths in by.items() if len(paths) > 1}
    if not several:
        return []
    listed = set(d.manifest_epochs())
    good = {e: m for e, m in (known or {}).items() if e in several}
    got, _ = d.read_manifests(sorted(e for e in several if e in listed and e not in good))
    good.update(got)
    doomed: list[str] = []
    for (e, n), paths in sorted(by.items()):
        entry = good[e].nodes.get(n) if e in good and len(paths) > 1 else None
        if entry is None or not names_db_of(entry.file, n, e, d.file_prefix):
            continue
        doomed.extend(p for p in paths
                      if os.path.basename(p) != entry.file and db_token(os.path.basename(p)) is not None)
    if doomed and d.has_incremental():  # never one a committed step takes bytes from
        every, bad = d.read_manifests(sorted(listed))
        names = None if bad else referenced(d.path_of(x.file) for m in every.values() for x in m.nodes.values())
        doomed = [] if names is None else [p for p in doomed if os.path.basename(p) not in names]
    removed = [p for p in doomed if d.records.delete(p)]
    if removed:
        logger.info("Removed %d db(s) of writers that lost the lease (no manifest names them): %s",
                    len(removed), removed)
    return removed


def drop_replaced_dbs(d: CheckpointDirectory, epoch: int, replaced: bytes | None, manifest: Manifest) -> list[str]:
    """After the holder saved ``epoch`` again (its ``manifest`` replaced the ``replaced``
    bytes): delete the dbs the old manifest named and the new one does not (at a URL each
    save's own token names them; nothing else names them); return their paths. Left to
    the next holder's cleanup where a kept incremental step may take bytes from them, or the
    old manifest does not parse."""
    if replaced is None or not d.records.remote or d.has_incremental():
        return []
    try:
        old = Manifest.from_dict(decode_manifest(replaced, d.manifest_path(epoch), epoch))
    except CheckpointError:
        return []
    named = {entry.file for entry in manifest.nodes.values()}
    gone = [d.path_of(e.file) for n, e in sorted(old.nodes.items()) if e.file not in named
            and db_token(e.file) is not None and names_db_of(e.file, n, epoch, d.file_prefix)]
    try:
        return [p for p in gone if d.records.delete(p)]
    except OSError as ex:  # the commit stands; the next holder's cleanup removes them
        logger.warning("Cannot remove the dbs step %d was saved over: %s", epoch, ex)
        return []


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
    from ...storage.io.remote.fsspec_store import TEMP_KEY_RE

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
    return removed + clean_orphan_dbs(d)
