"""Read path: blobs with compressed segments (format 3.0), whole or a byte range.

A compressed segment's stored bytes are read into a scratch buffer, checked (the segment's
checksum and padding, or for a ranged read each stream's own checksum) and only then
decoded into the fresh buffer the blob's codec allocated for its logical length
(:func:`~epochal.storage.encoding.compress.decode_frames`), so nothing is decoded, let alone
restored into a live object, from bytes that were not verified. A stream that does not
decode to its frame's bytes (a forged file whose checksums match) is reported as corrupt,
naming the blob. A ranged read decodes only the frames that hold its bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .....errors import CheckpointError
from ....encoding import codecs as _codecs
from ....encoding.codecs import flat_writable
from ....encoding.compress import decode_frames
from ....io.reads import read_bytes, read_exact
from ..frames import CodedTable
from ..items import DECODE_ERRORS, LoadItem, Opened
from ..layout import DAMAGED_DATA, DAMAGED_PAD, corrupt

__all__ = ["read_coded", "read_coded_bytes", "read_range", "stats", "verify_coded"]


@dataclass
class Stats:
    """Frames decoded in this process (tests count them to see a ranged read decode few)."""

    frames: int = 0


stats = Stats()


def _split(stored: memoryview, lengths: list[int]) -> list[memoryview]:
    out, at = [], 0
    for n in lengths:
        out.append(stored[at:at + n])
        at += n
    return out


def _decode(f: Opened, table: CodedTable, row: int, first: int, end: int, streams: list[memoryview],
            out: memoryview, name: str) -> None:
    codec, planes, fb, logical = table.layout(row)
    try:
        decode_frames(codec, planes, fb, logical, first, streams, out)
    except ValueError as e:
        raise corrupt(f.path, f"compressed segment: {e}", name) from None
    stats.frames += end - first


def _segment(f: Opened, k: int, name: str, verify: bool) -> tuple[memoryview, int]:
    """The stored bytes of segment ``k`` (checked unless ``verify`` is False) and its row."""
    idx = f.index
    assert idx.coded is not None
    seg = idx.segs[k]
    off, length, pad = int(seg["offset"]), int(seg["length"]), int(seg["pad"])
    stored = memoryview(bytearray(length + pad))
    read_exact(f.src, [stored], off, name)
    if verify:
        if idx.fn(stored[:length], 0) != int(seg["crc"]):
            raise corrupt(f.path, DAMAGED_DATA, name)
        if any(stored[length:]):
            raise corrupt(f.path, DAMAGED_PAD, name)
    row = idx.coded.row(k)
    assert row is not None
    return stored[:length], row


def read_coded(f: Opened, ids: list[int], verify: bool) -> list[LoadItem]:
    """Read, check and decode the blobs ``ids`` (each with a compressed segment) into fresh
    buffers, in file order; their items, ready for the codecs' decode."""
    idx = f.index
    table = idx.coded
    assert table is not None
    items: list[LoadItem] = []
    for i in ids:
        name = idx.name(i)
        kind, meta = idx.entry(i)
        sizes = idx.sizes(i)
        try:
            codec = _codecs.codec_for_kind(kind)
            bufs = [b if type(b) is memoryview and b.ndim == 1 and b.format == "B" else flat_writable(b)
                    for b in codec.allocate(meta, sizes)]
        except CheckpointError:
            raise
        except (*DECODE_ERRORS, MemoryError) as e:
            raise corrupt(f.path, f"bad {kind} meta: {e}", name) from None
        if [b.nbytes for b in bufs] != sizes or any(b.readonly for b in bufs):
            raise corrupt(f.path, f"codec buffers do not fit the {len(sizes)} segments", name)
        _fill(f, i, bufs, name, verify)
        items.append(LoadItem(i, name, kind, meta, codec, bufs))
    return items


def read_coded_bytes(f: Opened, i: int, verify: bool) -> list[memoryview]:
    """Blob ``i``'s segments (one of them at least compressed), read, checked and decoded
    into fresh buffers of their logical sizes, without its codec: for a reader that
    interprets the meta itself (a process's part of a JAX array, which its codec alone
    refuses to decode)."""
    bufs = [memoryview(bytearray(n)) for n in f.index.sizes(i)]
    _fill(f, i, bufs, f.index.name(i), verify)
    return bufs


def _fill(f: Opened, i: int, bufs: list[memoryview], name: str, verify: bool) -> None:
    """Every segment of blob ``i`` into ``bufs``: raw ones read, compressed ones decoded."""
    table = f.index.coded
    assert table is not None
    for j, k in enumerate(f.index.seg_range(i)):
        if table.row(k) is None:
            _raw(f, k, bufs[j], name, verify)
            continue
        stored, row = _segment(f, k, name, verify)
        _, _, lengths, _ = table.stream_range(row, 0, table.frame_count(row))
        _decode(f, table, row, 0, table.frame_count(row), _split(stored, lengths), bufs[j], name)


def _raw(f: Opened, k: int, buf: memoryview, name: str, verify: bool) -> None:
    seg = f.index.segs[k]
    off, length, pad = int(seg["offset"]), int(seg["length"]), int(seg["pad"])
    read_exact(f.src, [buf], off, name)
    if verify:
        if f.index.fn(buf, 0) != int(seg["crc"]):
            raise corrupt(f.path, DAMAGED_DATA, name)
        if pad and any(read_bytes(f.src, pad, off + length, "padding", name)):
            raise corrupt(f.path, DAMAGED_PAD, name)


def read_range(f: Opened, i: int, lo: int, hi: int, verify: bool = True) -> bytes:
    """Logical bytes ``lo .. hi`` of blob ``i``'s single segment. A compressed segment: only
    the frames holding them are read, checked (each stream's checksum) and decoded; a raw
    one is read whole and checked (its checksum covers it whole), then sliced."""
    idx = f.index
    name = idx.name(i)
    r = idx.seg_range(i)
    if len(r) != 1:
        raise ValueError(f"{f.path}: blob {name!r} has {len(r)} segments; a ranged read needs one")
    k = r.start
    size = idx.sizes(i)[0]
    if not 0 <= lo <= hi <= size:
        raise ValueError(f"{f.path}: blob {name!r}: byte range {lo}..{hi} outside its {size} bytes")
    table = idx.coded
    row = table.row(k) if table is not None else None
    if row is None or table is None:
        buf = memoryview(bytearray(size))
        _raw(f, k, buf, name, verify)
        return bytes(buf[lo:hi])
    if lo == hi:
        return b""
    _, _, fb, _ = table.layout(row)
    first, end = lo // fb, -(-hi // fb)
    start, stop, lengths, crcs = table.stream_range(row, first, end)
    stored = memoryview(bytearray(stop - start))
    read_exact(f.src, [stored], int(idx.segs["offset"][k]) + start, name)
    streams = _split(stored, lengths)
    if verify and any(idx.fn(s, 0) != c for s, c in zip(streams, crcs)):
        raise corrupt(f.path, DAMAGED_DATA, name)
    base = first * fb
    out = memoryview(bytearray(min(size, end * fb) - base))
    _decode(f, table, row, first, end, streams, out, name)
    return bytes(out[lo - base:hi - base])


def verify_coded(f: Opened, k: int, name: str, fn: Callable[[Any, int], int]) -> None:
    """Check compressed segment ``k`` as a load would: its checksum and padding, every
    stream's checksum, and that every frame decodes to its bytes (one frame at a time, into
    a scratch buffer), so a file that verifies also loads."""
    stored, row = _segment(f, k, name, True)
    table = f.index.coded
    assert table is not None
    nframes = table.frame_count(row)
    codec, planes, fb, logical = table.layout(row)
    scratch = memoryview(bytearray(min(fb, logical)))
    for fr in range(nframes):
        start, stop, lengths, crcs = table.stream_range(row, fr, fr + 1)  # (stop - start: their bytes)
        streams = _split(stored[start:stop], lengths)
        if any(fn(s, 0) != c for s, c in zip(streams, crcs)):
            raise corrupt(f.path, "stream checksum mismatch (index and data disagree)", name)
        n = min(logical, (fr + 1) * fb) - fr * fb
        _decode(f, table, row, fr, fr + 1, streams, scratch[:n], name)
