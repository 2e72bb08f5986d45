"""What the ``epochal`` commands compute, as plain JSON-able dicts (no click, no rich).

Every function here either returns a dict (what ``--json`` prints, and what the tables show)
or raises :class:`Problem` with one line naming the file or blob at fault.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ..errors import CheckpointCorruptError, CheckpointError, MissingBlobError
from ..storage.base import BlobInfo, DbBackend, get_db_type

RECORDS_DIR = ".epochal"
_DB_NAME_RE = re.compile(r"^(?P<node>.+)\.(?P<epoch>\d+)$")


class Problem(Exception):
    """A problem the user must hear about in one line (exit code 1): a missing or damaged
    file, something that is not a checkpoint, an unknown blob."""


# ------------------------------------------------------------------ small helpers
def iso_time(ts: float | None) -> str | None:
    """A POSIX timestamp as a local ISO-8601 string (seconds), None stays None."""
    if ts is None:
        return None
    return _dt.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def json_float(x: float) -> float | str | None:
    """A float JSON can carry: finite as is, NaN as None, infinities as "inf"/"-inf"."""
    x = float(x)
    if math.isnan(x):
        return None
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def jsonable(value: Any, limit: int = 200) -> Any:
    """A short JSON-able rendering of a small Python/numpy value (for scalars and samples)."""
    if value is None or isinstance(value, (bool, str)):
        return value if not isinstance(value, str) or len(value) <= limit else value[:limit] + "..."
    if isinstance(value, (bytes, bytearray)):
        text = bytes(value[:limit]).hex()
        return {"bytes": len(value), "hex": text + ("..." if len(value) > limit else "")}
    if isinstance(value, int):
        return value if abs(value) < 2**63 else str(value)
    if isinstance(value, float):
        return json_float(value)
    if isinstance(value, np.generic):
        return jsonable(value.item(), limit)
    if isinstance(value, complex):
        return {"real": json_float(value.real), "imag": json_float(value.imag)}
    return repr(value)[:limit]


def parse_db_name(path: str) -> tuple[str, int] | None:
    """``(node, epoch)`` of a db file named ``<node>.<epoch>``; None for other names
    (including the temp files of an interrupted write)."""
    from ..storage.atomic import parse_temp_path

    base = os.path.basename(path)
    if base.startswith(".") or parse_temp_path(base) is not None:
        return None
    m = _DB_NAME_RE.match(base)
    if m is None:
        return None
    return m.group("node"), int(m.group("epoch"))


# ------------------------------------------------------------------ opening dbs
def detect_db_type(path: str) -> str:
    """The db_type of the file at ``path``, from its first bytes (native magic number, or a
    safetensors JSON header); :class:`Problem` if it is neither or cannot be read."""
    if os.path.isdir(path):
        raise Problem(f"{path}: is a directory, not a checkpoint file (give a db such as {os.path.join(path, '<node>.<epoch>')})")
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except FileNotFoundError:
        raise Problem(f"{path}: no such file") from None
    except OSError as e:
        raise Problem(f"{path}: cannot read: {e.strerror or e}") from None
    from ..storage.native import MAGIC

    if head[:8] == MAGIC:
        return "native"
    if len(head) > 8 and head[8:9] == b"{":
        n = int.from_bytes(head[:8], "little")
        if 0 < n < 100_000_000 and n + 8 <= os.path.getsize(path):
            return "safetensors"
    if not head:
        raise Problem(f"{path}: empty file, not a checkpoint")
    raise Problem(f"{path}: not a checkpoint file (neither the native format nor safetensors)")


def backend_for(path: str, db_type: str | None = None) -> tuple[str, DbBackend]:
    """``(db_type, backend)`` for the db at ``path``: ``db_type`` when given, else detected."""
    name = db_type or detect_db_type(path)
    try:
        return name, get_db_type(name)
    except CheckpointError as e:
        raise Problem(str(e)) from None


def _strip_where(e: CheckpointCorruptError) -> str:
    """The message of ``e`` without its "path, blob 'x': " prefix."""
    text = str(e)
    where = f"{e.path}" + (f", blob {e.blob!r}" if e.blob is not None else "")
    return text[len(where) + 2 :] if text.startswith(where + ": ") else text


def describe_db(path: str, db_type: str | None = None) -> tuple[str, list[BlobInfo]]:
    """``(db_type, blob infos)`` of one db; :class:`Problem` when it cannot be read."""
    name, backend = backend_for(path, db_type)
    try:
        return name, backend.describe(path)
    except (CheckpointError, OSError, ValueError) as e:
        raise Problem(_one_line(e, path)) from None


def _one_line(e: BaseException, path: str) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, OSError) and not isinstance(e, CheckpointError):
        text = f"{getattr(e, 'filename', None) or path}: {e.strerror or e}"
    if path not in text:
        text = f"{path}: {text}"
    return text


def blob_record(info: BlobInfo) -> dict[str, Any]:
    """A BlobInfo as a JSON-able dict."""
    dtype = info.dtype
    if dtype is None and info.kind == "py" and isinstance(info.meta.get("type"), str):
        dtype = info.meta["type"]  # a Python scalar: show which (int, float, str, ...)
    return {
        "name": info.name,
        "kind": info.kind,
        "dtype": dtype,
        "shape": list(info.shape) if info.shape is not None else None,
        "nbytes": info.nbytes,
        "checksum": info.checksum,
    }


def read_blobs(path: str, names: list[str] | None, db_type: str | None = None) -> dict[str, Any]:
    """Read (and verify) ``names`` (all when None) of one db; :class:`Problem` on any failure,
    naming the file and blob."""
    _, backend = backend_for(path, db_type)
    try:
        return backend.read(path, names)
    except MissingBlobError as e:
        raise Problem(str(e)) from None
    except (CheckpointError, OSError, ValueError) as e:
        raise Problem(_one_line(e, path)) from None


# ------------------------------------------------------------------ directories
class Records:
    """The CLI's view of a checkpoint directory: the records of
    :class:`epochal.checkpoint.directory.CheckpointDirectory` when that module is present,
    else what the file names alone tell (``<node>.<epoch>``, nothing committed)."""

    def __init__(self, prefix: str) -> None:
        if not os.path.isdir(prefix):
            if os.path.exists(prefix):
                raise Problem(f"{prefix}: not a directory (give the db_prefix directory of a job)")
            raise Problem(f"{prefix}: no such directory")
        self.prefix = prefix
        self.has_records = os.path.isdir(os.path.join(prefix, RECORDS_DIR))
        self._dir: Any = None
        try:
            from ..checkpoint.directory import CheckpointDirectory
        except ImportError:
            return
        try:
            self._dir = CheckpointDirectory(prefix)
        except (CheckpointError, OSError, ValueError) as e:
            raise Problem(_one_line(e, prefix)) from None

    def _call(self, method: str, *args: Any, default: Any = None) -> Any:
        fn = getattr(self._dir, method, None) if self._dir is not None else None
        if fn is None:
            return default
        try:
            return fn(*args)
        except (CheckpointError, OSError, ValueError) as e:
            raise Problem(_one_line(e, self.prefix)) from None

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

    def manifest(self, epoch: int) -> dict[str, Any] | None:
        try:
            m = self._call("manifest", epoch)
        except Problem:
            return None
        return m if isinstance(m, dict) else None

    def pins(self) -> set[int]:
        return {int(e) for e in self._call("pins", default=set()) or set()}

    def stats(self) -> list[dict[str, Any]]:
        return list(self._call("stats", default=[]) or [])

    def verify_epoch(self, epoch: int) -> list[str]:
        """Problems of a committed epoch's records (missing files, sizes, digests)."""
        return [str(p) for p in self._call("verify_epoch", epoch, False, default=[]) or []]


def _file_record(path: str | None) -> dict[str, Any]:
    if path is None or not os.path.exists(path):
        return {"path": path, "present": False, "size": None, "modified": None}
    st = os.stat(path)
    return {"path": path, "present": True, "size": st.st_size, "modified": iso_time(st.st_mtime)}


def list_prefix(prefix: str) -> dict[str, Any]:
    """``epochal ls``: every epoch with its db files per node, commit state, sizes, times, pins."""
    rec = Records(prefix)
    present = rec.scan()
    committed = set(rec.committed())
    pins = rec.pins()
    manifests = {e: rec.manifest(e) for e in sorted(committed)}
    nodes: list[str] = []
    for e in sorted(set(present) | committed):
        m = manifests.get(e) or {}
        for n in list((m.get("nodes") or {}).keys()) + sorted(present.get(e, {})):
            if n not in nodes:
                nodes.append(n)
    epochs = []
    for e in sorted(set(present) | committed):
        m = manifests.get(e) or {}
        mnodes: dict[str, Any] = m.get("nodes") or {}
        files: dict[str, Any] = {}
        for n in nodes:
            path = present.get(e, {}).get(n)
            if path is None and n in mnodes:
                path = os.path.join(prefix, str(mnodes[n].get("file") or f"{n}.{e}"))
            if path is None:
                continue
            files[n] = _file_record(path)
            if n in mnodes:
                files[n]["recorded_size"] = mnodes[n].get("size")
        is_committed = e in committed
        final = bool(m.get("final")) if is_committed else False
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
            "db_type": m.get("db_type"),
            "created": m.get("created") or (max(times) if times else None),
            "size": sum(f["size"] or 0 for f in files.values()),
            "files": files,
            "missing": missing,
        })
    return {"prefix": prefix, "records": rec.has_records, "nodes": nodes, "epochs": epochs}


# ------------------------------------------------------------------ inspect
def inspect_db(path: str, db_type: str | None = None) -> dict[str, Any]:
    """``epochal inspect DB``: the header summary and every blob's index entry."""
    name, infos = describe_db(path, db_type)
    out: dict[str, Any] = {"path": path, "db_type": name, "file_bytes": os.path.getsize(path)}
    if name == "native":
        from ..storage.native import stat_native

        st = stat_native(path)
        out["format_version"] = st.format_version
        out["checksum_algorithm"] = st.checksum_algorithm
        out["digest"] = st.digest
    out["blob_count"] = len(infos)
    out["data_bytes"] = sum(i.nbytes for i in infos)
    out["blobs"] = [blob_record(i) for i in infos]
    return out


def inspect_blob(path: str, blob: str, db_type: str | None = None) -> dict[str, Any]:
    """``epochal inspect DB --blob NAME``: the blob's index entry and statistics of its values."""
    _, infos = describe_db(path, db_type)
    by_name = {i.name: i for i in infos}
    if blob not in by_name:
        names = sorted(by_name)
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        raise Problem(f"{path}: no blob {blob!r} (it has {len(names)}: {shown})")
    value = read_blobs(path, [blob], db_type)[blob]
    rec = blob_record(by_name[blob])
    rec["stats"] = summarize(value)
    return {"path": path, "blob": rec}


def to_numpy(value: Any) -> tuple[np.ndarray | None, str | None]:
    """``(array, note)``: ``value`` as a numpy array when it is array-like (numpy, torch, Python
    scalars), with a note on any conversion; ``(None, None)`` otherwise."""
    if isinstance(value, np.ndarray):
        return value, None
    if isinstance(value, np.generic):
        return np.asarray(value), None
    if type(value).__module__.split(".")[0] == "torch" and hasattr(value, "detach"):
        t = value.detach().cpu()
        note = None
        if str(t.dtype) in ("torch.bfloat16",) or "float8" in str(t.dtype):
            note = f"{t.dtype} shown as float32"
            t = t.float()
        try:
            return t.numpy(), note
        except (TypeError, RuntimeError):
            return t.float().numpy(), f"{t.dtype} shown as float32"
    if isinstance(value, (bool, int, float, complex)) and not (isinstance(value, int) and abs(value) >= 2**63):
        return np.asarray(value), None
    return None, None


def array_stats(arr: np.ndarray) -> dict[str, Any]:
    """Summary statistics of an array: counts, min/max/mean/std, NaN/inf/zero counts."""
    out: dict[str, Any] = {"type": "array", "dtype": str(arr.dtype), "shape": list(arr.shape), "size": int(arr.size)}
    if arr.dtype.fields is not None:
        out["fields"] = list(arr.dtype.names or ())
        return out
    if arr.dtype.kind in "USa":
        out["sample"] = [jsonable(x) for x in arr.reshape(-1)[:5].tolist()]
        return out
    if arr.dtype.kind == "b":
        out["true"] = int(np.count_nonzero(arr))
        out["false"] = int(arr.size - out["true"])
        return out
    if arr.dtype.kind not in "iufc" or arr.size == 0:
        return out
    x = np.abs(arr) if arr.dtype.kind == "c" else arr
    if arr.dtype.kind == "c":
        out["of"] = "abs"
    x = x.astype(np.float64, copy=False)
    finite = np.isfinite(x)
    nfinite = int(np.count_nonzero(finite))
    out["nan"] = int(np.count_nonzero(np.isnan(x)))
    out["inf"] = int(x.size - nfinite - out["nan"])
    out["zeros"] = int(np.count_nonzero(x == 0))
    vals = x[finite] if nfinite != x.size else x
    if vals.size:
        out["min"] = json_float(vals.min())
        out["max"] = json_float(vals.max())
        out["mean"] = json_float(vals.mean())
        out["std"] = json_float(vals.std())
        out["l2"] = json_float(np.sqrt(np.sum(vals * vals)))
    return out


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The leaves of a nested dict/list/tuple as ``(key path, leaf)``; keys joined by "/"."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from flatten(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from flatten(v, f"{prefix}/{i}" if prefix else str(i))
    else:
        yield prefix, value


def summarize(value: Any, depth: int = 0) -> dict[str, Any]:
    """Statistics of a decoded blob: arrays and tensors get :func:`array_stats`; strings and
    bytes their length and start; containers and state dicts one summary per leaf."""
    if isinstance(value, (str, bytes, bytearray)):
        return {"type": type(value).__name__, "length": len(value), "value": jsonable(value)}
    if value is None:
        return {"type": "None", "value": None}
    if isinstance(value, (Mapping, list, tuple)) and depth == 0:
        leaves = list(flatten(value))
        out: dict[str, Any] = {"type": type(value).__name__, "leaf_count": len(leaves)}
        out["leaves"] = [dict(key=k, **summarize(v, depth + 1)) for k, v in leaves[:200]]
        if len(leaves) > 200:
            out["leaves_shown"] = 200
        return out
    arr, note = to_numpy(value)
    if arr is None:
        return {"type": type(value).__name__, "value": jsonable(value)}
    if arr.ndim == 0 and not isinstance(value, np.ndarray):
        out = {"type": "scalar", "dtype": str(arr.dtype), "value": jsonable(arr.item())}
    else:
        out = array_stats(arr)
    if note:
        out["note"] = note
    if type(value).__module__.split(".")[0] == "torch":
        out["torch_dtype"] = str(getattr(value, "dtype", ""))
        out["device"] = str(getattr(value, "device", ""))
    return out


# ------------------------------------------------------------------ verify
def verify_file(path: str, db_type: str | None = None) -> dict[str, Any]:
    """Re-check every checksum of one db; each damaged blob is named (native: every one;
    other formats: the first)."""
    parsed = parse_db_name(path)
    rec: dict[str, Any] = {
        "path": path,
        "node": parsed[0] if parsed else None,
        "epoch": parsed[1] if parsed else None,
        "ok": True,
        "problems": [],
    }
    problems: list[dict[str, Any]] = rec["problems"]
    try:
        name, backend = backend_for(path, db_type)
    except Problem as e:
        problems.append({"blob": None, "message": str(e)})
        rec["ok"] = False
        return rec
    rec["db_type"] = name
    try:
        if name == "native":
            from ..storage.native import NativeFile

            with NativeFile(path, mmap=False) as f:
                rec["blobs"] = len(f)
                for blob in f.names():
                    try:
                        f.verify([blob])
                    except CheckpointCorruptError as e:
                        problems.append({"blob": e.blob if e.blob is not None else blob, "message": _strip_where(e)})
        else:
            rec["blobs"] = len(backend.describe(path))
            backend.verify(path)
    except CheckpointCorruptError as e:
        problems.append({"blob": e.blob, "message": _strip_where(e)})
    except (CheckpointError, OSError, ValueError) as e:
        problems.append({"blob": None, "message": _one_line(e, path)})
    rec["ok"] = not problems
    return rec


def verify_target(target: str, db_type: str | None = None) -> dict[str, Any]:
    """``epochal verify PREFIX|DB``: every db file of a prefix (or the one db), and every
    committed epoch's records (files missing, sizes and digests not as recorded)."""
    if not os.path.isdir(target):
        f = verify_file(target, db_type)
        return {"target": target, "ok": f["ok"], "files": [f], "epochs": []}
    rec = Records(target)
    present = rec.scan()
    files = []
    for e in sorted(present):
        for node in sorted(present[e]):
            files.append(verify_file(present[e][node], db_type))
    epochs = []
    for e in rec.committed():
        probs = rec.verify_epoch(e)
        epochs.append({"epoch": e, "ok": not probs, "problems": probs})
    ok = all(f["ok"] for f in files) and all(e["ok"] for e in epochs)
    return {"target": target, "ok": ok, "files": files, "epochs": epochs}


# ------------------------------------------------------------------ diff
def _max_abs_diff(a: Any, b: Any) -> tuple[float | str | None, str | None]:
    """``(max |a-b|, reason)``: reason is set when the values cannot be compared elementwise."""
    xa, _ = to_numpy(a)
    xb, _ = to_numpy(b)
    if xa is None or xb is None:
        return None, None if _equal(a, b) else "value"
    if xa.shape != xb.shape:
        return None, f"shape {list(xa.shape)} -> {list(xb.shape)}"
    if xa.dtype.kind not in "biufc" or xb.dtype.kind not in "biufc":
        return None, None if np.array_equal(xa, xb) else "value"
    if xa.size == 0:
        return 0.0, None
    da = xa.astype(np.complex128 if "c" in (xa.dtype.kind, xb.dtype.kind) else np.float64)
    db = xb.astype(da.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(da - db)
    both_nan = np.isnan(da) & np.isnan(db) if da.dtype.kind == "f" else np.zeros(d.shape, bool)
    d = np.where(both_nan, 0.0, d)
    if np.isnan(d).any():
        return "nan", None
    return json_float(d.max()), None


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # noqa: BLE001 - comparing exotic values is best effort
        return False


def _compare_values(a: Any, b: Any) -> dict[str, Any]:
    """How two decoded blobs differ: max abs difference, reason, and changed leaves of trees."""
    out: dict[str, Any] = {}
    if isinstance(a, (Mapping, list, tuple)) or isinstance(b, (Mapping, list, tuple)):
        la, lb = dict(flatten(a)), dict(flatten(b))
        leaves: list[dict[str, Any]] = []
        worst: float = 0.0
        for k in sorted(set(la) | set(lb)):
            if k not in la or k not in lb:
                leaves.append({"key": k, "reason": "added" if k not in la else "removed"})
                continue
            mad, why = _max_abs_diff(la[k], lb[k])
            if why or (mad not in (0.0, None)):
                leaves.append({"key": k, "max_abs_diff": mad, "reason": why})
                if isinstance(mad, float):
                    worst = max(worst, mad)
                elif mad in ("nan", "inf"):
                    worst = math.inf
        out["max_abs_diff"] = json_float(worst)
        out["leaves"] = leaves
        return out
    mad, why = _max_abs_diff(a, b)
    out["max_abs_diff"] = mad
    if why:
        out["reason"] = why
    return out


def diff_dbs(path_a: str, path_b: str, db_type: str | None = None) -> dict[str, Any]:
    """``epochal diff DB1 DB2``: blobs added, removed and changed (index entries first; the
    values of blobs whose checksums differ are read and compared)."""
    type_a, infos_a = describe_db(path_a, db_type)
    type_b, infos_b = describe_db(path_b, db_type)
    a = {i.name: i for i in infos_a}
    b = {i.name: i for i in infos_b}
    added = [blob_record(b[n]) for n in b if n not in a]
    removed = [blob_record(a[n]) for n in a if n not in b]
    changed = []
    unchanged = 0
    same_format = type_a == type_b
    candidates = []
    for n in a:
        if n not in b:
            continue
        ia, ib = a[n], b[n]
        entry: dict[str, Any] = {"name": n, "kind": [ia.kind, ib.kind], "dtype": [ia.dtype, ib.dtype],
                                 "shape": [list(ia.shape) if ia.shape is not None else None,
                                           list(ib.shape) if ib.shape is not None else None],
                                 "nbytes": [ia.nbytes, ib.nbytes]}
        if same_format and ia.checksum and ib.checksum and ia.checksum == ib.checksum and ia.kind == ib.kind \
                and ia.dtype == ib.dtype and ia.shape == ib.shape:
            unchanged += 1
            continue
        candidates.append((n, entry))
    if candidates:
        names = [n for n, _ in candidates]
        va = read_blobs(path_a, names, type_a)
        vb = read_blobs(path_b, names, type_b)
        for n, entry in candidates:
            reasons = [f for f in ("kind", "dtype", "shape") if entry[f][0] != entry[f][1]]
            cmp = _compare_values(va[n], vb[n])
            if not reasons and not cmp.get("reason") and cmp.get("max_abs_diff") in (0.0, None) \
                    and not cmp.get("leaves") and _same_bytes(va[n], vb[n]):
                unchanged += 1
                continue
            entry.update(cmp)
            entry["changes"] = reasons + ([cmp["reason"]] if cmp.get("reason") and cmp["reason"] not in reasons else [])
            if not entry["changes"]:
                entry["changes"] = ["values"]
            changed.append(entry)
    return {
        "a": path_a,
        "b": path_b,
        "identical": not (added or removed or changed),
        "added": added,
        "removed": removed,
        "changed": changed,
        "unchanged": unchanged,
    }


def _same_bytes(a: Any, b: Any) -> bool:
    xa, _ = to_numpy(a)
    xb, _ = to_numpy(b)
    if xa is not None and xb is not None:
        return xa.dtype == xb.dtype and xa.shape == xb.shape and xa.tobytes() == xb.tobytes()
    return _equal(a, b)


# ------------------------------------------------------------------ stats
def stats_prefix(prefix: str) -> dict[str, Any]:
    """``epochal stats PREFIX``: every save/load record of the stats log with seconds and
    throughput, and a summary per (action, node)."""
    rec = Records(prefix)
    rows = []
    for r in rec.stats():
        ns = int(r.get("ns") or 0)
        nbytes = r.get("bytes")
        seconds = ns / 1e9
        rows.append({
            "time": r.get("time"),
            "action": str(r.get("action")),
            "epoch": r.get("epoch"),
            "node": r.get("node"),
            "db": r.get("db"),
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


# ------------------------------------------------------------------ export
_SAFETENSORS_KINDS = set("biuf")


def _export_arrays(values: Mapping[str, Any], fmt: str) -> tuple[dict[str, np.ndarray], list[dict[str, str]], list[str]]:
    """``(arrays, skipped, notes)``: the blobs (tree leaves as ``blob/key``) that ``fmt`` can hold."""
    arrays: dict[str, np.ndarray] = {}
    skipped: list[dict[str, str]] = []
    notes: list[str] = []
    for name, value in values.items():
        leaves = list(flatten(value, name)) if isinstance(value, (Mapping, list, tuple)) else [(name, value)]
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, int, float, bool)) for v in value) \
                and len({type(v) for v in value}) == 1:
            leaves = [(name, np.asarray(value))]  # a homogeneous list (e.g. blob_names): one array
        for key, leaf in leaves:
            if isinstance(leaf, (str, bytes)) and fmt == "npz":
                arr: np.ndarray | None = np.asarray(leaf)
                note = None
            else:
                arr, note = to_numpy(leaf)
            if arr is None:
                skipped.append({"name": key, "reason": f"a {type(leaf).__name__} is not an array"})
                continue
            if arr.dtype.hasobject:
                skipped.append({"name": key, "reason": "object dtype"})
                continue
            if fmt == "safetensors":
                if arr.dtype.kind not in _SAFETENSORS_KINDS or arr.dtype.fields is not None:
                    skipped.append({"name": key, "reason": f"dtype {arr.dtype} has no safetensors equivalent"})
                    continue
                arr = np.ascontiguousarray(arr)
                if arr.dtype.byteorder == ">":
                    arr = arr.astype(arr.dtype.newbyteorder("<"))
            if note:
                notes.append(f"{key}: {note}")
            arrays[key] = arr
    return arrays, skipped, notes


def _write_npz(path: str, arrays: Mapping[str, np.ndarray]) -> None:
    """What ``np.savez`` writes (a zip of ``.npy`` members, never pickled), without its
    keyword-argument names clashing with blob names such as ``file`` or ``allow_pickle``."""
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, arr in arrays.items():
            with zf.open(key + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(arr), allow_pickle=False)


def export_db(path: str, fmt: str, out: str, db_type: str | None = None) -> dict[str, Any]:
    """``epochal export DB --to safetensors|npz OUT``: write the array blobs (Python and numpy
    scalars as 0-d arrays, tree leaves as ``blob/key``) for other tools; report the skipped."""
    if fmt not in ("safetensors", "npz"):
        raise Problem(f"unknown export format {fmt!r} (known: safetensors, npz)")
    values = read_blobs(path, None, db_type)
    arrays, skipped, notes = _export_arrays(values, fmt)
    if not arrays:
        raise Problem(f"{path}: no blob can be exported to {fmt}")
    if fmt == "npz":
        if not out.endswith(".npz"):
            notes.append("added .npz to the file name, as numpy does")
        written = out if out.endswith(".npz") else out + ".npz"
        _write_npz(written, arrays)
    else:
        try:
            from safetensors.numpy import save_file
        except ImportError:
            raise Problem("export to safetensors needs the safetensors package: pip install 'epochal[safetensors]'") from None
        save_file(arrays, out, metadata={"format": "np", "source": os.path.basename(path), "exported_by": "epochal"})
        written = out
    return {
        "source": path,
        "format": fmt,
        "out": written,
        "written": sorted(arrays),
        "skipped": skipped,
        "notes": notes,
        "bytes": os.path.getsize(written),
    }
