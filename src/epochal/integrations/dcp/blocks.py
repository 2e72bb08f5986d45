"""Row blocks: a big saved DCP chunk as several blobs along dim 0, each with its own checksum.

A native blob has one CRC-32C over its one segment, so a reader that wants a slice of a blob
must read (and check) all of it. To let a rank that needs only some rows of a saved chunk
(a 2 -> 4 reshard, FSDP2's dim-0 layout) read only about those, the writer stores a chunk of
at least :data:`BLOCK_MIN` bytes with more than one row as blocks of whole rows, about
:data:`BLOCK_BYTES` each: blobs ``<fqn>@<offsets>#b<k>`` (``w@4,0#b0``, ``w@4,0#b1``, ...),
each a dim-0 view of the chunk (no copy), block ``k`` holding rows ``k * rows ..
min((k + 1) * rows, n)``. The metadata's storage entry of the chunk says ``rows`` (rows
per block; see :mod:`.metadata_json`); 0 there is one blob, as every chunk was before.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["BLOCK_BYTES", "BLOCK_MIN", "Block", "block_name", "block_rows", "blocks_over", "split_rows"]

#: a chunk of fewer bytes stays one blob
BLOCK_MIN = 4 << 20
#: about the bytes of one block (whole rows; at least this many, so every block is big
#: enough for the reader's in-place path)
BLOCK_BYTES = 2 << 20


def block_name(blob: str, k: int) -> str:
    """The blob name of block ``k`` of the chunk blob ``blob`` (``w@4,0#b1``)."""
    return f"{blob}#b{int(k)}"


def block_rows(t: torch.Tensor) -> int:
    """The rows per block for the chunk ``t``; 0: it stays one blob (under BLOCK_MIN bytes,
    fewer than 2 rows, a 0-d tensor, or a block would hold every row)."""
    if t.dim() == 0 or t.size(0) < 2:
        return 0
    nbytes = t.numel() * t.element_size()
    if nbytes < BLOCK_MIN:
        return 0
    row = nbytes // t.size(0)
    rows = max(1, -(-BLOCK_BYTES // max(1, row)))
    return 0 if rows >= t.size(0) else rows


def split_rows(blob: str, t: torch.Tensor, rows: int) -> dict[str, torch.Tensor]:
    """The blocks of ``t`` (``rows`` rows each, the last maybe fewer): name -> a dim-0 view."""
    n = t.size(0)
    return {block_name(blob, k): t.narrow(0, start, min(rows, n - start))
            for k, start in enumerate(range(0, n, rows))}


@dataclass(frozen=True)
class Block:
    """One block a read of rows ``lo .. hi`` of a chunk touches: its blob, the rows of the
    block wanted (``first .. first + count``, block-relative) and where they go in the read
    (``at``: rows from ``lo``)."""

    blob: str
    first: int
    count: int
    at: int
    whole: bool  # every row of the block is wanted


def blocks_over(blob: str, rows: int, total: int, lo: int, hi: int) -> Iterator[Block]:
    """The blocks of a chunk blob of ``total`` rows stored ``rows`` rows per block that rows
    ``lo .. hi`` overlap, in order (none when ``lo == hi``)."""
    if rows <= 0 or not 0 <= lo <= hi <= total:
        raise ValueError(f"{blob}: rows {lo}..{hi} of a {total}-row chunk in blocks of {rows}")
    for k in range(lo // rows, -(-hi // rows)):
        b0, b1 = k * rows, min((k + 1) * rows, total)
        s, e = max(lo, b0), min(hi, b1)
        if e > s:
            yield Block(block_name(blob, k), s - b0, e - s, s - lo, s == b0 and e == b1)
