"""A checkpoint directory as the commands see it: epochs, files, commit records, pins and
the save/load stats log (``epochal ls``, ``verify PREFIX``, ``stats``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..checkpoint.location.manifest import DbEntry, Manifest
from ..checkpoint.location.stats import StatsLine
from ..checkpoint.location.view import EpochProblem
from ..errors import CheckpointError
from ..storage.io.seam import is_url
from .dbs import verify_file
from .hf_dirs import hf_checkpoints, list_hf, verify_hf
from .names import RECORDS_DIR, parse_db_name
from .problems import Problem, one_line
from .values import iso_time

__all__ = ["Records", "list_prefix", "stats_prefix", "verify_target"]


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
            here = self._dir.records.files(self._dir.db_dir)
            self.has_records = bool(self._dir.records.files(self._dir.records_dir))
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

    def prefetch_manifests(self, epochs: list[int]) -> None:
        """Read these epochs' manifests at once (a URL's, in parallel requests)."""
        records = getattr(self._dir, "records", None)
        if records is not None and hasattr(records, "prefetch"):
            records.prefetch([self._dir.manifest_path(e) for e in epochs])

    def manifest_epochs(self) -> list[int]:
        """Epochs with a manifest file (valid or not): a listing, nothing read."""
        return sorted(int(e) for e in self._call("manifest_epochs", default=[]) or [])

    def committed(self) -> list[int]:
        return sorted(int(e) for e in self._call("committed_epochs", default=[]) or [])

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
        for e in self._call("manifest_epochs", default=[]) or []:
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


def list_prefix(prefix: str, newest: int | None = None) -> dict[str, Any]:
    """``epochal ls``: the epochs (the ``newest`` ones; None: every one) with their db files
    per node, commit state, sizes, times, pins; ``older``: how many older ones are not shown.
    Only the manifests of the epochs shown are read (a listing of the rest)."""
    folders = hf_checkpoints(prefix)
    if folders:  # a Hugging Face Trainer's output directory
        return list_hf(prefix, folders)
    rec = Records(prefix)
    present = rec.scan()
    listed = rec.manifest_epochs()
    every = sorted(set(present) | set(listed))
    shown = every if newest is None or newest >= len(every) else every[len(every) - newest:]
    present = {e: present[e] for e in shown if e in present}
    rec.prefetch_manifests([e for e in shown if e in listed])  # (at a URL: in parallel, these only)
    manifests = {e: m for e in shown if e in listed and (m := rec.manifest(e)) is not None}
    committed = set(manifests)
    pins = rec.pins()
    nodes: list[str] = []
    for e in sorted(set(present) | committed):
        m = manifests.get(e)
        for n in list(m.nodes if m is not None else ()) + sorted(present.get(e, {})):
            if n not in nodes:
                nodes.append(n)
    epochs = []
    for e in sorted(set(present) | committed):
        m = manifests.get(e)
        mnodes: dict[str, DbEntry] = m.nodes if m is not None else {}
        files: dict[str, Any] = {}
        for n in nodes:
            path = present.get(e, {}).get(n)
            if path is None and n in mnodes:
                path = os.path.join(prefix, mnodes[n].file or f"{n}.{e}")
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
    return {"prefix": prefix, "records": rec.has_records, "nodes": nodes, "epochs": epochs,
            "older": len(every) - len(shown)}


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
    from concurrent.futures import ThreadPoolExecutor

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
