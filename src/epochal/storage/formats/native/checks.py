"""Checks of a verify pass that the loads do not need: running checksums of the checksum
groups it reads whole, and a blob's meta checked without allocating its value."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...encoding import codecs as _codecs
from .index import Index
from .items import DECODE_ERRORS
from .layout import corrupt

__all__ = ["GroupSums", "check_meta"]


class GroupSums:
    """Running checksums of the checksum groups a verify reads whole (in any order of blobs:
    a group is compared once its last segment is read, if every one of its segments was)."""

    def __init__(self, idx: Index, wanted: set[int] | None) -> None:
        self.fn = idx.fn
        g = idx.groups
        self.first = g["seg_first"].astype(np.int64)
        self.last = self.first + g["seg_count"].astype(np.int64) - 1
        self.want = g["crc"].tolist()
        if wanted is not None and len(g):  # only groups all of whose segments are verified
            ks = np.fromiter(sorted(wanted), dtype=np.int64, count=len(wanted))
            held = np.searchsorted(ks, self.last, side="right") - np.searchsorted(ks, self.first)
            self.keep = set(np.flatnonzero(held == self.last - self.first + 1).tolist())
        else:
            self.keep = set(range(len(g)))
        self.value: dict[int, int] = {}
        self.next: dict[int, int] = {}  # the segment each group expects next (in order)

    def slot(self, k: int) -> int | None:
        """The group segment ``k`` belongs to, if it is verified whole."""
        if not self.keep:
            return None
        w = int(np.searchsorted(self.first, k, side="right")) - 1
        if w < 0 or k > self.last[w] or w not in self.keep:
            return None
        if self.next.get(w, int(self.first[w])) != k:  # blobs asked out of file order
            self.keep.discard(w)
            return None
        self.next[w] = k + 1
        return w

    def add(self, w: int, data: Any) -> None:
        self.value[w] = self.fn(data, self.value.get(w, 0))

    def end(self, w: int, k: int) -> bool:
        """False when segment ``k`` ends group ``w`` and its checksum does not match."""
        return k != self.last[w] or self.value.get(w, 0) == self.want[w]


def check_meta(path: str, idx: Index, i: int) -> None:
    """CheckpointCorruptError naming the blob when its meta cannot load (without allocating):
    an unknown kind, or an array meta whose dtype and shape do not fit the stored length."""
    kind, meta = idx.entry(i)
    name = idx.name(i)
    try:
        codec = _codecs.codec_for_kind(kind)
        if kind == "ndarray" and isinstance(codec, _codecs.NdarrayCodec):
            sizes = idx.sizes(i)
            want = _codecs.expected_nbytes(_codecs.dtype_from_json(meta.get("dtype")),
                                           _codecs.check_shape(meta.get("shape")))
            if sizes != [want]:
                raise ValueError(f"{sizes} bytes do not fit its dtype and shape")
    except (*DECODE_ERRORS, MemoryError) as e:
        raise corrupt(path, f"bad {kind} meta: {e}", name) from None
