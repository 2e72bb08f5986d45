"""``epochal diff``: how two dbs differ, index entries first, values where checksums differ."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .dbs import blob_record, describe_db, read_blobs
from .names import resolve_db_url
from .values import flatten, json_float, to_numpy

__all__ = ["diff_dbs"]


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
    path_a, path_b = resolve_db_url(path_a), resolve_db_url(path_b)  # a URL's <node>.<epoch>
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
