"""Read path: big segments into fresh buffers over tuning.IO_THREADS threads.

Taken by the general path (:mod:`.fill`) when the big segments of a load add up to
tuning.PARALLEL_MIN or more: several requests in flight keep a cold disk busy, where one
reader's speed swung 3x from run to run here.
"""

from __future__ import annotations

from collections.abc import Callable

from ...io import tuning
from ...io.reads import read_bytes, read_exact
from ...io.threads import contiguous, run_parallel
from ..base import report_progress
from .items import BigRead, Opened
from .layout import DAMAGED_PAD, corrupt

__all__ = ["read_parallel"]


def read_parallel(f: Opened, par: list[BigRead], verify: bool, got: list[int]) -> None:
    """Read big segments into their buffers with IO_THREADS threads, each a contiguous part
    of the file, in READ_PIECE pieces, each piece checksummed by its thread right after it is
    read (CRC-32C releases the GIL); checksums go to ``got[slot]``, and a nonzero padding is
    reported naming the blob. Progress is reported by the calling thread (its own bytes as
    it goes, the others' at the end)."""
    path, src, fn = f.path, f.src, f.index.fn
    piece_size = tuning.READ_PIECE
    groups = contiguous([item.buf.nbytes for item in par], tuning.IO_THREADS)
    done = [0] * len(groups)

    def job(g: int) -> Callable[[], None]:
        def run() -> None:
            for k in groups[g]:
                item = par[k]
                buf, off, name = item.buf, item.off, item.name
                crc = 0
                for start in range(0, buf.nbytes, piece_size):
                    piece = buf[start : start + piece_size]
                    read_exact(src, [piece], off + start, name, progress=g == 0)
                    if verify:
                        crc = fn(piece, crc)
                    done[g] += piece.nbytes
                if verify:
                    got[item.slot] = crc
                    if item.pad and any(read_bytes(src, item.pad, off + buf.nbytes, "padding", name)):
                        raise corrupt(path, DAMAGED_PAD, name)
        return run

    run_parallel([job(g) for g in range(len(groups))])
    report_progress(sum(done[1:]))
