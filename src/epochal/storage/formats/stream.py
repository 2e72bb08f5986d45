"""Streaming a file's segments to a byte sink, checksummed on a background thread: the write
loop both formats share (native: segments with zero padding, big ones in pieces;
safetensors: tensors back to back).

Small segments go out in ``writev`` batches of about ``batch_bytes`` (at most
atomic.IOV_MAX buffers, straight from the values' memory); each batch is handed to the
:class:`~epochal.storage.io.checksum.Checksummer` just before it is written, so the checksums
run on another core while the kernel copies the batch. Segments of ``big`` bytes or more are
written on their own in ``chunk``-sized pieces, each checksummed the same way. The batches
are cut with numpy over the segment sizes, so the per-segment Python work is one list entry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..io import atomic
from ..io.checksum import ChecksumFn, Checksummer
from ..io.progress import report_progress
from ..io.seam import ByteSink

__all__ = ["stream_segments"]

#: zero padding is at most this many bytes (the native alignment)
_MAX_PAD = 64
_ZEROS = memoryview(bytes(_MAX_PAD))
_PAD_VIEWS = [_ZEROS[:p] for p in range(_MAX_PAD)]


def stream_segments(
    out: ByteSink,
    fn: ChecksumFn,
    views: Sequence[Any],
    sizes: Sequence[int],
    *,
    batch_bytes: int,
    pads: Sequence[int] | None = None,
    head: Sequence[Any] = (),
    big: int | None = None,
    chunk: int = 0,
    groups: Sequence[tuple[int, int]] = (),
    produce: Callable[[int], tuple[Any, int, Callable[[], None] | None]] | None = None,
    lazy: Sequence[int] = (),
) -> list[int]:
    """Write ``head`` (not checksummed), then every ``views[k]`` (``sizes[k]`` bytes) followed
    by ``pads[k]`` zero bytes (< 64), in order, to ``out``; return each view's checksum
    (continuing from 0 with ``fn``), then the checksum of each of ``groups``: ``(first,
    count)`` runs of views, each checksummed as one range (its views and their padding, in
    order). The views ``lazy`` (none of them in a group) are made only when the write
    reaches them: ``produce(k)`` gives ``(view, pad, done)``, written on its own in pieces as
    a big view is; ``done`` (or None) is called once its checksum is taken (its buffer may
    then be reused: a compressed segment's, :func:`~.native.write.write_native`)."""
    n = len(views)
    ck = Checksummer(fn, n + len(groups))
    g_first = np.asarray([a for a, _ in groups], dtype=np.int64)
    g_end = g_first + np.asarray([c for _, c in groups], dtype=np.int64)
    made = frozenset(lazy) if produce is not None else frozenset()
    try:
        size_a = np.asarray(sizes, dtype=np.int64).reshape(n)
        pad_l = list(pads) if pads is not None else None
        cum = np.cumsum(size_a + (np.asarray(pad_l, dtype=np.int64) if pad_l is not None else 0))
        big_at = np.flatnonzero(size_a >= big) if big is not None else np.empty(0, dtype=np.int64)
        if made:
            big_at = np.union1d(big_at, np.asarray(sorted(made), dtype=np.int64))
        zpads = [_PAD_VIEWS[p] for p in pad_l] if pad_l is not None else None
        per = 2 if zpads is not None else 1
        max_segs = (atomic.IOV_MAX - len(head) - 2) // per
        carry: list[Any] = list(head)
        carry_bytes = sum(memoryview(b).nbytes for b in carry)
        i = 0
        while i < n:
            nb = int(np.searchsorted(big_at, i))
            if nb < len(big_at) and big_at[nb] == i:  # a big segment, in pieces
                if carry:
                    out.write(carry)
                    report_progress(carry_bytes)
                done = None
                if i in made:
                    assert produce is not None
                    mv, pad, done = produce(i)
                    size, zpad = mv.nbytes, _PAD_VIEWS[pad]
                else:
                    mv, size = views[i], sizes[i]
                    pad = pad_l[i] if pad_l is not None else 0
                    zpad = zpads[i] if zpads is not None else _ZEROS[:0]
                # the checksum slot of its group, or -1 (a group may hold big views too)
                gi = int(np.searchsorted(g_end, i, side="right"))
                g = n + gi if gi < len(g_first) and g_first[gi] <= i else -1
                for start in range(0, size, chunk):
                    piece = mv[start : start + chunk]
                    ck.submit([(i, piece), (g, piece)] if g >= 0 else [(i, piece)])
                    out.write(piece)
                    report_progress(piece.nbytes)
                if done is not None:
                    ck.after(done)
                if g >= 0 and pad:
                    ck.submit([(g, zpad)])
                carry = [zpad] if pad else []
                carry_bytes = pad
                i += 1
                continue
            before = int(cum[i - 1]) if i else 0
            j = min(
                int(np.searchsorted(cum, before + batch_bytes)) + 1,  # the one crossing the line
                i + max_segs,
                int(big_at[nb]) if nb < len(big_at) else n,
                n,
            )
            if zpads is not None:
                bufs = carry + [x for k in range(i, j) for x in (views[k], zpads[k])]
            else:
                bufs = carry + list(views[i:j])
            pairs: list[tuple[int, Any]] = list(zip(range(i, j), views[i:j]))
            if len(g_first):  # each group's part of this batch: a slice of bufs, one job
                c0 = len(carry)
                for g in range(int(np.searchsorted(g_end, i, side="right")),
                               int(np.searchsorted(g_first, j))):
                    lo, hi = max(i, int(g_first[g])), min(j, int(g_end[g]))
                    pairs.append((n + g, bufs[c0 + per * (lo - i) : c0 + per * (hi - i)]))
            ck.submit(pairs)
            out.write(bufs)
            report_progress(carry_bytes + int(cum[j - 1]) - before)
            carry, carry_bytes = [], 0
            i = j
        if carry:
            out.write(carry)
            report_progress(carry_bytes)
        return ck.results()
    finally:
        ck.close()
