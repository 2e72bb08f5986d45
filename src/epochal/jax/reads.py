"""A restore's side: find each leaf in a step's db, read only the rows a shard needs, checked.

:func:`stored_leaves` walks the db's blobs (a tree blob's skeleton, dict and list levels)
and gives every stored leaf by its names (:mod:`.names`): a tensor record's kind, meta and
segment, or an inline plain value. :func:`read_region` fills one shard's region of an
array leaf (``index``: one slice per axis, as ``jax.make_array_from_callback`` gives it):

* a record with ``row_crc`` (written by the JAX door: :mod:`.host`) is read block by block,
  only the blocks holding rows of the region, each block's checksum checked before its bytes
  are used; a region of whole rows is read straight into the result, a column slice through
  a scratch buffer of at most ``chunk_bytes`` (at least one block), keeping its columns;
* any other record (written by PyTorch, or numpy) has one checksum for the whole tensor,
  so its whole segment is read in pieces of ``chunk_bytes`` (at least one row), the piece's
  rows of the region kept, and the checksum checked before the region is returned.

So the host memory a read needs beyond the region it returns is one scratch buffer of at
most ``max(chunk_bytes, one block, one row)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checkpoint.tasks.steps import INTERNAL_PREFIX
from ..storage.encoding.codecs import check_shape, codec_for_kind, dtype_from_json, flat_writable
from ..storage.encoding.skeleton import TREE_KIND, Decoder, check_leaves
from ..storage.formats.native.layout import corrupt
from ..storage.formats.native.ranges import RangedFile, Segment
from .names import dtype_by_name

__all__ = ["DEFAULT_CHUNK", "Stored", "array_layout", "read_plain", "read_region", "stored_leaves"]

#: default bound of a read's scratch buffer (bytes)
DEFAULT_CHUNK = 64 << 20

_ARRAY_KINDS = ("torch.tensor", "ndarray")


@dataclass
class Stored:
    """One stored leaf: the blob it is in, and its record (``kind``, ``meta``, ``segs``) or,
    for a plain value inline in a tree's skeleton, ``inline`` (with ``kind`` ``"inline"``)."""

    blob: str
    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    segs: list[Segment] = field(default_factory=list)
    inline: Any = None


def _key_part(k: Any) -> str:
    return k if isinstance(k, str) else f"[{k!r}]"


def stored_leaves(f: RangedFile) -> dict[tuple[str, ...], Stored]:
    """Every leaf stored in ``f`` by its names (epochal's own blobs left out)."""
    out: dict[tuple[str, ...], Stored] = {}
    for name in f.names():
        if name.startswith(INTERNAL_PREFIX):
            continue
        found = f.find(name)
        assert found is not None
        kind, meta, segs = found
        if kind != TREE_KIND:
            out[(name,)] = Stored(name, kind, meta, segs)
            continue
        try:
            leaves = check_leaves(meta.get("leaves"))
            firsts = np.cumsum([0] + [n for _, _, n in leaves]).tolist()
            if firsts[-1] != len(segs):
                raise ValueError(f"the tree's leaves need {firsts[-1]} segments, the blob has {len(segs)}")
            inline = Decoder(meta.get("leaves"), [memoryview(b"")] * len(segs))
            _walk(meta.get("root"), (name,), name, leaves, firsts, segs, inline, out, 0)
        except (ValueError, TypeError, KeyError) as e:
            raise corrupt(f.path, f"bad tree meta: {e}", name) from None
    return out


def _walk(node: Any, names: tuple[str, ...], blob: str, leaves: list[tuple[str, dict[str, Any], int]],
          firsts: list[int], segs: list[Segment], inline: Decoder,
          out: dict[tuple[str, ...], Stored], depth: int) -> None:
    if depth > 200:
        raise ValueError("tree nested too deep")
    if isinstance(node, list) and node and node[0] in ("d", "o") and isinstance(node[1], list):
        for item in node[1]:
            key = inline.node(item[0], 0)
            _walk(item[1], (*names, _key_part(key)), blob, leaves, firsts, segs, inline, out, depth + 1)
    elif isinstance(node, list) and node and node[0] in ("l", "t") and isinstance(node[1], list):
        for i, sub in enumerate(node[1]):
            _walk(sub, (*names, f"[{i}]"), blob, leaves, firsts, segs, inline, out, depth + 1)
    elif isinstance(node, list) and len(node) == 2 and node[0] == "x" and isinstance(node[1], int):
        i = node[1]
        if not 0 <= i < len(leaves):
            raise ValueError(f"tree leaf {i} out of range")
        kind, meta, n = leaves[i]
        out[names] = Stored(blob, kind, meta, segs[firsts[i] : firsts[i] + n])
    else:
        out[names] = Stored(blob, "inline", inline=inline.node(node, 0))


def array_layout(s: Stored) -> tuple[np.dtype, tuple[int, ...]] | None:
    """The dtype and shape of an array record (None for other kinds); ValueError for a
    record whose meta does not fit its one segment."""
    if s.kind not in _ARRAY_KINDS:
        return None
    dt = dtype_by_name(s.meta.get("dtype")) if s.kind == "torch.tensor" else dtype_from_json(s.meta.get("dtype"))
    if dt is None:
        raise ValueError(f"dtype {s.meta.get('dtype')!r} has no numpy equivalent")
    shape = check_shape(s.meta.get("shape"))
    if len(s.segs) != 1 or s.segs[0][1] != math.prod(shape) * dt.itemsize:
        raise ValueError(f"the data does not fit a {dt} array of shape {shape}")
    return dt, shape


def _row_blocks(s: Stored, shape: tuple[int, ...]) -> tuple[int, list[int]] | None:
    """``(rows per block, checksums)`` of a record with valid ``row_crc``, else None."""
    rc = s.meta.get("row_crc")
    if rc is None or not shape:
        return None
    rows, crcs = rc.get("rows") if isinstance(rc, dict) else None, rc.get("crcs") if isinstance(rc, dict) else None
    if (not isinstance(rows, int) or isinstance(rows, bool) or rows < 1 or not isinstance(crcs, list)
            or len(crcs) != -(-shape[0] // rows) or not all(isinstance(c, int) for c in crcs)):
        raise ValueError("bad row_crc meta")
    return rows, crcs


def _bounds(index: tuple[Any, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    out = []
    for d, n in enumerate(shape):
        sl = index[d] if d < len(index) else slice(None)
        a, b, st = sl.indices(n)
        if st != 1:
            raise ValueError(f"a strided index {sl} cannot be read")
        out.append((a, max(a, b)))
    return out


def read_region(f: RangedFile, s: Stored, label: str, index: tuple[Any, ...],
                chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """The region ``index`` of the array leaf ``s`` (see the module doc), checked."""
    layout = array_layout(s)
    assert layout is not None
    dt, shape = layout
    bounds = _bounds(index, shape)
    out = np.empty([b - a for a, b in bounds], dtype=dt)
    if out.size == 0:
        return out
    if not shape:  # 0-d: one element
        _read_whole_checked(f, s, out.reshape(-1).view(np.uint8), chunk, label)
        return out
    r0, r1 = bounds[0]
    cols = tuple(slice(a, b) for a, b in bounds[1:])
    full_rows = all(a == 0 and b == n for (a, b), n in zip(bounds[1:], shape[1:]))
    row_bytes = math.prod(shape[1:]) * dt.itemsize
    blocks = _row_blocks(s, shape)
    if blocks is None:
        if full_rows and r0 == 0 and r1 == shape[0]:
            _read_whole_checked(f, s, out.reshape(-1).view(np.uint8), chunk, label)
            return out
        piece_rows = max(1, chunk // max(1, row_bytes))
        scratch = np.empty(piece_rows * row_bytes, dtype=np.uint8)

        def use(pos: int, piece: memoryview) -> None:
            p0 = pos // row_bytes
            p1 = p0 + piece.nbytes // row_bytes
            a, b = max(p0, r0), min(p1, r1)
            if a < b:
                got = np.frombuffer(piece, dtype=dt).reshape(p1 - p0, *shape[1:])
                out[a - r0 : b - r0] = got[(slice(a - p0, b - p0),) + cols]

        f.stream(s.segs[0], flat_writable(scratch), s.blob, use, f"leaf {label}")
        return out
    rows, crcs = blocks
    fn = f.fn
    offset = s.segs[0][0]
    run_blocks = max(1, chunk // max(1, rows * row_bytes))
    scratch_arr: np.ndarray | None = None
    flat_out = out.reshape(-1).view(np.uint8)
    b = r0 // rows
    last = (r1 - 1) // rows
    while b <= last:
        e = min(last + 1, b + run_blocks)
        br0, br1 = b * rows, min(e * rows, shape[0])
        nbytes = (br1 - br0) * row_bytes
        direct = full_rows and br0 >= r0 and br1 <= r1
        if direct:
            view = flat_out[(br0 - r0) * row_bytes : (br1 - r0) * row_bytes]
        else:
            if scratch_arr is None:
                scratch_arr = np.empty(min(run_blocks * rows, shape[0]) * row_bytes, dtype=np.uint8)
            view = scratch_arr[:nbytes]
        f.read_into(flat_writable(view), offset + br0 * row_bytes, s.blob)
        for k in range(b, e):
            k0, k1 = (k * rows - br0) * row_bytes, (min((k + 1) * rows, shape[0]) - br0) * row_bytes
            if fn(view[k0:k1], 0) != crcs[k]:
                raise corrupt(f.path, f"leaf {label}: checksum mismatch in rows "
                                      f"{k * rows}..{min((k + 1) * rows, shape[0])}", s.blob)
        if not direct:
            a, z = max(br0, r0), min(br1, r1)
            got = view.view(dt).reshape(br1 - br0, *shape[1:])
            out[a - r0 : z - r0] = got[(slice(a - br0, z - br0),) + cols]
        b = e
    return out


def _read_whole_checked(f: RangedFile, s: Stored, dest: np.ndarray, chunk: int, label: str) -> None:
    """All of ``s``'s one segment straight into ``dest``, in pieces, checked at the end."""
    offset, length, want = s.segs[0]
    crc, pos, step = 0, 0, max(1, chunk)
    while pos < length:
        n = min(step, length - pos)
        piece = flat_writable(dest[pos : pos + n])
        f.read_into(piece, offset + pos, s.blob)
        crc = f.fn(piece, crc)
        pos += n
    if crc != want:
        raise corrupt(f.path, f"leaf {label}: data checksum mismatch", s.blob)


def read_plain(f: RangedFile, s: Stored) -> Any:
    """A plain (non-array) leaf's value: inline, or decoded by its codec after every
    segment's checksum matched. Array and torch kinds are not plain (ValueError)."""
    if s.kind == "inline":
        return s.inline
    if s.kind in _ARRAY_KINDS or s.kind.startswith("torch.") or s.kind == TREE_KIND:
        raise ValueError(f"a {s.kind} record is not a plain value")
    codec = codec_for_kind(s.kind)
    bufs = codec.allocate(s.meta, [n for _, n, _ in s.segs])
    for buf, (off, _, want) in zip(bufs, s.segs):
        f.read_into(buf, off, s.blob)
        if f.fn(buf, 0) != want:
            raise corrupt(f.path, "data checksum mismatch", s.blob)
    return codec.decode(s.meta, bufs)
