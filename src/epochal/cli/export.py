"""``epochal export``: the array blobs of a db as safetensors or npz for other tools."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..storage.io import atomic
from .dbs import read_blobs
from .problems import Problem
from .values import flatten, to_numpy

__all__ = ["export_db"]


_SAFETENSORS_KINDS = set("biuf")


def _export_arrays(values: Mapping[str, Any], fmt: str) -> tuple[dict[str, np.ndarray], list[dict[str, str]], list[str]]:
    """``(arrays, skipped, notes)``: the blobs (tree leaves as ``blob/key``) that ``fmt`` can hold."""
    arrays: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}  # output name -> the value it came from, for collisions
    skipped: list[dict[str, str]] = []
    notes: list[str] = []
    for name, value in values.items():
        leaves = list(flatten(value, name)) if isinstance(value, (Mapping, list, tuple)) else [(name, value)]
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, int, float, bool)) for v in value) \
                and len({type(v) for v in value}) == 1:
            leaves = [(name, np.asarray(value))]  # a homogeneous list (e.g. blob_names): one array
        for key, leaf in leaves:
            what = f"blob {name!r}" if key == name else f"key {key[len(name) + 1:]!r} of blob {name!r}"
            if key in origin:  # e.g. the blob "m/x" and the key "x" of the blob "m"
                raise Problem(f"{origin[key]} and {what} would both be written as {key!r}: "
                              f"export them one at a time (epochal export --blob) or rename one")
            origin[key] = what
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


def _replace(target: str, write: Any) -> None:
    """``target`` written by ``write(temp path)`` and renamed into place (an earlier output
    survives a failed export); a writer's own error (safetensors' on a full disk) as an
    OSError naming ``target``."""
    try:
        atomic.write_via_temp(target, write)
    except OSError as ex:
        if ex.filename is None:
            raise OSError(ex.errno, ex.strerror or str(ex), target) from ex
        raise
    except Exception as ex:  # noqa: BLE001 - SafetensorError("I/O error: No space left ...")
        raise Problem(f"cannot write {target}: {ex}") from ex


def export_db(path: str, fmt: str, out: str, db_type: str | None = None) -> dict[str, Any]:
    """``epochal export DB --to safetensors|npz OUT``: write the array blobs (Python and numpy
    scalars as 0-d arrays, tree leaves as ``blob/key``) for other tools; report the skipped."""
    if fmt not in ("safetensors", "npz"):
        raise Problem(f"unknown export format {fmt!r} (known: safetensors, npz)")
    written = out if fmt != "npz" or out.endswith(".npz") else out + ".npz"
    atomic.check_regular_output(written)  # a FIFO would block the writer for ever
    values = read_blobs(path, None, db_type)
    arrays, skipped, notes = _export_arrays(values, fmt)
    if not arrays:
        raise Problem(f"{path}: no blob can be exported to {fmt}")
    if fmt == "npz":
        if not out.endswith(".npz"):
            notes.append("added .npz to the file name, as numpy does")
        _replace(written, lambda tmp: _write_npz(tmp, arrays))
    else:
        try:
            from safetensors.numpy import save_file
        except ImportError:
            raise Problem("export to safetensors needs the safetensors package: pip install 'epochal[safetensors]'") from None
        meta = {"format": "np", "source": os.path.basename(path), "exported_by": "epochal"}
        _replace(written, lambda tmp: save_file(arrays, tmp, metadata=meta))
    return {
        "source": path,
        "format": fmt,
        "out": written,
        "written": sorted(arrays),
        "skipped": skipped,
        "notes": notes,
        "bytes": os.path.getsize(written),
    }
