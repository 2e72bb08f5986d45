"""An array stored as pieces at offsets in the whole: the chunks of a sharded JAX save
(kind ``torch.chunked_tensor``: :mod:`epochal.storage.encoding.chunks`) or the chunks of a
``dcp.save`` (:mod:`.dcp`), each piece one stored tensor record (a block of rows of a chunk,
or a whole chunk) in one of a step's db files.

:func:`read_pieces` fills the shard regions a target sharding asks for from the pieces
they overlap, each piece read once for all of them by :func:`~.reads.read_regions` (only
the rows needed, checked before use) into its place in the region's buffer: where the
overlap spans the region's trailing axes (a row range of it, contiguous) straight from the
file, else through the reader's scratch. So a restore onto the mesh a save used reads each
shard's bytes straight into the buffer JAX adopts, and no restore holds more than the
regions and the readers' scratch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointCorruptError
from ..storage.encoding.chunks import chunk_layout
from ..storage.formats.native.reads.ranges import RangedFile
from .names import dtype_by_name
from .reads import Stored, Task, aligned_empty, read_regions

__all__ = ["Piece", "chunked_layout", "chunked_pieces", "read_pieces"]


@dataclass
class Piece:
    """A stored tensor record holding the region of an array at ``offsets``: a saved chunk,
    or one row block of it, in the db file ``db``."""

    db: str
    stored: Stored
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


def chunked_layout(s: Stored, db: str = "", *, partial: bool = False,
                   boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None
                   ) -> tuple[np.dtype, tuple[int, ...], list[Piece]]:
    """The dtype, shape and pieces (one per segment, in db ``db``) of a
    ``torch.chunked_tensor`` record; ValueError for meta that does not fit its segments.
    ``partial``: the record may hold one process's chunks only (the caller checks that the
    records of all the processes cover the array together, from the chunks' offsets and
    shapes, appended to ``boxes``)."""
    dt = dtype_by_name(s.meta.get("dtype"))
    if dt is None:
        raise ValueError(f"dtype {s.meta.get('dtype')!r} has no numpy equivalent")
    shape, chunks = chunk_layout(s.meta, [n for _, n, _ in s.segs], dt.itemsize, partial=partial)
    if boxes is not None:
        boxes.extend((c.offsets, c.shape) for c in chunks)
    pieces = []
    for c in chunks:
        for k, (r0, r1) in enumerate(c.blocks()):
            pshape = (r1 - r0, *c.shape[1:])
            meta = {"dtype": s.meta["dtype"], "shape": list(pshape)}
            pieces.append(Piece(db, Stored(s.blob, "torch.tensor", meta, [s.segs[c.first + k]]),
                                (c.offsets[0] + r0, *c.offsets[1:]), pshape))
    return dt, shape, pieces


def chunked_pieces(s: Stored) -> list[Piece]:
    """The pieces of a ``torch.chunked_tensor`` record (:func:`chunked_layout`)."""
    return chunked_layout(s)[2]


def read_pieces(files: dict[str, RangedFile], pieces: Sequence[Piece], dt: np.dtype, shape: tuple[int, ...],
                label: str, what: str, indices: Sequence[tuple[Any, ...]], chunk: int,
                run: Callable[[list[Task]], None]) -> list[np.ndarray]:
    """The regions ``indices`` (one slice per axis each) of the array of ``shape`` the
    ``pieces`` hold, in aligned buffers (see the module doc). ``run`` runs the pieces'
    reads (on threads: they write disjoint parts). CheckpointCorruptError naming ``what``
    (the blob or item) when the pieces do not cover a region."""
    bounds = [[sl.indices(n)[:2] for sl, n in zip(tuple(ix) + (slice(None),) * (len(shape) - len(ix)), shape)]
              for ix in indices]
    outs = [aligned_empty([max(0, b - a) for a, b in bd], dt) for bd in bounds]
    covered = [0] * len(outs)
    tasks: list[Task] = []
    for p in pieces:
        parts = []  # (region, its overlap with the piece)
        for r, bd in enumerate(bounds):
            inter = [(max(a, o), min(b, o + n)) for (a, b), o, n in zip(bd, p.offsets, p.shape)]
            if all(lo < hi for lo, hi in inter):
                parts.append((r, inter))
                covered[r] += math.prod(hi - lo for lo, hi in inter)
        if parts:
            tasks.append(functools.partial(_read_piece, files, p, label, parts, bounds, outs, chunk))
    bad = [r for r, o in enumerate(outs) if covered[r] != o.size]
    if bad:
        raise CheckpointCorruptError(next(iter(files.values())).path if files else "",
                                     f"leaf {label}: the saved chunks cover {covered[bad[0]]} of the "
                                     f"{outs[bad[0]].size} elements of region {bounds[bad[0]]}", what)
    run(tasks)
    return outs


def _read_piece(files: dict[str, RangedFile], p: Piece, label: str, parts: list[tuple[int, list[tuple[int, int]]]],
                bounds: list[list[tuple[int, int]]], outs: list[np.ndarray], chunk: int) -> None:
    """One piece's parts of the regions (see :func:`read_pieces`)."""
    local = [tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, p.offsets)) for _, inter in parts]
    # each overlap is read into its place in the region's buffer: a row range of it (the
    # overlap spans the region's trailing axes) is contiguous and read into straight
    dest = [outs[r][tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, bounds[r])) or ...]
            for r, inter in parts]  # (``...``: a 0-d region, as a view)
    read_regions(files[p.db], p.stored, label, local, chunk, dest)
