"""One db file as the commands see it: which db_type wrote it, its index, its values, its
problems, all through the db backend interface (:mod:`epochal.storage.formats.base`) alone."""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointError, MissingBlobError
from ..storage.formats.base import (
    BlobInfo,
    DbBackend,
    DbProblem,
    available_db_types,
    get_db_type,
    sniff_db_type,
)
from ..storage.io.seam import store_for
from .names import parse_db_name, resolve_db_url
from .problems import Problem, one_line
from .values import summarize

__all__ = [
    "backend_for",
    "blob_record",
    "describe_db",
    "detect_db_type",
    "inspect_blob",
    "inspect_db",
    "read_blobs",
    "verify_file",
]


def _size(path: str) -> int:
    src = store_for(path).open_read(path)
    try:
        return src.size()
    finally:
        src.close()


def detect_db_type(path: str) -> str:
    """The db_type of the file at ``path``, asked of every registered backend from the file's
    head (:func:`~epochal.storage.formats.base.sniff_db_type`); :class:`Problem` if none recognises
    it or it cannot be read."""
    if os.path.isdir(path):
        raise Problem(f"{path}: is a directory, not a checkpoint file (give a db such as {os.path.join(path, '<node>.<epoch>')})")
    try:
        found = sniff_db_type(path)
        empty = found is None and _size(path) == 0
    except FileNotFoundError:
        raise Problem(f"{path}: no such file") from None
    except OSError as e:
        raise Problem(f"{path}: cannot read: {e.strerror or e}") from None
    if found is not None:
        return found
    if empty:
        raise Problem(f"{path}: empty file, not a checkpoint")
    raise Problem(f"{path}: not a checkpoint file (no db_type recognises it: {', '.join(available_db_types())})")


def backend_for(path: str, db_type: str | None = None) -> tuple[str, DbBackend]:
    """``(db_type, backend)`` for the db at ``path``: ``db_type`` when given, else detected."""
    name = db_type or detect_db_type(path)
    try:
        return name, get_db_type(name)
    except CheckpointError as e:
        raise Problem(str(e)) from None


def describe_db(path: str, db_type: str | None = None) -> tuple[str, list[BlobInfo]]:
    """``(db_type, blob infos)`` of one db; :class:`Problem` when it cannot be read."""
    name, backend = backend_for(path, db_type)
    try:
        return name, backend.describe(path)
    except (CheckpointError, OSError, ValueError) as e:
        raise Problem(one_line(e, path)) from None


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
        raise Problem(one_line(e, path)) from None


def inspect_db(path: str, db_type: str | None = None) -> dict[str, Any]:
    """``epochal inspect DB``: the header summary and every blob's index entry (a URL's
    ``<prefix>/<node>.<epoch>``: the db its manifest names)."""
    path = resolve_db_url(path)
    name, infos = describe_db(path, db_type)
    try:
        st = get_db_type(name).stat(path)
    except (CheckpointError, OSError, ValueError) as e:
        raise Problem(one_line(e, path)) from None
    out: dict[str, Any] = {"path": path, "db_type": name, "file_bytes": st.file_bytes}
    for key in ("format_version", "checksum_algorithm", "digest"):
        value = getattr(st, key)
        if value is not None:  # what this format records
            out[key] = value
    out["blob_count"] = len(infos)
    out["data_bytes"] = sum(i.nbytes for i in infos)
    out["blobs"] = [blob_record(i) for i in infos]
    return out


def inspect_blob(path: str, blob: str, db_type: str | None = None) -> dict[str, Any]:
    """``epochal inspect DB --blob NAME``: the blob's index entry and statistics of its values."""
    path = resolve_db_url(path)
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


def verify_file(path: str, db_type: str | None = None) -> dict[str, Any]:
    """Re-check every checksum of one db (:meth:`DbBackend.check`): each damaged blob is named
    (native: every one; other formats: the first)."""
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
        rec["blobs"] = len(backend.describe(path))
    except (CheckpointError, OSError, ValueError) as e:
        found = [DbProblem.of(e, path)]
    else:
        found = backend.check(path)
    problems.extend({"blob": p.blob, "message": p.message} for p in found)
    rec["ok"] = not problems
    return rec
