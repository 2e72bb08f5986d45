"""A native file's data area written straight from memory that already holds it (no copy).

A background save copies the state into a snapshot arena whose layout is the native data
area itself: segments in file order, each at a 64-byte aligned offset, zero padding between
(:mod:`epochal.checkpoint.tasks.background`). When the plan's segment views are exactly that, at
their planned offsets in one buffer whose address is congruent to the file offset modulo
the sink's ``pin_align`` (the page size, for ``O_DIRECT``), and every padding byte in it is
zero, :func:`data_image` returns the whole data area as one memoryview and
:func:`write_image` hands it to the sink's ``write_pinned`` (written from the caller's
memory, no staging copy) while the segment and group checksums are computed on the
checksum thread exactly as the streaming path does: one call per segment and one per
group (its range is contiguous here). The bytes on disk are those of
:func:`~epochal.storage.formats.stream.stream_segments`; when any condition fails the writer takes
that path instead (always, with the ``zero_copy`` knob off: :mod:`epochal.knobs`). A sync save's views of live arrays are separate allocations, not laid
out this way (were they, the same bytes would be read from the same memory the streaming
path reads, during the same call).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...io.checksum import ChecksumFn, Checksummer
from ...io.progress import report_progress
from ...io.seam import PinnedSink
from .layout import SUPERBLOCK_SIZE

__all__ = ["PAGE", "data_image", "stats", "write_image"]

#: the alignment an O_DIRECT sink asks of pinned memory (storage/io/direct.py's ALIGN)
PAGE = 4096


class _Stats:
    """How often the image path was taken or refused (for tests and benches)."""

    def __init__(self) -> None:
        self.taken = 0
        self.refused = 0

    def reset(self) -> None:
        self.taken = self.refused = 0


stats = _Stats()


def _address(view: memoryview) -> int:
    """The address of a writable buffer's first byte (TypeError for a read-only one)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _owner(view: memoryview) -> np.ndarray | None:
    """The C-contiguous numpy array that owns the memory of ``view``, if it is one."""
    owner: Any = view.obj
    while isinstance(owner, np.ndarray) and isinstance(owner.base, np.ndarray):
        owner = owner.base
    if not isinstance(owner, np.ndarray) or not owner.flags.c_contiguous:
        return None
    return owner


def data_image(views: Sequence[memoryview], segs: np.ndarray, align: int) -> memoryview | None:
    """The data area of a file of these segment views and records (``SEG_DTYPE``: offset,
    length, pad) as one memoryview of the buffer already holding it, or None unless every
    view lies in one numpy array at exactly ``address(first) + offset - SUPERBLOCK_SIZE``,
    the data area's address is congruent to SUPERBLOCK_SIZE modulo ``align`` and every
    padding byte in it is zero."""
    if align <= 0 or not len(views):
        return None
    offsets = segs["offset"].astype(np.int64)
    lengths = segs["length"].astype(np.int64)
    pads = segs["pad"].astype(np.int64)
    data_len = int(offsets[-1] + lengths[-1] + pads[-1]) - SUPERBLOCK_SIZE
    full = np.flatnonzero(lengths)
    if not len(full):
        return None
    first = views[int(full[0])]
    owner = _owner(first)
    if owner is None or _owner(views[int(full[-1])]) is not owner:  # separate arrays: no
        return None
    try:
        keys = full.tolist()
        if [views[k].nbytes for k in keys] != lengths[full].tolist():
            return None
        # each view's address minus its offset: one value (its data area's address) for all
        addressof, from_buffer = ctypes.addressof, ctypes.c_char.from_buffer
        at = np.array([addressof(from_buffer(views[k])) for k in keys], dtype=np.int64)
        at -= offsets[full]
        base = int(at[0]) + SUPERBLOCK_SIZE
        if (at != at[0]).any():
            return None
        start = base - _address(memoryview(owner.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
    except (TypeError, ValueError, BufferError):  # read-only or non-byte buffers
        return None
    if (base - SUPERBLOCK_SIZE) % align or start < 0 or start + data_len > owner.nbytes:
        return None
    flat = owner.reshape(-1).view(np.uint8)[start : start + data_len]
    has_pad = np.flatnonzero(pads)
    if len(has_pad):  # every padding byte, gathered in one vectorized index
        p = pads[has_pad]
        at = offsets[has_pad] + lengths[has_pad] - SUPERBLOCK_SIZE
        idx = np.repeat(at - (np.cumsum(p) - p), p) + np.arange(int(p.sum()))
        if flat[idx].any():
            return None
    return memoryview(flat)  # type: ignore[arg-type]


def write_image(
    out: PinnedSink,
    fn: ChecksumFn,
    image: memoryview,
    segs: np.ndarray,
    *,
    head: Sequence[Any],
    piece: int,
    groups: Sequence[tuple[int, int]] = (),
) -> list[int]:
    """Write ``head`` (copied, not checksummed), then ``image`` (the data area from file
    offset SUPERBLOCK_SIZE on) from its own memory in pieces of about ``piece`` bytes cut at
    file offsets that are multiples of it; return each segment's checksum, then each
    group's (``(first, count)`` runs of segments, checksummed with their padding), as
    :func:`~epochal.storage.formats.stream.stream_segments` does."""
    n = len(segs)
    rel = segs["offset"].astype(np.int64) - SUPERBLOCK_SIZE
    lengths = segs["length"].astype(np.int64)
    ends = rel + lengths + segs["pad"].astype(np.int64)
    ck = Checksummer(fn, n + len(groups))
    try:
        lo, hi = rel.tolist(), (rel + lengths).tolist()
        pairs: list[tuple[int, Any]] = [(k, image[lo[k] : hi[k]]) for k in range(n)]
        for g, (first, count) in enumerate(groups):
            pairs.append((n + g, image[lo[first] : int(ends[first + count - 1])]))
        ck.submit(pairs)
        out.write(list(head))
        size = image.nbytes
        at = 0
        while at < size:
            file_at = at + SUPERBLOCK_SIZE
            stop = min(size, (file_at // piece + 1) * piece - SUPERBLOCK_SIZE)
            out.write_pinned(image[at:stop])
            report_progress(stop - at)
            at = stop
        stats.taken += 1
        return ck.results()
    finally:
        ck.close()
