"""A checkpoint directory as the commands see it: epochs, files, commit records, pins and
the save/load stats log (``epochal ls``, ``verify PREFIX``, ``stats``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..checkpoint.location.best import BestEpochs
from ..checkpoint.location.manifest import DbEntry, Manifest
from ..checkpoint.location.stats import StatsLine
from ..checkpoint.location.view import EpochProblem
from ..errors import CheckpointError
from ..storage.io.seam import is_url
from .dbs import verify_file
from .hf_dirs import hf_checkpoints, list_hf, verify_hf
from .names import RECORDS_DIR, parse_db_name, resolve_db_url
from .problems import Problem, one_line
from .values import iso_time

__all__ = ["LS_NEWEST", "Records", "held_bytes", "list_prefix", "ls_prefix", "stats_prefix", "verify_target"]

#: file systems whose bytes are host memory
RAM_FS = ("tmpfs", "ramfs")


class Records:
    """The CLI's view of a checkpoint directory: the records of
    :class:`epochal.checkpoint.handler.directory.CheckpointDirectory` when that module is present,
    else what the file names alone tell (``<node>.<epoch>``, nothing committed)."""

    def __init__(self, prefix: str) -> None:
        if is_url(prefix):
            self._init_url(prefix)
            return
        if not os.path.isdir(prefix):
            if os.path.exists(prefix):
                raise Problem(f"{prefix}: not a directory (give the db_prefix directory of a job)")
            raise Problem(f"{prefix}: no such directory")
        self.prefix = prefix
        self.has_records = os.path.isdir(os.path.join(prefix, RECORDS_DIR))
        self._dir: Any = None
        try:
            from ..checkpoint.location.view import CheckpointDirectory
        except ImportError:
            return
        try:
            self._dir = CheckpointDirectory(prefix)
        except (CheckpointError, OSError, ValueError) as e:
            raise Problem(one_line(e, prefix)) from None

    def _init_url(self, prefix: str) -> None:
        """A URL (s3://bucket/run): its records through the checkpoint module's record store."""
        from ..checkpoint.location.record_cache import CachedRecords
        from ..checkpoint.location.view import CheckpointDirectory

        self.prefix = prefix.rstrip("/")
        try:
            self._dir = CheckpointDirectory(self.prefix)
            # one command's snapshot: listings once, sizes from them, records read in parallel
            self._dir.records = CachedRecords(self._dir.records, sizes_from_listing=True)
            with ThreadPoolExecutor(2) as pool:  # the two folders listed at once (remembered)
                here, records = pool.map(self._dir.records.files, [self._dir.db_dir, self._dir.records_dir])
            self.has_records = bool(records)
        except (CheckpointError, OSError, ValueError) as e:
            raise Problem(one_line(e, prefix)) from None
        if not here and not self.has_records:
            raise Problem(f"{prefix}: nothing at this URL (no db files, no records)")

    def file_record(self, path: str | None) -> dict[str, Any]:
        """Presence, size and time of one db file (a URL's has no time here)."""
        if path is None or not is_url(path):
            return _file_record(path)
        try:
            size = self._dir.records.size(path)
        except (FileNotFoundError, OSError):
            return {"path": path, "present": False, "size": None, "modified": None}
        return {"path": path, "present": True, "size": size, "modified": None}

    def _call(self, method: str, *args: Any, default: Any = None) -> Any:
        fn = getattr(self._dir, method, None) if self._dir is not None else None
        if fn is None:
            return default
        try:
            return fn(*args)
        except (CheckpointError, OSError, ValueError) as e:
            raise Problem(one_line(e, self.prefix)) from None

    def scan(self) -> dict[int, dict[str, str]]:
        """epoch -> {node: db path} of every db file present, committed or not."""
        found = self._call("scan")
        if found is not None:
            return {int(e): dict(nodes) for e, nodes in found.items()}
        out: dict[int, dict[str, str]] = {}
        for entry in sorted(os.listdir(self.prefix)):
            full = os.path.join(self.prefix, entry)
            parsed = parse_db_name(entry)
            if parsed is None or not os.path.isfile(full):
                continue
            out.setdefault(parsed[1], {})[parsed[0]] = full
        return out

    def committed(self) -> list[int]:
        return sorted(int(e) for e in self._call("committed_epochs", default=[]) or [])

    def manifest_epochs(self) -> list[int]:
        """Epochs that have a manifest file, valid or not (the listing alone: nothing read)."""
        return sorted(int(e) for e in self._call("manifest_epochs", default=[]) or [])

    def manifests(self, epochs: list[int]) -> dict[int, Manifest | None]:
        """The typed manifest of each of ``epochs`` (read at once, in parallel at a URL); None
        for one that is gone or does not read."""
        got = self._call("read_manifests", epochs)
        good = got[0] if got is not None else {}
        return {e: good.get(e) for e in epochs}

    def manifest(self, epoch: int) -> Manifest | None:
        """The typed manifest of ``epoch``; None when it has none or it does not read."""
        try:
            m = self._call("read_manifest", epoch)
        except Problem:
            return None
        return m if isinstance(m, Manifest) else None

    def pins(self) -> set[int]:
        return {int(e) for e in self._call("pins", default=set()) or set()}

    def stats(self) -> list[StatsLine]:
        """The stats log's lines, typed (a line of the wrong types: a Problem naming it)."""
        return list(self._call("stats_lines", default=[]) or [])

    def damaged_manifests(self) -> dict[int, str]:
        """Epochs whose manifest file exists but does not read (damaged or forged, so the
        epoch is not committed): what is wrong with each."""
        out: dict[int, str] = {}
        epochs = self.manifest_epochs()
        self.manifests(epochs)  # read at once (in parallel at a URL), then one by one for the errors
        for e in epochs:
            try:
                self._dir.read_manifest(e)
            except (CheckpointError, OSError, ValueError) as ex:
                out[int(e)] = one_line(ex, self.prefix)
        return out

    def verify_epoch(self, epoch: int) -> list[EpochProblem]:
        """Problems of a committed epoch's records (missing files, sizes, digests)."""
        return list(self._call("epoch_problems", epoch, "quick", default=[]) or [])


def _file_record(path: str | None) -> dict[str, Any]:
    if path is None or not os.path.exists(path):
        return {"path": path, "present": False, "size": None, "modified": None}
    st = os.stat(path)
    return {"path": path, "present": True, "size": st.st_size, "modified": iso_time(st.st_mtime)}


#: the epochs ``epochal ls`` shows without ``--all``: the newest ones
LS_NEWEST = 20


def list_prefix(prefix: str, limit: int | None = None) -> dict[str, Any]:
    """``epochal ls``: the epochs with their db files per node, commit state, sizes, times and
    pins; the newest ``limit`` of them (None: every one), ``older`` saying how many are left
    out. Only the manifests of the epochs shown are read."""
    return ls_prefix(prefix, limit)[0]


def ls_prefix(prefix: str, limit: int | None = None) -> tuple[dict[str, Any], BestEpochs | None]:
    """:func:`list_prefix`, and the best epochs when the job ranks them (see :func:`_best`)."""
    folders = hf_checkpoints(prefix)
    if folders:  # a Hugging Face Trainer's output directory
        return list_hf(prefix, folders), None
    rec = Records(prefix)
    present = rec.scan()
    listed = rec.manifest_epochs()
    every = sorted(set(present) | set(listed))
    shown = every if limit is None else every[-limit:] if limit > 0 else []
    have = set(listed)
    manifests = rec.manifests([e for e in shown if e in have])
    committed = {e for e, m in manifests.items() if m is not None}
    older = len(every) - len(shown)
    shown = [e for e in shown if e in present or e in committed]  # (a damaged manifest alone: no epoch)
    pins = rec.pins()
    nodes: list[str] = []
    for e in shown:
        m = manifests.get(e)
        for n in list(m.nodes if m is not None else ()) + sorted(present.get(e, {})):
            if n not in nodes:
                nodes.append(n)
    epochs = []
    for e in shown:
        m = manifests.get(e)
        mnodes: dict[str, DbEntry] = m.nodes if m is not None else {}
        files: dict[str, Any] = {}
        for n in nodes:
            named = mnodes[n].file if n in mnodes else None  # (at a URL: a writer's token in it)
            if named and os.path.basename(named) == named:
                path: str | None = os.path.join(prefix, named)
            else:
                path = present.get(e, {}).get(n)
            if path is None and n in mnodes:
                path = os.path.join(prefix, f"{n}.{e}")
            if path is None:
                continue
            files[n] = rec.file_record(path)
            if n in mnodes:
                files[n]["recorded_size"] = mnodes[n].size
        is_committed = e in committed
        final = m.final if is_committed and m is not None else False
        missing = [n for n, f in files.items() if not f["present"]]
        if is_committed and missing:
            state = "missing files"
        elif is_committed:
            state = "final" if final else "committed"
        elif rec.has_records:
            state = "uncommitted"
        else:
            state = "unknown"
        times = [f["modified"] for f in files.values() if f["modified"]]
        epochs.append({
            "epoch": e,
            "state": state,
            "committed": is_committed if rec.has_records else None,
            "final": final,
            "pinned": e in pins,
            "db_type": m.db_type if m is not None else None,
            "created": (m.created if m is not None else None) or (max(times) if times else None),
            "size": sum(f["size"] or 0 for f in files.values()),
            "files": files,
            "missing": missing,
        })
    listing = {"prefix": prefix, "records": rec.has_records, "nodes": nodes, "epochs": epochs,
               "older": older}
    held = held_bytes(prefix)
    if held is not None:
        listing["held"] = held
    return listing, _best(rec, manifests, listed)


def held_bytes(prefix: str) -> dict[str, Any] | None:
    """The bytes a local directory holds (None for a URL or a missing directory), by part of a
    Checkpointer's local tier: ``own`` (its own steps: the directory itself, or under ranks
    its ``rank<r>/``), ``peers`` (``peer/``: other ranks' copies), ``fetched`` (a peer copy
    fetched for a restore); ``ram``: whether the file system is RAM-backed (tmpfs), where these
    bytes are host memory; ``ranks``: the per-rank locations under it (each one ``epochal ls``
    lists). Every file is counted, committed or not: what the memory actually holds."""
    if is_url(prefix) or not os.path.isdir(prefix):
        return None
    parts = {"own": 0, "peers": 0, "fetched": 0}
    locations: list[str] = []
    for root, _, files in os.walk(prefix):
        rel = os.path.relpath(root, prefix)
        top = rel.split(os.sep)[0]
        part = "peers" if top == "peer" else "fetched" if top == "fetched" else "own"
        if os.path.basename(root) == RECORDS_DIR and rel != RECORDS_DIR:
            locations.append(os.path.dirname(rel))
        for name in files:
            with contextlib.suppress(OSError):
                parts[part] += os.lstat(os.path.join(root, name)).st_size
    return {**parts, "total": sum(parts.values()), "ram": _fs_type(prefix) in RAM_FS,
            "ranks": sorted(locations)}


def _fs_type(path: str) -> str | None:
    """The type of the file system ``path`` lies on (from /proc/mounts; None elsewhere)."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best: tuple[int, str | None] = (-1, None)
    for point, fs in mounts:
        point = point.replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > best[0]:
            best = (len(point), fs)
    return best[1]


def _best(rec: Records, manifests: dict[int, Manifest | None], listed: list[int]) -> BestEpochs | None:
    """The best epochs of the job, when the newest manifest shown that records ``keep_best``
    says how it ranks (None otherwise): every committed epoch's value from the metrics index,
    the manifests shown and those the index lacks being read (see
    :mod:`epochal.checkpoint.location.index`; never written here)."""
    spec = next((m.keep_best for _, m in sorted(manifests.items(), reverse=True)
                 if m is not None and m.keep_best is not None), None)
    if spec is None or rec._dir is None:
        return None
    from ..checkpoint.location.index import MetricIndex
    from ..checkpoint.location.retention import best_epochs, metric_unreadable, metric_value

    unreadable = {e: "" for e, m in manifests.items() if m is None}
    try:
        recorded = MetricIndex(rec._dir).metrics(listed, unreadable)
    except (CheckpointError, OSError, ValueError) as e:
        raise Problem(one_line(e, rec.prefix)) from None
    recorded.update({e: dict(m.metrics) for e, m in manifests.items() if m is not None})
    raw = {e: r.get(spec.metric) for e, r in recorded.items()}
    values = {e: metric_value(v) for e, v in raw.items()}
    k = spec.k if spec.k > 0 else None
    best = best_epochs(values, k if k is not None else len(values), spec.mode)
    return BestEpochs(spec.metric, spec.mode, k, best, values,
                      frozenset(e for e, v in raw.items() if metric_unreadable(v)))


#: file names (suffixes) in a local directory that ``verify PREFIX`` checks besides the
#: ``<node>.<epoch>`` dbs: checkpoints named by another framework (Lightning's ``*.ckpt``,
#: written by ``epochal.integrations.lightning``); one that is no epochal db is reported
LOOSE_SUFFIXES = (".ckpt",)


def loose_checkpoints(prefix: str) -> list[str]:
    """The ``*.ckpt`` files directly in the local directory ``prefix`` (none at a URL)."""
    if is_url(prefix):
        return []
    out = []
    for entry in sorted(os.listdir(prefix)):
        full = os.path.join(prefix, entry)
        if entry.endswith(LOOSE_SUFFIXES) and not entry.startswith(".") and os.path.isfile(full):
            out.append(full)
    return out


def _is_prefix(target: str) -> bool:
    """A checkpoint directory (or URL prefix), not one db file."""
    if not is_url(target):
        return os.path.isdir(target)
    from ..storage.io.seam import store_for

    return not store_for(target).exists(target)


def verify_target(target: str, db_type: str | None = None) -> dict[str, Any]:
    """``epochal verify PREFIX|DB``: every db file of a prefix (or the one db), and every
    committed epoch's records (files missing, sizes and digests not as recorded). A Hugging
    Face Trainer's checkpoint folder (or output directory): every file each step records."""
    folders = hf_checkpoints(target)
    if folders:
        return verify_hf(target, folders)
    target = resolve_db_url(target)  # a URL's <prefix>/<node>.<epoch>: the db its manifest names
    if not _is_prefix(target):
        f = verify_file(target, db_type)
        return {"target": target, "ok": f["ok"], "files": [f], "epochs": []}
    rec = Records(target)
    present = rec.scan()
    each = _parallel if is_url(target) else _serial  # a URL's requests go out in parallel
    files = each(lambda p: verify_file(p, db_type), [present[e][n] for e in sorted(present) for n in sorted(present[e])])
    files.extend(verify_file(path, db_type) for path in loose_checkpoints(target))
    damaged = rec.damaged_manifests()
    chosen = sorted(set(rec.committed()) | set(damaged))
    found = each(lambda e: [f"manifest damaged, so the epoch is not committed: {damaged[e]}"] if e in damaged
                 else [p.text for p in rec.verify_epoch(e)], chosen)
    epochs = [{"epoch": e, "ok": not probs, "problems": probs} for e, probs in zip(chosen, found)]
    ok = all(f["ok"] for f in files) and all(e["ok"] for e in epochs)
    return {"target": target, "ok": ok, "files": files, "epochs": epochs}


def _serial(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    return [fn(x) for x in items]


def _parallel(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``[fn(x) for x in items]``, several at a time (requests to object storage), in order."""
    from ..checkpoint.location.record_cache import PARALLEL_REQUESTS

    if len(items) <= 1 or PARALLEL_REQUESTS <= 1:
        return _serial(fn, items)
    with ThreadPoolExecutor(min(PARALLEL_REQUESTS, len(items))) as pool:
        return list(pool.map(fn, items))


def stats_prefix(prefix: str) -> dict[str, Any]:
    """``epochal stats PREFIX``: every save/load record of the stats log with seconds and
    throughput, and a summary per (action, node)."""
    rec = Records(prefix)
    rows: list[dict[str, Any]] = []
    for line in rec.stats():
        ns = line.ns or 0
        nbytes = line.bytes
        seconds = ns / 1e9
        rows.append({
            "time": line.time,
            "action": str(line.action),
            "epoch": line.epoch,
            "node": line.node,
            "db": line.db,
            "seconds": seconds,
            "bytes": nbytes,
            "mb_per_s": (nbytes / 1e6 / seconds) if nbytes and seconds > 0 else None,
        })
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["action"], str(r["node"])), []).append(r)
    summary = []
    for (action, node), rs in sorted(groups.items()):
        secs = [r["seconds"] for r in rs]
        total_bytes = sum(int(r["bytes"] or 0) for r in rs)
        summary.append({
            "action": action,
            "node": node,
            "count": len(rs),
            "mean_seconds": sum(secs) / len(secs),
            "max_seconds": max(secs),
            "total_bytes": total_bytes,
            "mb_per_s": (total_bytes / 1e6 / sum(secs)) if total_bytes and sum(secs) > 0 else None,
        })
    return {"prefix": prefix, "records": rows, "summary": summary}
