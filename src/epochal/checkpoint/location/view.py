"""The read-only view of a checkpoint location (a local directory or a URL) and its records:
what tools (``epochal ls/stats/verify``), the handler and the mirror read. It never writes.

Layout, for ``db_prefix=D`` (the dbs are the seed's, ``D/<node>.<epoch>``; at a URL each
writer adds its token, ``D/<node>.<epoch>.<token>``: see :mod:`.naming`)::

    D/trainer_0.0  D/trainer_0.1 ...          one db per node per epoch (as its manifest names it)
    D/.epochal/manifest.<epoch>.json          the commit record of an epoch
    D/.epochal/stats.jsonl                    one JSON line per db saved / loaded
    D/.epochal/pins.json                      epochs that retention never deletes
    D/.epochal/index.json                     with keep_best: the metrics index (a cache, see .index)

An epoch exists (is *committed*) only when its manifest exists and is valid (see
:mod:`epochal.checkpoint.location.manifest`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from ...errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ...storage.formats.base import DbBackend, get_db_type
from ...storage.io.location import Location, location_for
from ...storage.io.seam import local_path
from .best import BestEpochs, best_of
from .manifest import DbEntry, Manifest, decode_manifest, manifest_name, parse_manifest_name
from .naming import RECORDS_DIR, db_name, names_db_of, new_token, split_db_file
from .records import STATS_FILE, RecordStore, records_for
from .stats import StatsLine

logger = logging.getLogger("epochal")

PINS_FILE = "pins.json"
#: the mark of a location where incremental steps may be (written before the first one's db):
#: retention then asks each kept step's db what it references; elsewhere it reads no db
INCREMENTAL_MARK = "incremental"
PINS_FORMAT = "epochal-pins"
#: how much of a committed epoch is checked: ``"full"`` (every checksum), ``"quick"`` (each
#: db's size and digest against the manifest), ``"none"`` (the manifest is valid and lists
#: files that exist). The one definition; the public API takes these strings.
VerifyLevel = Literal["full", "quick", "none"]
VERIFY_LEVELS: tuple[VerifyLevel, ...] = get_args(VerifyLevel)


@dataclass(frozen=True)
class EpochProblem:
    """One problem with a committed epoch's records (beside a db's own
    :class:`~epochal.storage.formats.base.DbProblem`): the epoch, the file at fault (its
    manifest, or a db it lists), the node whose db it is (None: the manifest as a whole),
    the blob at fault when a checksum named one, and ``text``: the one line that says it,
    naming the file (and blob). ``str()`` is that line."""

    epoch: int
    path: str
    text: str
    node: str | None = None
    blob: str | None = None

    def __str__(self) -> str:
        return self.text

    @classmethod
    def of(cls, epoch: int, e: BaseException, path: str, node: str | None = None) -> EpochProblem:
        """The problem an exception describes (a corrupt file's own path and blob when it
        names them)."""
        if isinstance(e, CheckpointCorruptError):
            return cls(epoch, e.path, str(e), node, e.blob)
        return cls(epoch, path, str(e), node)
#: seconds waited before each new try of a manifest read that failed with an I/O error
MANIFEST_READ_RETRIES = (0.05, 0.2)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CheckpointDirectory:
    """Read-only view of a checkpoint directory and its ``.epochal`` records.

    ``path_prefix`` (the seed's, plain concatenation) names the dbs instead of ``db_prefix``
    when given; the records then live beside those dbs. Either may be an fsspec URL
    (``storage_options`` then reach fsspec): the records are read through a
    :class:`~.records.RecordStore` either way.
    """

    def __init__(self, db_prefix: str | os.PathLike[str], path_prefix: str | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.db_prefix = local_path(db_prefix)
        self.path_prefix = local_path(path_prefix) if path_prefix else None
        if self.path_prefix:
            self.db_dir = os.path.dirname(self.path_prefix) or "."
            self._file_prefix = os.path.basename(self.path_prefix)
        else:
            self.db_dir = self.db_prefix or "."
            self._file_prefix = ""
        self.records_dir = os.path.join(self.db_dir, RECORDS_DIR)
        #: where the dbs and records live, with the options to reach them
        self.location: Location = location_for(self.db_dir, storage_options)
        self.records: RecordStore = records_for(self.location)
        #: manifests parsed so far: {epoch: (their bytes, the Manifest)} (:meth:`read_manifest`)
        self._parsed: dict[int, tuple[bytes, Manifest]] = {}
        #: db file names split so far (:meth:`scan`): {name: (node, epoch) or None}
        self._split: dict[str, tuple[str, int] | None] = {}

    def __repr__(self) -> str:
        return f"CheckpointDirectory({self.db_dir!r})"

    # -- names
    @property
    def file_prefix(self) -> str:
        """What each db file name starts with before ``<node>.<epoch>`` (the base name of
        ``path_prefix``; "" without one)."""
        return self._file_prefix

    def db_path(self, node_name: str, epoch: int) -> str:
        """Where the db of ``node_name`` at ``epoch`` lives: the file the epoch's manifest
        names for it (at a URL a writer's token is in the name: see :mod:`.naming`), else
        :meth:`plain_db_path`. The manifest is read once per view (the one parsed last for
        the epoch is used); one that names no valid db of that node and epoch (a forged
        ``../x``) is never followed: :meth:`epoch_problems` names it."""
        seen = self._parsed.get(int(epoch))
        if seen is None:
            try:
                manifest = self.read_manifest(int(epoch))
            except CheckpointError:  # not committed (or unreadable): the name a writer gives
                return self.plain_db_path(node_name, epoch)
        else:
            manifest = seen[1]
        entry = manifest.nodes.get(str(node_name))
        if entry is None or not names_db_of(entry.file, str(node_name), int(epoch), self._file_prefix):
            return self.plain_db_path(node_name, epoch)
        return self.path_of(entry.file)

    def plain_db_path(self, node_name: str, epoch: int) -> str:
        """The db name without a writer token (the seed's ``db_name``): a local directory's,
        and an older URL checkpoint's."""
        return db_name(epoch, node_name, self.db_prefix, self.path_prefix)

    def new_db_path(self, node_name: str, epoch: int) -> str:
        """Where a save of ``node_name`` at ``epoch`` writes its db: at a URL a name with a
        fresh writer token, which no other writer (nor another save) can produce, so a
        committed db is never overwritten; on a local disk (the writer lock is an OS lock)
        :meth:`plain_db_path`."""
        if not self.location.is_local:
            return db_name(epoch, node_name, self.db_prefix, self.path_prefix, new_token())
        return self.plain_db_path(node_name, epoch)

    def token_db_path(self, node_name: str, epoch: int, token: str | None) -> str:
        """The db name of ``node_name`` at ``epoch`` with a writer ``token`` drawn elsewhere
        (a DCP save's, shared by its ranks; None: :meth:`plain_db_path`)."""
        return db_name(epoch, node_name, self.db_prefix, self.path_prefix, token)

    def path_of(self, file: str) -> str:
        """The path (or URL) of a db file name beside the others (a manifest's ``DbEntry.file``)."""
        if self.location.is_local:
            return os.path.join(self.db_dir, file)
        return self.db_dir.rstrip("/") + "/" + file

    def note_manifest(self, epoch: int, manifest: Manifest) -> None:
        """Remember ``manifest`` as the one of ``epoch`` (its writer just wrote it): the db
        names :meth:`db_path` gives follow it."""
        self._parsed[int(epoch)] = (manifest.encode(), manifest)

    def manifest_path(self, epoch: int) -> str:
        return os.path.join(self.records_dir, manifest_name(epoch))

    @property
    def stats_path(self) -> str:
        return os.path.join(self.records_dir, STATS_FILE)

    @property
    def pins_path(self) -> str:
        return os.path.join(self.records_dir, PINS_FILE)

    # -- listing
    def manifest_epochs(self) -> list[int]:
        """Epochs that have a manifest file, valid or not, oldest first."""
        epochs = []
        for name, _ in self.records.files(self.records_dir):
            epoch = parse_manifest_name(name)
            if epoch is not None:
                epochs.append(epoch)
        return sorted(epochs)

    def has_incremental(self) -> bool:
        """Whether incremental steps may be here (:data:`INCREMENTAL_MARK`; the records
        folder's listing, remembered where the record store remembers it)."""
        return any(name == INCREMENTAL_MARK for name, _ in self.records.files(self.records_dir))

    def mark_incremental(self) -> None:
        """Mark the location before its first incremental db is written (once; never removed)."""
        if getattr(self, "_marked", False):  # (asked before every incremental save: listed once)
            return
        if not self.has_incremental():
            self.records.makedirs(self.records_dir)
            self.records.write(os.path.join(self.records_dir, INCREMENTAL_MARK), b"")
        self._marked = True

    def committed_epochs(self) -> list[int]:
        """Epochs with a valid manifest (the dbs are not read), oldest first: every manifest is
        read (at once, in parallel where the record store can); :meth:`newest_committed` and
        :meth:`is_committed` read one."""
        good, _ = self.read_manifests(self.manifest_epochs())
        return sorted(good)

    def base_db(self, node: str, epoch: int) -> str | None:
        """``node``'s db of the newest epoch committed before ``epoch``: what an incremental
        db of ``node`` at ``epoch`` is written against (None: no epoch committed before it, or
        that epoch has no db of ``node``: another world size). One listing and, unless newer
        manifests are damaged, one manifest read, however long the history."""
        for e in reversed(self.manifest_epochs()):
            if e >= epoch:
                continue
            try:
                nodes = self.read_manifest(e).nodes
            except CheckpointError:
                continue  # (not committed: a damaged or partial manifest)
            return self.db_path(node, e) if node in nodes else None
        return None

    def newest_committed(self) -> tuple[int, Manifest] | None:
        """The newest committed epoch and its manifest (None: none is committed), read from the
        newest down and stopping at the first valid manifest: one listing and, unless newer
        manifests are damaged, one read, however long the history (:meth:`committed_epochs`
        reads them all)."""
        for epoch in reversed(self.manifest_epochs()):
            try:
                return epoch, self.read_manifest(epoch)
            except CheckpointError:
                continue
        return None

    def is_committed(self, epoch: int) -> bool:
        """Whether ``epoch`` has a valid manifest (that manifest alone is read)."""
        try:
            self.read_manifest(int(epoch))
        except CheckpointError:
            return False
        return True

    def read_manifests(self, epochs: Iterable[int]) -> tuple[dict[int, Manifest], dict[int, str]]:
        """Each manifest of ``epochs`` read once (all at once, in parallel, where the record
        store can): ``({epoch: manifest}, {epoch: why it cannot be read or parsed})``. An epoch
        whose manifest vanished since the listing is in neither."""
        wanted = [int(e) for e in epochs]
        prefetch = getattr(self.records, "prefetch", None)
        if prefetch is not None and wanted:  # (a remembering store's reads then all hit)
            prefetch([self.manifest_path(e) for e in wanted])
        good: dict[int, Manifest] = {}
        bad: dict[int, str] = {}
        for epoch in wanted:
            try:
                good[epoch] = self.read_manifest(epoch)
            except CheckpointNotFoundError:
                continue
            except CheckpointError as ex:
                bad[epoch] = str(ex)
        return good, bad

    def manifest(self, epoch: int) -> dict[str, Any]:
        """The parsed manifest of ``epoch``.

        CheckpointNotFoundError when the epoch has none (it is not committed);
        CheckpointCorruptError naming the file when it is not a valid manifest of that epoch,
        or when reading it fails with an I/O error three times (waits of
        ``MANIFEST_READ_RETRIES`` between: a transient error does not make an epoch damaged).
        """
        path = self.manifest_path(epoch)
        return decode_manifest(self._manifest_bytes(epoch, path), path, epoch)

    def _manifest_bytes(self, epoch: int, path: str) -> bytes:
        """The bytes of the manifest file of ``epoch`` at ``path`` (the errors of :meth:`manifest`)."""
        for wait in (*MANIFEST_READ_RETRIES, None):
            try:
                return self.records.read(path)
            except FileNotFoundError:
                raise CheckpointNotFoundError(
                    f"epoch {epoch} is not committed: manifest {path} does not exist"
                ) from None
            except OSError as ex:  # EIO, EMFILE, a failed GET: maybe transient, try again
                if wait is None:
                    raise CheckpointCorruptError(
                        path, f"cannot read manifest ({len(MANIFEST_READ_RETRIES) + 1} tries): {ex}"
                    ) from ex
                logger.debug("reading %s failed (%s); trying again in %.2f s", path, ex, wait)
                time.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    def read_manifest(self, epoch: int) -> Manifest:
        """The manifest of ``epoch`` as a typed :class:`~.manifest.Manifest` (what the handler,
        the mirror and the tools use; :meth:`manifest` is the same as its JSON dict, with the
        same errors). Bytes read again unchanged (a remembering record store hands back the
        very same bytes) are not parsed again: a commit's retention looks at every manifest,
        and parsing them all made its CPU grow with the number of steps."""
        path = self.manifest_path(epoch)
        raw = self._manifest_bytes(epoch, path)
        seen = self._parsed.get(epoch)
        if seen is not None and (seen[0] is raw or seen[0] == raw):
            return seen[1]
        m = Manifest.from_dict(decode_manifest(raw, path, epoch))
        self._parsed[epoch] = (raw, m)
        return m

    def write_pins(self, epochs: set[int]) -> None:
        """Replace the pins file with ``epochs`` (atomically, as every record)."""
        self.records.makedirs(self.records_dir)
        data = {"format": PINS_FORMAT, "version": 1, "epochs": sorted(epochs)}
        self.records.write(self.pins_path, (json.dumps(data, indent=1) + "\n").encode("utf-8"))

    def pins(self) -> set[int]:
        """Pinned epochs (empty when there is no pins file); CheckpointCorruptError if unreadable."""
        path = self.pins_path
        try:
            raw = self.records.read(path)
        except FileNotFoundError:
            return set()
        except OSError as ex:
            raise CheckpointCorruptError(path, f"cannot read the pins file: {ex}") from ex
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as ex:
            raise CheckpointCorruptError(path, f"pins file is not valid JSON ({ex})") from None
        epochs = data.get("epochs") if isinstance(data, dict) else data
        if not isinstance(epochs, list) or not all(_is_int(e) and e >= 0 for e in epochs):
            raise CheckpointCorruptError(path, "pins file does not hold a list of epochs")
        return set(epochs)

    def stats(self) -> list[dict[str, Any]]:
        """Every stats line as a dict of the :class:`StatsLine` fields, in order (see
        :meth:`stats_lines`)."""
        return [line.as_dict() for line in self.stats_lines()]

    def stats_lines(self) -> list[StatsLine]:
        """Every stats line, typed, in order. A torn (incomplete) line is skipped, as is one
        that is JSON but not an object; a field of the wrong type raises
        :class:`~epochal.errors.CheckpointCorruptError` naming the log and the line."""
        try:
            raw = b"\n".join(self.records.read_stats(self.records_dir))
        except OSError as ex:
            raise CheckpointCorruptError(self.stats_path, f"cannot read the stats log: {ex}") from ex
        out = []
        for number, line in enumerate(raw.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                logger.debug("skipping a torn line of %s", self.stats_path)
                continue
            if isinstance(entry, dict):
                out.append(StatsLine.from_json(entry, self.stats_path, number))
        return out

    def scan(self) -> dict[int, dict[str, str]]:
        """``{epoch: {node: db path}}`` of every db file present, committed or not (temp files
        of interrupted saves and the records directory are ignored). Of several files of one
        node and epoch (writers' tokens: :meth:`db_files` lists them all) the name without
        a token, else the first by name."""
        found: dict[int, dict[str, str]] = {}
        for epoch, node, path in sorted(self.db_files(), reverse=True):  # (the first by name wins)
            found.setdefault(epoch, {})[node] = path
        return {e: dict(sorted(found[e].items())) for e in sorted(found)}

    def db_files(self) -> list[tuple[int, str, str]]:
        """``(epoch, node, path)`` of every db file present, committed or not, each writer's
        file of a node and epoch on its own (the listing, remembered where the record store
        remembers it; each name split once per view)."""
        out = []
        memo = self._split
        for name, path in self.records.files(self.db_dir):
            if name in memo:
                hit = memo[name]
            else:
                hit = memo[name] = split_db_file(name, self._file_prefix)
            if hit is not None:
                out.append((hit[1], hit[0], path))
        return out

    # -- checking
    def verify_epoch(self, epoch: int, full: bool = True, *, nodes: Iterable[str] | None = None) -> list[str]:
        """Problems with committed ``epoch`` (empty: it is intact), each naming the file (and
        blob). Checks the manifest, that every db it lists (or every one of ``nodes``) exists
        with the recorded size and digest, and with ``full`` re-checks every checksum. The
        lines of :meth:`epoch_problems`."""
        return self.check_epoch(epoch, "full" if full else "quick", nodes=nodes)

    def check_epoch(self, epoch: int, level: VerifyLevel = "full", *, nodes: Iterable[str] | None = None) -> list[str]:
        """:meth:`verify_epoch` with a level (:data:`VerifyLevel`): the lines of
        :meth:`epoch_problems`."""
        return [p.text for p in self.epoch_problems(epoch, level, nodes=nodes)]

    def require_intact(self, epoch: int, level: VerifyLevel = "quick", *, nodes: Iterable[str] | None = None,
                       word: str = "epoch") -> None:
        """CheckpointCorruptError naming every problem :meth:`epoch_problems` finds with the
        dbs of ``nodes`` of committed ``epoch`` (at the first file at fault), before a load
        uses them; nothing when they are intact."""
        problems = self.epoch_problems(epoch, level, nodes=nodes)
        if problems:
            raise CheckpointCorruptError(problems[0].path, f"{word} {epoch} cannot be loaded: "
                                         + "; ".join(p.text for p in problems))

    def epoch_problems(self, epoch: int, level: VerifyLevel = "full", *,
                       nodes: Iterable[str] | None = None) -> list[EpochProblem]:
        """The problems of committed ``epoch``, typed (empty: it is intact) at ``level``:
        ``"full"`` (checksums), ``"quick"`` (size and digest) or ``"none"`` (the manifest is
        valid and lists files that exist)."""
        if level not in VERIFY_LEVELS:
            raise ValueError(f"verify level must be one of {VERIFY_LEVELS}, got {level!r}")
        epoch = int(epoch)
        mpath = self.manifest_path(epoch)
        try:
            manifest = self.read_manifest(epoch)
        except CheckpointError as ex:
            return [EpochProblem.of(epoch, ex, mpath)]
        listed = manifest.nodes
        wanted = list(listed) if nodes is None else [str(n) for n in nodes]
        problems = []
        try:
            backend = get_db_type(manifest.db_type)
        except CheckpointError as ex:
            return [EpochProblem(epoch, mpath, f"{mpath}: {ex}")]
        for node in wanted:
            entry = listed.get(node)
            if entry is None:
                problems.append(EpochProblem(epoch, mpath, f"{mpath}: lists no db for node {node!r}", node))
                continue
            if not names_db_of(entry.file, node, epoch, self._file_prefix):
                expected = self.plain_db_path(node, epoch)
                problems.append(EpochProblem(epoch, mpath, f"{mpath}: node {node!r} names {entry.file!r}, "
                                                           f"expected {expected} (or that name with a writer "
                                                           "token)", node))
                continue
            path = self.path_of(entry.file)
            problems.extend(_check_db(self.records, backend, path, entry, level, epoch, node))
        return problems


def _check_db(records: RecordStore, backend: DbBackend, path: str, entry: DbEntry, level: VerifyLevel,
              epoch: int, node: str) -> list[EpochProblem]:
    def problem(text: str) -> list[EpochProblem]:
        return [EpochProblem(epoch, path, text, node)]

    try:
        size = records.size(path)
    except FileNotFoundError:
        return problem(f"{path}: missing (listed in the manifest)")
    except OSError as ex:
        return problem(f"{path}: cannot stat ({ex})")
    if level == "none":
        return []
    if size != entry.size:
        return problem(f"{path}: size is {size} bytes, the manifest says {entry.size} (truncated or replaced)")
    if entry.digest is not None:
        try:
            digest = backend.digest(path)
        except CheckpointError as ex:
            return [EpochProblem.of(epoch, ex, path, node)]
        except OSError as ex:
            return problem(f"{path}: cannot read ({ex})")
        if digest != entry.digest:
            return problem(f"{path}: digest is {digest}, the manifest says {entry.digest} (replaced or damaged)")
    if level == "full":
        try:
            backend.verify(path)
        except CheckpointError as ex:
            return [EpochProblem.of(epoch, ex, path, node)]
        except OSError as ex:
            return problem(f"{path}: cannot read ({ex})")
    return []


def best_of_directory(
    db_prefix: str | os.PathLike[str],
    *,
    metric: str | None = None,
    mode: str | None = None,
    k: int | None = None,
) -> BestEpochs | None:
    """The best committed epochs of the checkpoint directory ``db_prefix``.

    ``metric``/``mode``/``k`` default to the ``keep_best`` settings recorded in the newest
    committed manifest that has them; ``k=None`` there means every ranked epoch. None when no
    metric is given or recorded (the directory's job does not rank its checkpoints)."""
    return best_of(CheckpointDirectory(db_prefix), metric=metric, mode=mode, k=k)


__all__ = ["CheckpointDirectory", "EpochProblem", "VERIFY_LEVELS", "VerifyLevel", "best_of_directory"]
