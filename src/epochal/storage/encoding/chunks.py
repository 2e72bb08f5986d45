"""A tensor stored as the chunks it was sharded in: kind ``torch.chunked_tensor``.

A sharded array (a ``jax.Array`` over a mesh) is saved without being assembled: each chunk
(a shard, at its offsets in the whole array) is written as it lies in memory, cut along
dim 0 into row blocks of about ``block_bytes``, each block one segment of the record, so
each has the format's own checksum. The meta says the whole tensor (``dtype``: torch's
name, ``shape``, ``device``: ``"cpu"``) and its ``chunks`` in segment order::

    {"dtype": "bfloat16", "shape": [4096, 1024], "device": "cpu",
     "chunks": [{"offsets": [0, 0], "shape": [1024, 512], "rows": 1024}, ...]}

chunk ``c`` holding ``ceil(shape[0] / rows)`` segments, block ``k`` rows ``k * rows ..
min((k + 1) * rows, shape[0])`` of the chunk, C order. The chunks cover the tensor exactly
(:func:`chunk_layout` refuses any overlap or gap). A PyTorch restore assembles the tensor
(:mod:`epochal.integrations.torch_chunks`); the JAX door reads each shard of a target
sharding from the blocks it overlaps, a block that one shard holds whole straight into it.
Chunks name their place in the whole array, not the process that wrote them: in a save of
several processes each writes a record of its own chunks only into its own db, marked
``"part": [i, n]`` (process ``i`` of ``n``) in the meta; such a record covers part of the
tensor, and only the records of every process read together (:func:`check_cover`) make it
whole (``chunk_layout(..., partial=True)``; without it, such a record is refused, naming it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .codecs import check_shape, flat_segment

__all__ = ["KIND", "Chunk", "check_cover", "chunk_layout", "encode_chunks", "part_of"]

#: the record kind (``torch.`` so that a PyTorch restore finds its codec lazily)
KIND = "torch.chunked_tensor"

#: more chunks than this are not checked pairwise for overlaps (a sweep would be needed)
_PAIRWISE = 1 << 12


@dataclass(frozen=True)
class Chunk:
    """One stored chunk: where it lies in the whole tensor, its shape, its rows per block and
    its segments (``first .. first + count`` of the record)."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    rows: int
    first: int
    count: int

    def blocks(self) -> list[tuple[int, int]]:
        """The chunk-relative rows ``(r0, r1)`` of each of its blocks, in segment order."""
        n = self.shape[0]
        return [(r, min(r + self.rows, n)) for r in range(0, n, self.rows)]


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ValueError(f"bad chunk {what} {str(v)[:80]!r}")
    return tuple(v)


def part_of(meta: dict[str, Any]) -> tuple[int, int] | None:
    """``(i, n)`` of a record holding process ``i``'s chunks of ``n`` (None: a whole record);
    ValueError for a malformed mark."""
    part = meta.get("part")
    if part is None:
        return None
    if (not isinstance(part, list) or len(part) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                               for x in part) or not 0 <= part[0] < part[1]):
        raise ValueError(f"bad part mark {str(part)[:80]!r}")
    return part[0], part[1]


def chunk_layout(meta: dict[str, Any], sizes: Sequence[int], itemsize: int, *,
                 partial: bool = False) -> tuple[tuple[int, ...], list[Chunk]]:
    """The tensor's shape and its chunks, from ``meta`` and the record's segment ``sizes``;
    ValueError unless every chunk lies in the tensor, the segments are its blocks' bytes
    exactly and the chunks cover the tensor without overlap. ``partial``: a record of one
    process's chunks (:func:`part_of`) is taken, its chunks checked for overlaps only (the
    caller checks the cover of all the processes' records together: :func:`check_cover`);
    without it, such a record is refused."""
    part = part_of(meta)
    if part is not None and not partial:
        raise ValueError(f"the record holds the chunks of process {part[0]} of {part[1]} that saved the "
                         "array, each into its own db: only all those dbs read together make it whole "
                         "(epochal.jax.restore reads them so)")
    shape = check_shape(meta.get("shape"))
    raw = meta.get("chunks")
    if not shape or not isinstance(raw, list):
        raise ValueError("a chunked tensor needs a shape of at least one axis and a chunk list")
    chunks: list[Chunk] = []
    first = 0
    for c in raw:
        if not isinstance(c, dict):
            raise ValueError(f"bad chunk {str(c)[:80]!r}")
        offsets, cshape = _ints(c.get("offsets"), "offsets"), _ints(c.get("shape"), "shape")
        rows = c.get("rows")
        if (len(offsets) != len(shape) or len(cshape) != len(shape) or not isinstance(rows, int)
                or isinstance(rows, bool) or rows < 1 or 0 in cshape
                or any(o + n > m for o, n, m in zip(offsets, cshape, shape))):
            raise ValueError(f"chunk at {list(offsets)} of shape {list(cshape)} does not fit a tensor {list(shape)}")
        chunk = Chunk(offsets, cshape, rows, first, -(-cshape[0] // rows))
        row_bytes = math.prod(cshape[1:]) * itemsize
        want = [(r1 - r0) * row_bytes for r0, r1 in chunk.blocks()]
        if list(sizes[first : first + chunk.count]) != want:
            raise ValueError(f"the segments of the chunk at {list(offsets)} do not fit its shape {list(cshape)}")
        chunks.append(chunk)
        first += chunk.count
    if first != len(sizes):
        raise ValueError(f"the chunks need {first} segments, the record has {len(sizes)}")
    check_cover(shape, [(c.offsets, c.shape) for c in chunks], whole=part is None)
    return shape, chunks


def check_cover(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]], whole: bool = True) -> None:
    """ValueError when the chunks ``boxes`` (offsets, shape; each inside the tensor) overlap,
    or (``whole``) do not hold every element of a tensor of ``shape``."""
    volume = sum(math.prod(n) for _, n in boxes)
    if whole and volume != math.prod(shape):
        raise ValueError(f"the chunks hold {volume} elements of a tensor of {math.prod(shape)}")
    if len(boxes) <= _PAIRWISE:
        for i, (ao, an) in enumerate(boxes):
            for bo, bn in boxes[i + 1 :]:
                if all(a0 < b0 + b1 and b0 < a0 + a1 for a0, a1, b0, b1 in zip(ao, an, bo, bn)):
                    raise ValueError(f"the chunks at {list(ao)} and {list(bo)} overlap")


def encode_chunks(dtype: str, shape: Sequence[int], chunks: Sequence[tuple[Sequence[int], np.ndarray]],
                  block_bytes: int, part: tuple[int, int] | None = None) -> tuple[dict[str, Any], list[memoryview]]:
    """The meta and segments of a chunked record: each chunk (its offsets, a C-contiguous
    little-endian array) cut into row blocks of about ``block_bytes`` (whole rows, at least
    one), each segment a view of the chunk's memory (no copy). ``part``: the record holds
    process ``i``'s chunks of ``n`` (:func:`part_of`)."""
    meta_chunks = []
    segments: list[memoryview] = []
    for offsets, arr in chunks:
        if arr.ndim != len(shape) or not arr.flags.c_contiguous or arr.dtype.byteorder == ">":
            raise ValueError(f"a chunk of a tensor {list(shape)} must be a C-contiguous little-endian "
                             f"array of {len(shape)} axes")
        row = math.prod(arr.shape[1:]) * arr.dtype.itemsize
        rows = max(1, block_bytes // max(1, row))
        meta_chunks.append({"offsets": [int(o) for o in offsets], "shape": list(arr.shape), "rows": rows})
        for r in range(0, arr.shape[0], rows):
            segments.append(flat_segment(arr[r : r + rows].reshape(-1).view(np.uint8)))
    meta: dict[str, Any] = {"dtype": dtype, "shape": [int(n) for n in shape], "device": "cpu", "chunks": meta_chunks}
    if part is not None:
        meta["part"] = [int(part[0]), int(part[1])]
    return meta, segments
