"""Read path: read-only views of a memory map handed to the codecs (``open_native(mmap=True)``).

Nothing is copied up front: arrays decoded from the views are read-only and share the page
cache. Every checksum and padding is still checked before any value is decoded.
"""

from __future__ import annotations

from typing import Any

from ..base import report_progress
from .items import LoadItem, Opened
from .layout import DAMAGED_DATA, DAMAGED_PAD, corrupt

__all__ = ["map_views"]


def map_views(f: Opened, mm: Any, plan: list[LoadItem], verify: bool) -> None:
    """Phase 2 (mmap): append each segment's view of ``mm`` to its item, after verifying."""
    idx = f.index
    whole = memoryview(mm)
    segs = idx.segs
    for item in plan:
        bufs = item.bufs
        for k in idx.seg_range(item.index):
            off, ln, pad = int(segs["offset"][k]), int(segs["length"][k]), int(segs["pad"][k])
            view = whole[off : off + ln]
            report_progress(ln)
            if verify:
                if idx.fn(view, 0) != int(segs["crc"][k]):
                    raise corrupt(f.path, DAMAGED_DATA, item.name)
                if pad and any(whole[off + ln : off + ln + pad]):
                    raise corrupt(f.path, DAMAGED_PAD, item.name)
            bufs.append(view)
