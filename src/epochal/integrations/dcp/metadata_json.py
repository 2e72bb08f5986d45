"""DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` as strict JSON, no pickle.

DCP's own filesystem storage pickles its ``.metadata``; ours is a JSON text (a str blob of the
checkpoint's ``dcp`` db, CRC-32C checked like every blob, parsed by
:func:`epochal.storage.encoding.strict_json.loads`). What it holds:

* ``items``: per FQN either ``{"bytes": {}}`` or ``{"tensor": {"dtype", "size",
  "requires_grad", "memory_format", "chunks": [{"offsets", "sizes"}]}}``;
* ``storage``: one entry per saved item: FQN, chunk offset (None for bytes), and where it
  lives: (db file, blob, offset, length), a db of the same step, and ``rows``: present only
  for a chunk stored as row blocks (:mod:`.blocks`), the rows per block;
* ``planner_data``: the flattening map DCP's default planners write (FQN -> key path of str/int),
  kept when it is that shape, else dropped;
* ``save_id``, ``version``: 1, or 2 when any storage entry has ``rows`` (so a reader that
  knows only 1, which would look for one blob per chunk, refuses it by its version).

Every field is type-checked on the way back; a dtype is looked up by name in a closed table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...errors import CheckpointCorruptError
from ...storage.encoding import strict_json
from ..torch import dtype_from_name, dtype_name

__all__ = ["FORMAT", "ItemLocation", "metadata_from_json", "metadata_to_json"]

FORMAT = "epochal-dcp-metadata"
VERSION = 1
#: the version of a document with row-block storage entries
VERSION_BLOCKS = 2

_MEMORY_FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve": torch.preserve_format}
_MEMORY_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}


@dataclass(frozen=True)
class ItemLocation:
    """Where one saved DCP item lives: ``blob`` of the db file ``db`` (``rank1.7``), bytes
    ``offset`` .. ``offset + length`` of that blob's data (the whole blob today). ``rows``:
    0, one blob; else the chunk is stored as blocks of that many rows (blobs
    ``<blob>#b<k>``, see :mod:`.blocks`) and ``length`` is the whole chunk's bytes."""

    db: str
    blob: str
    offset: int = 0
    length: int = 0
    rows: int = 0


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value) or len(value) > 64:
        raise ValueError(f"{what}: expected a list of non-negative ints, got {str(value)[:80]}")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 4096:
        raise ValueError(f"{what}: expected a non-empty str, got {str(value)[:80]!r}")
    return value


def metadata_to_json(md: Metadata, save_id: str | None = None) -> str:
    """The JSON text of ``md`` (its ``storage_data``: ``{MetadataIndex: ItemLocation}``)."""
    items: dict[str, Any] = {}
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, BytesStorageMetadata):
            items[fqn] = {"bytes": {}}
            continue
        p = sm.properties
        items[fqn] = {"tensor": {
            "dtype": dtype_name(p.dtype),
            "size": list(sm.size),
            "requires_grad": bool(p.requires_grad),
            "memory_format": _MEMORY_NAMES.get(p.memory_format, "contiguous"),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in sm.chunks],
        }}
    storage = []
    version = VERSION
    for idx, loc in (md.storage_data or {}).items():
        entry: dict[str, Any] = {
            "fqn": idx.fqn, "offset": None if idx.offset is None else list(idx.offset),
            "db": loc.db, "blob": loc.blob, "at": loc.offset, "length": loc.length,
        }
        if loc.rows:
            entry["rows"] = int(loc.rows)
            version = VERSION_BLOCKS
        storage.append(entry)
    planner_data = None
    pd = md.planner_data
    if isinstance(pd, dict) and all(
        isinstance(k, str) and isinstance(v, tuple) and all(type(x) in (str, int) for x in v)
        for k, v in pd.items()
    ):
        planner_data = {k: list(v) for k, v in pd.items()}
    if save_id is None and md.storage_meta is not None:
        save_id = md.storage_meta.save_id
    doc = {"format": FORMAT, "version": version, "save_id": save_id, "dcp_version": md.version,
           "items": items, "storage": storage, "planner_data": planner_data}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False)


def metadata_from_json(text: str, where: str) -> Metadata:
    """The :class:`Metadata` of a JSON text :func:`metadata_to_json` wrote; ``where`` names the
    file in the CheckpointCorruptError raised for anything malformed."""
    try:
        return _parse(strict_json.loads(text))
    except (ValueError, TypeError, KeyError, RecursionError) as ex:
        raise CheckpointCorruptError(where, f"bad DCP metadata: {ex}", "metadata") from None


def _parse(doc: Any) -> Metadata:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not {FORMAT!r} JSON")
    version = doc.get("version")
    if version not in (VERSION, VERSION_BLOCKS):
        raise ValueError(f"version {version!r} (this epochal reads {VERSION} and {VERSION_BLOCKS})")
    items = doc["items"]
    if not isinstance(items, dict):
        raise ValueError("items: not an object")
    sdm: dict[str, Any] = {}
    for fqn, entry in items.items():
        if not isinstance(entry, dict) or len(entry) != 1:
            raise ValueError(f"item {fqn!r}: expected one of 'bytes', 'tensor'")
        if "bytes" in entry:
            sdm[fqn] = BytesStorageMetadata()
            continue
        t = entry["tensor"]
        if not isinstance(t, dict):
            raise ValueError(f"item {fqn!r}: tensor entry is not an object")
        size = _ints(t["size"], f"item {fqn!r} size")
        chunks = []
        for c in t["chunks"]:
            off, sz = _ints(c["offsets"], f"item {fqn!r} chunk"), _ints(c["sizes"], f"item {fqn!r} chunk")
            if len(off) != len(size) or len(sz) != len(size) or any(
                o + s > n for o, s, n in zip(off, sz, size)
            ):
                raise ValueError(f"item {fqn!r}: chunk {off}+{sz} outside size {size}")
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz)))
        mf = _MEMORY_FORMATS.get(t.get("memory_format", "contiguous"))
        if mf is None or not isinstance(t.get("requires_grad", False), bool):
            raise ValueError(f"item {fqn!r}: bad properties")
        props = TensorProperties(dtype=dtype_from_name(t["dtype"]), requires_grad=t.get("requires_grad", False),
                                 memory_format=mf)
        sdm[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)
    storage: dict[MetadataIndex, ItemLocation] = {}
    for s in doc["storage"]:
        fqn = _str(s["fqn"], "storage fqn")
        if fqn not in sdm:
            raise ValueError(f"storage entry for unknown item {fqn!r}")
        soff: list[int] | None = None if s["offset"] is None else _ints(s["offset"], f"storage of {fqn!r}")
        at, length = s["at"], s["length"]
        if type(at) is not int or type(length) is not int or at < 0 or length < 0:
            raise ValueError(f"storage of {fqn!r}: bad byte range")
        rows = s.get("rows", 0)
        if type(rows) is not int or rows < 0 or (rows and (version != VERSION_BLOCKS or soff is None)):
            raise ValueError(f"storage of {fqn!r}: bad rows per block {rows!r} (version {version})")
        storage[MetadataIndex(fqn, soff)] = ItemLocation(_str(s["db"], "db"), _str(s["blob"], "blob"), at, length,
                                                         rows)
    pd = doc.get("planner_data")
    planner_data = None
    if pd is not None:
        if not isinstance(pd, dict) or not all(
            isinstance(v, list) and all(type(x) in (str, int) for x in v) for v in pd.values()
        ):
            raise ValueError("planner_data: expected FQN -> list of str/int")
        planner_data = {k: tuple(v) for k, v in pd.items()}
    save_id = doc.get("save_id")
    dcp_version = doc.get("dcp_version")
    return Metadata(
        state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage,
        storage_meta=StorageMeta(save_id=save_id if isinstance(save_id, str) else None),
        version=dcp_version if isinstance(dcp_version, str) else None,
    )
