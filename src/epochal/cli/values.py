"""Decoded values as JSON-able summaries: scalars, array statistics, tree leaves."""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

__all__ = ["array_stats", "flatten", "iso_time", "json_float", "jsonable", "summarize", "to_numpy"]


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
