"""A restore's side: find each leaf in a step's db, read only the rows a shard needs, checked.

:func:`stored_leaves` walks the db's blobs (a tree blob's skeleton, dict and list levels)
and gives every stored leaf by its names (:mod:`.names`): a tensor record's kind, meta and
segment, or an inline plain value. :func:`read_regions` fills the shard regions of an
array leaf (each ``index``: one slice per axis, as a sharding's
``addressable_devices_indices_map`` gives it), reading each byte once for all of them:

* a record with ``row_crc`` (written by the JAX door: :mod:`.host`) is read in runs of
  blocks, only the blocks holding rows of some region; a run that one region of whole rows
  holds is read straight into it, any other in pieces of at most ``chunk_bytes`` (at least
  one row) through a scratch buffer, each piece's rows and columns copied into every region
  they overlap (column slices of one row range share one read); every block's checksum is
  checked before the regions are returned; the runs are independent, for threads;
* any other record (written by PyTorch, or numpy) has one checksum for the whole tensor,
  so its whole segment is read once in pieces of ``chunk_bytes`` (at least one row), each
  piece's rows copied into the regions, and the checksum checked before they are returned.

So the host memory a read needs beyond the regions it returns is one scratch buffer of at
most ``max(chunk_bytes, one row)`` per reading thread. The regions are returned
in buffers aligned for JAX to adopt as CPU device buffers without a copy
(:func:`aligned_empty`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checkpoint.tasks.steps import INTERNAL_PREFIX
from ..storage.encoding.codecs import check_shape, codec_for_kind, dtype_from_json, flat_writable
from ..storage.encoding.skeleton import TREE_KIND, Decoder, check_leaves
from ..storage.formats.native.layout import corrupt
from ..storage.formats.native.reads.ranges import RangedFile, Segment
from .names import dtype_by_name

__all__ = ["ALIGN", "DEFAULT_CHUNK", "Stored", "aligned_empty", "array_layout", "read_plain", "read_region",
           "read_regions", "stored_leaves"]

#: default bound of a reading thread's scratch buffer (bytes)
DEFAULT_CHUNK = 1 << 20
#: the reads of one leaf are cut in at least this many runs (when it has the blocks), so
#: that that many threads can share them
READERS = 4

_ARRAY_KINDS = ("torch.tensor", "ndarray")

#: the alignment of a region's buffer: JAX's CPU client adopts a numpy array this aligned as
#: a device buffer without a copy (``jax.device_put`` onto a CPU device)
ALIGN = 64


def aligned_empty(shape: tuple[int, ...] | list[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an :data:`ALIGN` boundary."""
    dt = np.dtype(dtype)
    n = math.prod(shape) * dt.itemsize
    raw = np.empty(n + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + n].view(dt).reshape(shape)


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


#: one independent read of :func:`read_regions` (a run of blocks), for a thread to run
Task = Callable[[], None]


def _serially(tasks: list[Task]) -> None:
    for task in tasks:
        task()


def read_region(f: RangedFile, s: Stored, label: str, index: tuple[Any, ...],
                chunk: int = DEFAULT_CHUNK, out: np.ndarray | None = None) -> np.ndarray:
    """The region ``index`` of the array leaf ``s`` (see the module doc), checked: in
    ``out`` if given (C-contiguous, the region's shape and dtype), else in a new
    :func:`aligned_empty` array."""
    return read_regions(f, s, label, [index], chunk, None if out is None else [out])[0]


def read_regions(f: RangedFile, s: Stored, label: str, indices: Sequence[tuple[Any, ...]],
                 chunk: int = DEFAULT_CHUNK, outs: Sequence[np.ndarray] | None = None,
                 run: Callable[[list[Task]], None] | None = None) -> list[np.ndarray]:
    """The regions ``indices`` of the array leaf ``s``, each in a new :func:`aligned_empty`
    array (or in ``outs``: views of any strides; rows are read straight into a C-contiguous
    one), every byte read once for all of them and checked before use:
    regions sharing rows (column slices of one row range) share the reads of those rows.
    ``run`` runs the independent reads (a thread pool's map; default: one after another),
    each with at most one scratch buffer of ``max(chunk, one row)``."""
    layout = array_layout(s)
    assert layout is not None
    dt, shape = layout
    bounds = [_bounds(ix, shape) for ix in indices]
    if outs is None:
        outs = [aligned_empty([b - a for a, b in bd], dt) for bd in bounds]
    for o, bd in zip(outs, bounds):
        if o.shape != tuple(b - a for a, b in bd) or o.dtype != dt:
            raise ValueError(f"leaf {label}: a {o.dtype} {o.shape} buffer for a {dt} region {bd}")
    live = [(bd, o) for bd, o in zip(bounds, outs) if o.size]
    if not live:
        return list(outs)
    run = run or _serially
    if not shape:  # 0-d: one element
        one = aligned_empty((), dt)
        _read_whole_checked(f, s, one.reshape(-1).view(np.uint8), chunk, label)
        for _, o in live:
            o[...] = one
        return list(outs)
    row_bytes = math.prod(shape[1:]) * dt.itemsize

    def full_rows(bd: list[tuple[int, int]], o: np.ndarray) -> bool:
        """Whether region ``bd`` (in ``o``) is whole rows, in C order: rows can be read into it."""
        return o.flags.c_contiguous and all(a == 0 and b == n for (a, b), n in zip(bd[1:], shape[1:]))

    def scatter(r0: int, r1: int, got: np.ndarray, skip: np.ndarray | None = None) -> None:
        """Rows r0..r1 of the leaf (``got``) into every region they overlap."""
        for bd, o in live:
            a, z = max(r0, bd[0][0]), min(r1, bd[0][1])
            if a < z and o is not skip:
                o[a - bd[0][0] : z - bd[0][0]] = got[(slice(a - r0, z - r0),) + tuple(slice(x, y) for x, y in bd[1:])]

    blocks = _row_blocks(s, shape)
    if blocks is None:  # one checksum for the whole tensor: one pass for every region
        whole = next((o for bd, o in live if full_rows(bd, o) and bd[0] == (0, shape[0])), None)
        if whole is not None:
            _read_whole_checked(f, s, whole.reshape(-1).view(np.uint8), chunk, label)
            scatter(0, shape[0], whole, skip=whole)
            return list(outs)
        piece_rows = max(1, chunk // max(1, row_bytes))
        scratch = np.empty(min(piece_rows, shape[0]) * row_bytes, dtype=np.uint8)

        def use(pos: int, piece: memoryview) -> None:
            p0 = pos // row_bytes
            p1 = p0 + piece.nbytes // row_bytes
            scatter(p0, p1, np.frombuffer(piece, dtype=dt).reshape(p1 - p0, *shape[1:]))

        f.stream(s.segs[0], flat_writable(scratch), s.blob, use, f"leaf {label}")
        return list(outs)
    rows, crcs = blocks
    needed = sorted({k for bd, _ in live for k in range(bd[0][0] // rows, (bd[0][1] - 1) // rows + 1)})
    per_run = max(1, -(-len(needed) // READERS))
    runs: list[tuple[int, int]] = []
    for k in needed:  # consecutive needed blocks, at most per_run in a run
        if runs and runs[-1][1] == k and runs[-1][1] - runs[-1][0] < per_run:
            runs[-1] = (runs[-1][0], k + 1)
        else:
            runs.append((k, k + 1))
    offset, piece_rows = s.segs[0][0], max(1, chunk // max(1, row_bytes))

    def check(k: int, crc: int) -> None:
        if crc != crcs[k]:
            raise corrupt(f.path, f"leaf {label}: checksum mismatch in rows "
                                  f"{k * rows}..{min((k + 1) * rows, shape[0])}", s.blob)

    def read_run(b: int, e: int) -> None:
        br0, br1 = b * rows, min(e * rows, shape[0])
        # rows that one region of whole rows holds all of are read straight into it
        into = next(((bd, o) for bd, o in live if full_rows(bd, o) and bd[0][0] <= br0 and br1 <= bd[0][1]), None)
        if into is not None:
            r0 = into[0][0][0]
            view = into[1].reshape(-1).view(np.uint8)[(br0 - r0) * row_bytes : (br1 - r0) * row_bytes]
            f.read_into(flat_writable(view), offset + br0 * row_bytes, s.blob)
            for k in range(b, e):
                k0, k1 = (k * rows - br0) * row_bytes, (min((k + 1) * rows, shape[0]) - br0) * row_bytes
                check(k, f.fn(view[k0:k1], 0))
            scatter(br0, br1, view.view(dt).reshape(br1 - br0, *shape[1:]), skip=into[1])
            return
        # else in pieces of at most chunk bytes (whole rows), each piece's rows copied into
        # the regions; each block's checksum checked once its last piece is in (nothing is
        # returned before every block checked)
        scratch = np.empty(min(piece_rows, br1 - br0) * row_bytes, dtype=np.uint8)
        for k in range(b, e):
            k0, k1, crc = k * rows, min((k + 1) * rows, shape[0]), 0
            for p0 in range(k0, k1, piece_rows):
                p1 = min(k1, p0 + piece_rows)
                view = scratch[: (p1 - p0) * row_bytes]
                f.read_into(flat_writable(view), offset + p0 * row_bytes, s.blob)
                crc = f.fn(view, crc)
                scatter(p0, p1, view.view(dt).reshape(p1 - p0, *shape[1:]))
            check(k, crc)

    run([lambda b=b, e=e: read_run(b, e) for b, e in runs])  # type: ignore[misc]
    return list(outs)


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
