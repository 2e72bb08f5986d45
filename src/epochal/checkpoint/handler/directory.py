"""A metadata handler that keeps its records in the checkpoint directory itself.

Layout, for ``db_prefix=D`` (the dbs are the seed's, ``D/<node>.<epoch>``)::

    D/trainer_0.0  D/trainer_0.1 ...          one db per node per epoch
    D/.epochal/manifest.<epoch>.json          the commit record of an epoch
    D/.epochal/stats.jsonl                    one JSON line per db saved / loaded
    D/.epochal/pins.json                      epochs that retention never deletes

An epoch exists (is *committed*) only when its manifest exists and is valid: the manifest
is written atomically (temp file, fsync, rename, directory fsync) after every node's db is
durable, and lists each db with its size and digest. Resuming picks the newest committed
epoch whose dbs all verify; a damaged one is skipped with a warning naming the file.

:class:`DirectoryMetadataHandler` is the handler that JobRunner drives; the read-only view of
such a directory (for tools: ``epochal ls/stats/verify``), :class:`CheckpointDirectory`, lives
in :mod:`epochal.checkpoint.location.view` and is re-exported here. Each node's entry of a commit is
:mod:`epochal.checkpoint.handler.commit`'s, what retention and temp cleanup delete
:mod:`epochal.checkpoint.handler.cleanup`'s, the room check :mod:`epochal.checkpoint.handler.room`'s, the stats
lines :mod:`epochal.checkpoint.location.stats`'s, the mirror work :mod:`epochal.checkpoint.mirroring.sync`'s.
See docs/reliability.md for the guarantees and how they are tested.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

from ...errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ...storage.formats.base import get_db_type
from ..location.best import collect_metrics, keep_best_record, recorded_metrics
from ..location.lease import DEFAULT_LEASE_SECONDS
from ..location.manifest import Manifest
from ..location.records import RecordLock
from ..location.retention import RetentionPolicy
from ..location.stats import stats_lines
from ..location.view import (
    VERIFY_LEVELS,
    CheckpointDirectory,
    EpochProblem,
    VerifyLevel,
    best_of_directory,
)
from ..mirroring.sync import MirrorSync
from . import cleanup, room
from .commit import commit_manifest, durable_entries
from .metadata import BaseMetadataHandler, DbReport, PushTarget
from .writer_lock import WriterLockHolder

logger = logging.getLogger("epochal")


def _utcnow() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _lines(problems: list[EpochProblem]) -> str:
    return "; ".join(p.text for p in problems)


class DirectoryMetadataHandler(WriterLockHolder, MirrorSync, BaseMetadataHandler):
    """The seed's metadata handler protocol, with its records in the checkpoint directory.

    ``keep_last``/``keep_every``/``keep_best``: retention (see
    :mod:`epochal.checkpoint.location.retention`; the defaults keep every epoch), applied after each
    commit. ``keep_best`` ranks epochs by ``metric`` (``mode`` ``"min"`` or ``"max"``): the
    value given to ``write(epoch, metrics=...)``, else the scalar blob of that name in the
    epoch's db; it is recorded in the manifest (``"metrics"``). ``verify``: how a candidate resume
    epoch is checked: ``"full"`` (every checksum, the default), ``"quick"`` (size and digest)
    or ``"none"`` (trust the manifest). A resume through JobRunner or the Checkpointer reads a
    ``"full"`` checkpoint once: the handler checks sizes and digests, the load every checksum
    (before any live object is touched), and an epoch it finds damaged is skipped for the
    previous committed one (:meth:`resume_epoch`, :meth:`reject_epoch`). ``clean_temp``: remove temp files of dead processes of
    this host on start (in ``set_params``). ``space_margin``: the fraction added to the previous
    checkpoint's size when ``cp_accessible`` checks for room.

    ``mirror``: a URL (``s3://bucket/run``, any fsspec filesystem; ``mirror_options`` go to
    fsspec) or a :class:`~epochal.checkpoint.mirroring.mirror.RemoteMirror`. Every committed epoch is
    then also pushed there (dbs first, manifest last); an epoch whose push fails stays
    committed locally, with a warning, and is pushed again after the next commit. When the
    remote has a newer committed epoch than the local directory (say the machine and its disk
    were lost), or an explicit resume epoch is only there, it is downloaded, verified and
    committed locally before the job resumes from it. Retention deletes at both ends.
    ``mirror_background`` (default True): pushes run in order on a background thread, so
    training does not wait for the network; ``flush()`` waits for them (JobRunner calls it
    when ``train`` ends, and it runs at interpreter exit).

    The checkpoint location may be an fsspec URL (``db_prefix="s3://bucket/run"``; see
    docs/remote.md): ``storage_options`` go to fsspec; the records are objects at the URL
    (one per stats report), the commit uses the sizes and digests the nodes reported
    (:meth:`report_dbs`), resume checks sizes and digests only (each node's load verifies
    every checksum), and the writer lock is a fenced lease of ``lease_seconds`` (default 60),
    renewed in the background and proved before each save and commit (:mod:`.lease`). ``mirror_from_nodes`` (default False): each node uploads its own
    db to the mirror in its save task, the driver only the manifest (for machines that share
    no disk; the save then waits for the upload), see :meth:`node_push_target`.
    """

    def __init__(
        self,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: str = "min",
        verify: VerifyLevel = "full",
        clean_temp: bool = True,
        space_margin: float = 0.05,
        mirror: Any = None,
        mirror_options: dict[str, Any] | None = None,
        mirror_background: bool = True,
        storage_options: dict[str, Any] | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        mirror_from_nodes: bool = False,
        incremental: bool = False,
    ) -> None:
        if verify not in VERIFY_LEVELS:
            raise ValueError(f"verify must be one of {VERIFY_LEVELS}, got {verify!r}")
        self.policy = RetentionPolicy(
            keep_last=keep_last, keep_every=keep_every, keep_best=keep_best, metric=metric, mode=mode
        )
        self.verify: VerifyLevel = verify
        self.clean_temp = clean_temp
        self.space_margin = float(space_margin)
        self.directory: CheckpointDirectory | None = None
        self.db_type = "native"
        self.node_names: list[str] = []
        self._pending_bytes: dict[str, int] = {}
        self._pending_pins: set[int] = set()
        self._pending_unpins: set[int] = set()
        self._expect_final: int | None = None
        if isinstance(mirror, str):
            from ..mirroring.mirror import RemoteMirror

            mirror = RemoteMirror(mirror, mirror_options)
        self.mirror = mirror
        self.mirror_background = bool(mirror_background)
        self._unpushed: set[int] = set()  # committed here, not yet at the mirror (worker-owned)
        self._lock: RecordLock | None = None
        self._lock_path = ""
        self._mirror_queue: Any = None
        self.storage_options = dict(storage_options or {})
        self.lease_seconds = float(lease_seconds)
        self._reported: dict[int, dict[str, DbReport]] = {}  # epoch -> what the nodes said
        self._node_pushed: set[int] = set()  # epochs whose every db its node pushed itself
        self.mirror_from_nodes = bool(mirror_from_nodes)
        self._rejected: set[int] = set()  # epochs whose load failed its checks in this run
        self._repulled: set[int] = set()  # ... and that were restored from the mirror once
        self._index: Any = None  # the metrics index keep_best ranks by (cleanup.metric_index)
        #: the managers' saves write incremental dbs on the newest committed epoch (native
        #: dbs; docs/format.md); retention keeps the files a kept epoch references either way
        self.incremental = bool(incremental)

    def __repr__(self) -> str:
        where = self.directory.db_dir if self.directory is not None else None
        return f"DirectoryMetadataHandler({where!r}, {self.policy}, verify={self.verify!r})"

    def _dir(self) -> CheckpointDirectory:
        if self.directory is None:
            raise CheckpointError("DirectoryMetadataHandler: set_params was not called (no checkpoint directory)")
        return self.directory

    # -- the seed's protocol
    def set_params(
        self,
        db_prefix: str,
        db_type: str,
        node_names: list[str],
        path_prefix: str | None = None,
        path_type: str | None = None,
    ) -> None:
        """Where the checkpoints live. Creates the records directory and, with ``clean_temp``,
        removes temp files left by killed saves of this host."""
        self.directory = CheckpointDirectory(db_prefix, path_prefix, self.storage_options or None)
        if self.directory.records.remote and self.mirror is not None:
            raise CheckpointError(f"{self.directory.db_dir} is a URL already: a mirror= of it is not supported")
        self.db_type = db_type or "native"
        self.node_names = [str(n) for n in node_names]
        self._expect_final = None  # a new run: nothing is known to be final yet
        try:
            self.directory.records.makedirs(self.directory.records_dir)
        except OSError as ex:
            logger.warning("Cannot create the checkpoint records directory %s: %s", self.directory.records_dir, ex)
            return
        if self._pending_pins or self._pending_unpins:
            try:
                self._update_pins(self._pending_pins, self._pending_unpins)
                self._pending_pins, self._pending_unpins = set(), set()
            except (OSError, CheckpointError) as ex:
                logger.warning("Cannot record pinned epochs in %s: %s", self.directory.pins_path, ex)
        if self.clean_temp:
            self.clean_temp_files()

    def last_epoch(self, user_epoch: int | None = None) -> int | None:
        """``user_epoch`` when given (it must be committed and intact, else CheckpointError);
        otherwise the newest committed epoch whose dbs all verify (at the ``verify`` level),
        None when there is none."""
        return self._choose(user_epoch, self.verify)

    def resume_epoch(self, user_epoch: int | None = None) -> int | None:
        """:meth:`last_epoch` for a resume whose load verifies every checksum itself (the
        runner's, the Checkpointer's): with ``verify="full"`` the candidates are checked for
        size and digest only and the load reads the checkpoint once, checking every byte
        before any live object is touched; a damaged epoch it finds is passed to
        :meth:`reject_epoch` and the previous intact one is chosen."""
        return self._choose(user_epoch, self._load_level())

    def reject_epoch(self, epoch: int, reason: str) -> bool:
        """The load of ``epoch`` failed its checks (``reason``): with ``verify="full"``,
        restore it once from the mirror, else never choose it again in this run, and return
        True (choose again). With ``"quick"``/``"none"`` the user trusts the files: False, the
        load's error stands."""
        if self.verify != "full":
            return False
        epoch = int(epoch)
        logger.warning("Checkpoint of epoch %d is damaged, not resuming from it: %s", epoch, reason)
        if self.mirror is not None and epoch not in self._repulled:
            self._repulled.add(epoch)
            if self._pull(epoch):
                return True
        self._rejected.add(epoch)
        return True

    def check_dbs(self, epoch: int, nodes: Sequence[str] | None = None, *, db_prefix: str | None = None) -> None:
        """Each db of committed ``epoch`` (of ``nodes``; None: all) against its manifest entry
        (size and digest, at the level a verifying load needs: see :meth:`resume_epoch`);
        CheckpointCorruptError naming the files that differ. ``verify="none"``: the user
        trusts the files, nothing is checked. ``db_prefix``: where to look before
        ``set_params`` (the seed's ``load_blobs_from_checkpoints`` without a run; read-only)."""
        level = self._load_level()
        if level == "none":
            return
        d = self.directory
        if d is None and db_prefix is not None:
            d = CheckpointDirectory(db_prefix, None, self.storage_options or None)
        if d is not None:
            d.require_intact(int(epoch), level, nodes=nodes)

    def _load_level(self) -> VerifyLevel:
        """The check a candidate gets when its load verifies: "full" becomes "quick" for db
        types whose loads check every checksum."""
        if self.verify == "full" and get_db_type(self.db_type).load_verifies:
            return "quick"
        return self.verify

    def _choose(self, user_epoch: int | None, level: VerifyLevel) -> int | None:
        d = self._dir()
        self.flush()  # our own pushes first: the mirror's listing must include them
        if user_epoch is not None:
            problems = self._problems(int(user_epoch), level)
            if problems and self.mirror is not None and self._pull(int(user_epoch)):
                problems = self._problems(int(user_epoch), level)
            if problems:
                if not d.records.exists(d.manifest_path(user_epoch)):
                    raise CheckpointNotFoundError(problems[0].text)
                raise CheckpointCorruptError(
                    d.manifest_path(user_epoch), f"epoch {user_epoch} cannot be resumed: " + _lines(problems)
                )
            return int(user_epoch)
        skipped: list[int] = []
        local: int | None = None
        for epoch in reversed(d.manifest_epochs()):
            if epoch in self._rejected:
                skipped.append(epoch)
                continue
            problems = self._problems(epoch, level)
            self._refuse_foreign(epoch, problems)
            if not problems:
                if skipped:
                    logger.warning(
                        "Resuming from epoch %d, the newest intact checkpoint (skipped damaged epochs %s)",
                        epoch, ", ".join(map(str, skipped)),
                    )
                local = epoch
                break
            skipped.append(epoch)
            logger.warning("Checkpoint of epoch %d is damaged, not resuming from it: %s", epoch, _lines(problems))
        if self.mirror is not None:
            newer = self._newest_from_mirror(local)
            if newer is not None:
                return newer
        if local is None and skipped:
            logger.warning("No intact checkpoint in %s: starting from scratch", d.db_dir)
        return local

    def write(self, epoch: int, metrics: dict[str, Any] | None = None) -> None:
        """Commit ``epoch``: make every node's db durable, then write its manifest atomically
        (with ``metrics``, and the retention metric, see the class doc); then apply retention.
        Raises (so the runner logs a failed save) when a db is missing."""
        d = self._dir()
        epoch = int(epoch)
        reported = self._reported.pop(epoch, {})
        if self.node_names and all(n in reported and reported[n].pushed for n in self.node_names):
            self._node_pushed.add(epoch)  # the mirror push is the manifest alone
        nodes = durable_entries(d, get_db_type(self.db_type), epoch, self.node_names, reported)
        manifest = Manifest(
            epoch=epoch,
            db_type=self.db_type,
            created=_utcnow(),
            final=self._expect_final == epoch,  # see expect_final
            nodes=nodes,
            metrics=collect_metrics(self.policy, metrics, [d.path_of(e.file) for e in nodes.values()],
                                    self.db_type, epoch),
            keep_best=keep_best_record(self.policy),
        )
        d.records.makedirs(d.records_dir)
        self._fence()  # a job that lost the lease stops here, before writing (CheckpointLockedError)
        # create-only at a URL: a writer paused past its lease never replaces a commit
        replaced = commit_manifest(d.records, d.manifest_path(epoch), manifest.encode(), self.storage_options or None,
                                   self._lock.fence if self._lock is not None else None)
        cleanup.drop_replaced_dbs(d, epoch, replaced, manifest)  # (at a URL: their own token names)
        d.note_manifest(epoch, manifest)  # (its db names, for this process's reads)
        logger.debug("Committed epoch %d: %s", epoch, d.manifest_path(epoch))
        try:
            self.apply_retention(epoch)
        except Exception as ex:  # retention must never undo a commit
            logger.warning("Retention after epoch %d failed: %s", epoch, ex)
        if self.mirror is not None:
            self._mirror_call(self._push, epoch, manifest)

    def report(self, action_name: str, stats: dict[str, int]) -> None:
        """Append one stats line per db (duration, and bytes from ``report_bytes``) to
        ``.epochal/stats.jsonl``. Never raises: a stats failure is a warning."""
        sizes, self._pending_bytes = self._pending_bytes, {}
        if self.directory is None or not stats:
            return
        data = stats_lines(_utcnow(), action_name, stats, sizes, self.node_names, self.directory.file_prefix)
        try:
            self._append_stats(data)
        except OSError as ex:
            logger.warning("Cannot append checkpoint stats to %s: %s", self.directory.stats_path, ex)

    def cp_accessible(self, epoch: int | None = None) -> bool:
        """Whether the next checkpoint can be written: the directory exists (it is created) and
        is writable, and its filesystem has room for a checkpoint the size of the newest one.
        A no is logged as a warning with the reason."""
        d = self._dir()
        if d.records.remote:
            self._fence()  # a job that lost the lease writes no db over the new holder's
            return True  # object storage: no folder to make, no free space to measure
        return room.writable(d) and room.fits(d, *self._space_needed())

    # -- epochal's optional extensions
    def location(self) -> str | None:
        """The checkpoint directory (None before ``set_params``)."""
        return self.directory.db_dir if self.directory is not None else None

    def report_bytes(self, action_name: str, sizes: dict[str, int]) -> None:
        """Bytes per db of the save/load that ``report`` is about to describe."""
        self._pending_bytes = dict(sizes)

    def expect_final(self, epoch: int) -> None:
        """The job's stop condition was reached at ``epoch``, which is about to be saved: its
        manifest is written with ``final: true`` in the same atomic write that commits it."""
        self._expect_final = int(epoch)

    def mark_final(self, epoch: int) -> None:
        """Record that committed ``epoch`` is the job's last (no-op when its manifest already
        says so). Never raises: a failure is a warning."""
        try:
            d = self._dir()
            manifest = d.read_manifest(int(epoch))
            if not manifest.final:
                self._fence()
                self._write_manifest(d.manifest_path(int(epoch)), dataclasses.replace(manifest, final=True))
                if self.mirror is not None:
                    self._mirror_call(self._push_final, int(epoch))
        except Exception as ex:
            logger.warning("Cannot mark epoch %s as the final one: %s", epoch, ex)

    def is_final(self, epoch: int) -> bool:
        """Whether committed ``epoch`` is a finished job's last epoch."""
        try:
            return self._dir().read_manifest(int(epoch)).final
        except CheckpointError:
            return False

    def committed_epochs(self) -> list[int]:
        """Epochs with a valid manifest, oldest first ([] before ``set_params``)."""
        return self.directory.committed_epochs() if self.directory is not None else []

    def pin(self, epoch: int) -> None:
        """Keep ``epoch`` whatever the retention policy (recorded in ``.epochal/pins.json``).
        Before ``set_params`` the pin is remembered and written then."""
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"cannot pin epoch {epoch}")
        if self.directory is None:
            self._pending_pins.add(epoch)
            self._pending_unpins.discard(epoch)
            return
        self._update_pins({epoch}, set())

    def unpin(self, epoch: int) -> None:
        """Undo :meth:`pin` (the epoch becomes subject to retention at the next commit)."""
        epoch = int(epoch)
        if self.directory is None:
            self._pending_unpins.add(epoch)
            self._pending_pins.discard(epoch)
            return
        self._update_pins(set(), {epoch})

    def pins(self) -> set[int]:
        """Pinned epochs."""
        if self.directory is None:
            return set(self._pending_pins)
        return self.directory.pins()

    def apply_retention(self, newest: int) -> list[int]:
        """Delete what the policy drops now that ``newest`` is committed; return the epochs
        deleted (see :func:`.cleanup.apply_retention`: manifest first, then dbs; newer and
        pinned epochs kept; dbs of older uncommitted epochs removed)."""
        if self.directory is None:
            return []
        self._index = cleanup.metric_index(self.directory, self.policy, self._index)  # kept across commits
        doomed = cleanup.apply_retention(self.directory, newest, self.policy, self.node_names, self._index)
        self._unpushed.difference_update(doomed)
        return doomed

    def clean_temp_files(self) -> list[str]:
        """Remove the temp files of this host's killed saves (see
        :func:`.cleanup.clean_temp_files`); return their paths."""
        return cleanup.clean_temp_files(self._dir())

    # -- internals
    def _metrics(self, epochs: Iterable[int]) -> dict[int, Any] | None:
        """``{epoch: recorded value of the retention metric}`` (None when not keeping best)."""
        return recorded_metrics(self._dir(), self.policy, epochs)

    def _problems(self, epoch: int, level: VerifyLevel) -> list[EpochProblem]:
        d = self._dir()
        # at a URL the driver checks sizes and digests only: reading every byte of every
        # node's db is each node's own load's job (it verifies every checksum)
        if d.records.remote and level == "full":
            level = "quick"
        problems = d.epoch_problems(epoch, level, nodes=self.node_names or None)
        if problems:
            return problems
        if self.node_names:
            db_type = d.read_manifest(epoch).db_type
            if db_type != self.db_type:
                mpath = d.manifest_path(epoch)
                return [EpochProblem(epoch, mpath, f"{mpath}: written with db_type {db_type!r}, this job uses {self.db_type!r}")]
        return []

    def _refuse_foreign(self, epoch: int, problems: list[EpochProblem]) -> None:
        """An epoch listing none of this job's nodes (written by JAX processes, by ranks...) is
        refused naming both node sets: it is not a damaged epoch to skip for an older one."""
        if not problems or not self.node_names or any(p.node is None for p in problems):
            return  # (None: the manifest itself is at fault, a damaged epoch)
        try:
            listed = self._dir().read_manifest(epoch).nodes
        except CheckpointError:  # (read a moment ago: a transient error, the epoch skipped)
            return
        if listed and not set(listed) & set(self.node_names):
            raise CheckpointError(
                f"{self._dir().manifest_path(epoch)}: epoch {epoch} was written by nodes {sorted(listed)}, "
                f"not by this job's {sorted(self.node_names)}: restore it with what wrote it ('proc<i>' "
                "dbs: epochal.jax.restore; 'rank<i>' dbs: the Checkpointer under torch.distributed)")

    def _space_needed(self) -> tuple[int, int]:
        """(bytes needed for the next checkpoint, epoch the estimate is based on); (0, -1) when
        there is no committed checkpoint to go by."""
        return room.space_needed(self._dir(), self.node_names, self.space_margin)

    def _append_stats(self, data: bytes) -> None:
        d = self._dir()
        d.records.add_stats(d.records_dir, data)

    def _update_pins(self, add: set[int], remove: set[int]) -> None:
        d = self._dir()
        self._fence()  # a job that lost the lease does not rewrite the new holder's pins
        d.write_pins((d.pins() | add) - remove)

    def _write_manifest(self, path: str, manifest: Manifest) -> None:
        """Write a manifest atomically, with its content checksum."""
        self._dir().records.write(path, manifest.encode())

    def node_push_target(self) -> PushTarget | None:
        """With ``mirror_from_nodes`` and a mirror (a :class:`~.mirror.RemoteMirror`): each
        node uploads the db it saves there from its own process, inside its save task
        (machines need not share a disk); the driver then pushes only the manifest. An upload
        a node could not make is pushed by the driver (if it sees the file)."""
        from ..mirroring.mirror import RemoteMirror

        if self.mirror_from_nodes and isinstance(self.mirror, RemoteMirror):
            return PushTarget(self.mirror.url, dict(self.mirror.storage_options))
        return None

    # -- records at a URL
    def report_dbs(self, epoch: int, dbs: dict[str, DbReport]) -> None:
        """What each node said of its db of ``epoch`` (size, digest), just before ``write``:
        the commit then records these and never opens a node's file."""
        self._reported[int(epoch)] = dict(dbs)


__all__ = ["CheckpointDirectory", "DirectoryMetadataHandler", "RetentionPolicy", "best_of_directory"]
