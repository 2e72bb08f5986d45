"""A step written by ``torch.distributed.checkpoint`` (``dcp.save`` with
:class:`~epochal.integrations.dcp.EpochalStorageWriter`), read into JAX arrays.

Such a step holds one db per rank (``rank<r>.<step>``) with each tensor as the chunks the
ranks saved (blob ``<fqn>@<offsets>``; a big chunk as row blocks ``...#b<k>``, each with its
own checksum) and DCP's metadata as strict JSON in ``dcp.<step>``: every tensor's global
shape, dtype and chunks, and where each chunk lives. :func:`open_dcp` reads that metadata
(through the integration's reader, so torch must be installed to parse it: it was written
by torch) and gives every item by its FQN (``model.fc.weight``: DCP joins the levels of
nested dicts with dots) as :class:`DcpLeaf`: its layout and its pieces (a chunk, or one
block of a chunk) at their global offsets. :func:`read_dcp_regions` fills the shard
regions from the pieces they overlap, each piece read once for all of them by
:func:`~.reads.read_regions` (only the blocks holding their rows, each checked before
use), so a restore onto any mesh reads about the bytes its shards need, never a rank's
whole db.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checkpoint.location.view import CheckpointDirectory
from ..errors import CheckpointCorruptError
from ..storage.formats.native.layout import corrupt
from ..storage.formats.native.reads.ranges import RangedFile
from .names import DTYPES
from .pieces import Piece, read_pieces
from .reads import Stored, Task, array_layout

__all__ = ["DcpLeaf", "Piece", "is_dcp_step", "open_dcp", "read_dcp_regions"]

#: the node of a DCP step's metadata db (epochal.integrations.dcp.META_NODE)
META_NODE = "dcp"


def is_dcp_step(view: CheckpointDirectory, step: int) -> bool:
    """Whether committed ``step`` of ``view`` was written by DCP (it has a metadata db)."""
    return META_NODE in view.read_manifest(step).nodes


@dataclass
class DcpLeaf:
    """One DCP item: a tensor (``dtype``, ``shape`` and the ``pieces`` covering it) or a
    non-tensor value (``plain``: the record of its one blob, in ``db``)."""

    fqn: str
    dtype: np.dtype | None = None
    shape: tuple[int, ...] = ()
    pieces: list[Piece] = field(default_factory=list)
    plain: Stored | None = None
    db: str = ""


def _tensor_pieces(files: dict[str, RangedFile], fqn: str, loc: Any, offsets: tuple[int, ...],
                   sizes: tuple[int, ...], dtype: np.dtype) -> list[Piece]:
    """The records of one saved chunk: its blob, or its row blocks (blob ``#b<k>``)."""
    f = files[loc.db]
    if loc.rows and sizes:
        names = [(f"{loc.blob}#b{k}", r0, min(r0 + loc.rows, sizes[0]))
                 for k, r0 in enumerate(range(0, sizes[0], loc.rows))]
    else:
        names = [(loc.blob, 0, sizes[0] if sizes else 0)]
    out = []
    for blob, r0, r1 in names:
        found = f.find(blob)
        if found is None:
            raise corrupt(f.path, f"the DCP metadata places item {fqn!r} in blob {blob!r}, which is missing", blob)
        kind, meta, segs = found
        s = Stored(blob, kind, meta, segs)
        shape = ((r1 - r0), *sizes[1:]) if sizes else ()
        try:
            layout = array_layout(s)
        except ValueError as e:
            raise corrupt(f.path, f"item {fqn!r}: {e}", blob) from None
        if layout != (dtype, shape):
            raise corrupt(f.path, f"item {fqn!r}: blob {blob!r} holds {layout}, the metadata says "
                                  f"{dtype} {shape}", blob)
        out.append(Piece(loc.db, s, ((offsets[0] + r0), *offsets[1:]) if offsets else (), shape))
    return out


def open_dcp(directory: str, step: int, files: dict[str, RangedFile]) -> tuple[dict[str, DcpLeaf], str]:
    """Every item of DCP step ``step`` by FQN, and the metadata db's path; ``files`` is
    filled with each rank db opened (the caller closes them). Every db of the step is
    checked against its manifest (size and digest) before it is opened."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..integrations.dcp import EpochalStorageReader
    from ..integrations.torch import dtype_name

    reader = EpochalStorageReader(directory, step=step)
    md = reader.read_metadata()  # the metadata db checked, its JSON parsed strictly
    view = CheckpointDirectory(directory)
    view.require_intact(step, "quick", word="step")
    meta_db = view.db_path(META_NODE, step)
    by_fqn: dict[str, list[tuple[Any, Any]]] = {}
    for idx, loc in (md.storage_data or {}).items():
        by_fqn.setdefault(idx.fqn, []).append((idx, loc))
        if loc.db not in files:
            files[loc.db] = RangedFile(f"{directory.rstrip('/')}/{loc.db}")
    out: dict[str, DcpLeaf] = {}
    for fqn, sm in md.state_dict_metadata.items():
        entries = by_fqn.get(fqn, [])
        if not isinstance(sm, TensorStorageMetadata):
            if len(entries) != 1:
                raise CheckpointCorruptError(meta_db, f"item {fqn!r}: {len(entries)} storage entries", "metadata")
            loc = entries[0][1]
            f = files[loc.db]
            found = f.find(loc.blob)
            if found is None:
                raise corrupt(f.path, f"the DCP metadata places item {fqn!r} in blob {loc.blob!r}, which is missing",
                              loc.blob)
            out[fqn] = DcpLeaf(fqn, plain=Stored(loc.blob, *found), db=loc.db)
            continue
        name = dtype_name(sm.properties.dtype)
        dt = DTYPES.get(name)
        leaf = DcpLeaf(fqn, dt, tuple(int(n) for n in sm.size))
        if dt is None:  # refused when a leaf asks for it
            out[fqn] = leaf
            continue
        locs = {tuple(int(o) for o in (idx.offset or ())): loc for idx, loc in entries}
        for c in sm.chunks:
            offsets, sizes = tuple(int(o) for o in c.offsets), tuple(int(n) for n in c.sizes)
            loc = locs.get(offsets)
            if loc is None:
                raise CheckpointCorruptError(meta_db, f"item {fqn!r}: no storage for its chunk at {list(offsets)}",
                                             "metadata")
            leaf.pieces.extend(_tensor_pieces(files, fqn, loc, offsets, sizes, dt))
        out[fqn] = leaf
    return out, meta_db


def read_dcp_regions(files: dict[str, RangedFile], leaf: DcpLeaf, label: str, indices: Sequence[tuple[Any, ...]],
                     chunk: int, run: Callable[[list[Task]], None]) -> list[np.ndarray]:
    """The regions ``indices`` (one slice per axis each) of tensor item ``leaf``, in aligned
    buffers, from the pieces (chunks or row blocks) they overlap (:func:`~.pieces.read_pieces`).
    CheckpointCorruptError when the pieces do not cover a region."""
    assert leaf.dtype is not None
    return read_pieces(files, leaf.pieces, leaf.dtype, leaf.shape, label, leaf.fqn, indices, chunk, run)
