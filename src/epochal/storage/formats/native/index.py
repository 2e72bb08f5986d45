"""The native index: parsing and structural validation from bytes alone.

The index is the file's table of contents (docs/format.md): blob and segment tables, the
name-sorted order, the names heap and one JSON array of the distinct ``[kind, meta]`` pairs.
:class:`Index` checks its checksum and that every length and offset stays inside the file
and tiles it (so a crafted or buggy file cannot point anywhere else), then answers lookups.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...encoding import codecs as _codecs
from ...encoding import strict_json
from ...io.checksum import checksum_function, combined, format_checksum
from ..base import BlobInfo
from .frames import CodedTable
from .layout import (
    ALIGN,
    FORMAT_MINOR,
    GROUP_DTYPE,
    INDEX_HEAD,
    INDEX_MAGIC,
    MOFF_DTYPE,
    ORDER_DTYPE,
    REC_DTYPE,
    SEG_DTYPE,
    SUPERBLOCK_SIZE,
    Header,
    corrupt,
)

__all__ = ["Columns", "Index"]

#: the writer's meta entry of a 1-D array (see Index.plain_1d_metas)
_PLAIN_1D = re.compile(rb'\["ndarray",\{"dtype":"([\x20\x21\x23-\x5b\x5d-\x7e]*)","shape":\[(0|[1-9][0-9]{0,18})\]\}\]')
_PLAIN_1D_FIXED = len(b'["ndarray",{"dtype":"","shape":[]}]')


@dataclass
class Columns:
    seg_first: list[int]
    seg_count: list[int]
    offsets: list[int]
    lengths: list[int]
    pads: list[int]
    crcs: list[int]


class Index:
    """The parsed, verified index of one file, from its bytes alone (no file is read here).

    Tables are numpy views of the index bytes; names and metas are decoded lazily (a few
    by bisection, or all at once for a bulk load) and cached."""

    def __init__(self, path: str, header: Header, raw: bytes) -> None:
        self.path = path
        self.header = header
        self.fn = checksum_function(header.algorithm)
        if len(raw) != header.index_length:
            raise corrupt(path, "file is truncated inside the index")
        if self.fn(raw, 0) != header.index_crc:
            raise corrupt(path, "index checksum mismatch (header damaged)")
        magic, _flags, names_len, metas_len, nmetas, ngroups = INDEX_HEAD.unpack_from(raw, 0)
        n, nseg = header.blob_count, header.seg_count
        if magic != INDEX_MAGIC:
            raise corrupt(path, "bad index magic")
        if header.major < 2:
            ngroups = 0  # a reserved field in version 1
        expect = (
            INDEX_HEAD.size + n * REC_DTYPE.itemsize + nseg * SEG_DTYPE.itemsize
            + ngroups * GROUP_DTYPE.itemsize + nmetas * MOFF_DTYPE.itemsize + n * 4
            + names_len + metas_len
        )
        coded_at = expect
        if header.major >= 3:  # the codec part follows the metas text
            expect += CodedTable.sizes(raw, coded_at)[2] if expect <= len(raw) else 0
        # a newer minor version (of the file's major: every major this reader knows is at its
        # minor FORMAT_MINOR) may append parts this reader does not know (and ignores)
        newer = header.minor > FORMAT_MINOR
        if expect > len(raw) or (expect != len(raw) and not newer):
            raise corrupt(
                path, f"absurd index counts ({n} blobs, {nseg} segments, {ngroups} groups, {nmetas} metas)"
            )
        pos = INDEX_HEAD.size

        def table(dtype: np.dtype, count: int) -> np.ndarray:
            nonlocal pos
            arr = np.frombuffer(raw, dtype=dtype, count=count, offset=pos)
            pos += arr.nbytes
            return arr

        self.recs = table(REC_DTYPE, n)
        self.segs = table(SEG_DTYPE, nseg)
        self.groups = table(GROUP_DTYPE, ngroups)
        self.moffs = table(MOFF_DTYPE, nmetas)
        self.order = table(ORDER_DTYPE, n)
        self.names_heap = raw[pos : pos + names_len]
        # a view, not a copy: a forged metas text as big as the file is refused before any copy
        self.metas_text = memoryview(raw)[pos + names_len : pos + names_len + metas_len]
        #: the compressed segments (version 3; None when there are none)
        self.coded: CodedTable | None = None
        if header.major >= 3:
            ctable = CodedTable.parse(path, raw, coded_at)
            if len(ctable.coded) or len(ctable.streams):
                self.coded = ctable
        self._validate()
        self._names: list[str] | None = None
        self._ids: dict[str, int] | None = None
        self._metas: list[Any] | None = None
        self._meta_cache: dict[int, tuple[str, dict[str, Any]]] = {}
        self._cols: Columns | None = None
        self._entries: list[tuple[str, dict[str, Any]]] | None = None
        self._meta_id_list: list[int] | None = None

    def _validate(self) -> None:
        """Structural checks (the checksum catches damage; these catch a writer bug or a
        crafted file, so that no length can point outside the file or overlap)."""
        path, recs, segs = self.path, self.recs, self.segs
        n, nseg = len(recs), len(segs)
        ioff = np.uint64(self.header.index_offset)
        # bound every value by the data area first, so no sum below can wrap around 2**64
        if nseg and (np.any(segs["offset"] > ioff) or np.any(segs["length"] > ioff)):
            raise corrupt(path, "segment table does not tile the data area (points outside it)")
        off = segs["offset"].astype(np.int64)
        length = segs["length"].astype(np.int64)
        pad = segs["pad"].astype(np.int64)
        if nseg:
            ends = off + length + pad
            if (
                off[0] != SUPERBLOCK_SIZE
                or np.any(off % ALIGN)
                or np.any(pad >= ALIGN)
                or np.any(length < 0)
                or np.any(ends[:-1] != off[1:])
                or ends[-1] != self.header.index_offset
            ):
                raise corrupt(path, "segment table does not tile the data area")
        elif self.header.index_offset != SUPERBLOCK_SIZE:
            raise corrupt(path, "data area without segments")
        if int(length.sum()) != self.header.data_bytes:
            raise corrupt(path, "segment lengths do not add up to the data size")
        if n:
            cnt = recs["seg_count"].astype(np.int64)
            first = recs["seg_first"].astype(np.int64)
            noff = recs["name_off"].astype(np.int64)
            nlen = recs["name_len"].astype(np.int64)
            if (
                first[0] != 0
                or np.any(first[1:] != (first + cnt)[:-1])
                or first[-1] + cnt[-1] != nseg
                or np.any(noff + nlen > len(self.names_heap))
                or np.any(recs["meta_id"] >= len(self.moffs))
                or np.any(self.order >= n)
            ):
                raise corrupt(path, "blob table is inconsistent")
            self._check_permutation()
        elif nseg:
            raise corrupt(path, "segments without blobs")
        self._check_groups()
        self._check_meta_table()
        if self.coded is not None:
            self.coded.validate(self.segs, self.groups)

    def _check_groups(self) -> None:
        """Checksum groups are non-empty runs of segments, in file order, disjoint, inside
        the segment table (so each covers one contiguous range of the data area)."""
        g = self.groups
        if not len(g):
            return
        first = g["seg_first"].astype(np.int64)
        end = first + g["seg_count"].astype(np.int64)
        if np.any(end <= first) or end[-1] > len(self.segs) or np.any(first[1:] < end[:-1]):
            raise corrupt(self.path, "checksum group table is inconsistent")

    def blob_of_segment(self, k: int) -> int:
        """The blob that segment ``k`` belongs to (blobs without segments share their
        successor's seg_first, so the owner is the last blob starting at or before ``k``)."""
        return int(np.searchsorted(self.recs["seg_first"], k, side="right")) - 1

    def group_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """Each checksum group's file range: start offsets and end offsets (after the last
        segment's padding), int64 arrays."""
        g, segs = self.groups, self.segs
        first = g["seg_first"].astype(np.int64)
        last = first + g["seg_count"].astype(np.int64) - 1
        start = segs["offset"][first].astype(np.int64)
        end = (segs["offset"][last] + segs["length"][last] + segs["pad"][last]).astype(np.int64)
        return start, end

    def disagreeing_groups(self, ids: Sequence[int], fn: Any) -> list[int]:
        """The checksum groups all of whose segments belong to the blobs ``ids`` whose stored
        checksum is not what their segments' stored checksums combine to (``fn``: the file's
        checksum function), from the index alone (:mod:`epochal.storage.io.checksum`). Such a
        group cannot both verify and have verifying segments: a load of it reads its segments
        one by one and refuses it, as verify does."""
        g = self.groups
        if not len(g) or not len(ids):
            return []
        recs, segs = self.recs, self.segs
        ids_arr = np.asarray(ids, dtype=np.int64)
        first = recs["seg_first"][ids_arr].astype(np.int64)
        count = recs["seg_count"][ids_arr].astype(np.int64)
        nseg = len(segs)
        delta = np.bincount(first, count > 0, nseg + 1) - np.bincount(first + count, count > 0, nseg + 1)
        covered = np.cumsum(delta)[:nseg] > 0
        cs = np.concatenate([[0], np.cumsum(covered)])
        gfirst = g["seg_first"].astype(np.int64)
        gcount = g["seg_count"].astype(np.int64)
        w = np.flatnonzero(cs[gfirst + gcount] - cs[gfirst] == gcount)
        if not len(w):
            return []
        n = gcount[w]
        group_of = np.repeat(np.arange(len(w)), n)
        k = np.repeat(gfirst[w] - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
        want = combined(fn, segs["crc"][k], segs["length"][k], segs["pad"][k], group_of, len(w))
        return w[want != g["crc"][w]].tolist()

    def _check_permutation(self) -> None:
        order = self.order
        if len(order) and np.bincount(order, minlength=len(order)).max() != 1:
            raise corrupt(self.path, "name order table is not a permutation of the blobs")

    def _check_sorted(self, names: list[str]) -> None:
        """The name order sorts the names strictly (code point order is UTF-8 byte order),
        so bisection and a dict of all names find the same blob and no name is stored twice.
        Checked once every name is decoded (full loads, describe, verify); a lookup by
        bisection checks its neighbours instead (:meth:`find`), so partial loads stay cheap."""
        ordered = list(map(names.__getitem__, self.order.tolist()))
        if all(map(str.__lt__, ordered, ordered[1:])):  # (a C-speed loop: 20,000 names in 1 ms)
            return
        for a, b in zip(ordered, ordered[1:]):
            if not a < b:
                what = "blob name stored twice" if a == b else "name order table is not sorted"
                raise corrupt(self.path, f"{what}: {a!r}")

    def _check_meta_table(self) -> None:
        """The meta table tiles the metas text exactly as the elements of its JSON array
        (``[e0,e1,...]``), so parsing one entry or the whole array gives the same meta."""
        text = self.metas_text
        mo, ml = self.moffs["off"].astype(np.int64), self.moffs["len"].astype(np.int64)
        if not len(mo):
            if bytes(text).strip() != b"[]":
                raise corrupt(self.path, "index metas do not match the meta table")
            return
        ends = mo + ml
        raw = np.frombuffer(text, dtype=np.uint8)
        if (
            len(text) < 2
            or text[0] != ord("[")
            or mo[0] != 1
            or np.any(mo[1:] != ends[:-1] + 1)
            or ends[-1] != len(text) - 1
            or text[-1] != ord("]")
            or np.any(raw[ends[:-1]] != ord(","))
        ):
            raise corrupt(self.path, "meta table does not tile the metas array")

    # ---- names
    def name(self, i: int) -> str:
        if self._names is not None:
            return self._names[i]
        r = self.recs[i]
        return self._decode_name(int(r["name_off"]), int(r["name_len"]))

    def _decode_name(self, off: int, ln: int) -> str:
        try:
            return self.names_heap[off : off + ln].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise corrupt(self.path, "blob name is not UTF-8") from None

    def names(self) -> list[str]:
        if self._names is None:
            heap = self.names_heap
            try:
                names = [
                    heap[o : o + ln].decode("utf-8", "surrogatepass")
                    for o, ln in zip(self.recs["name_off"].tolist(), self.recs["name_len"].tolist())
                ]
            except UnicodeDecodeError:
                raise corrupt(self.path, "blob name is not UTF-8") from None
            self._check_sorted(names)
            self._names = names
        return self._names

    def find(self, name: str) -> int | None:
        """The blob index of ``name``: a dict once all names are decoded, else a bisection of
        the name-sorted table that touches only ~log2(n) names."""
        if self._ids is not None:
            return self._ids.get(name)
        key = name.encode("utf-8", "surrogatepass")
        heap, order = self.names_heap, self.order
        offs, lens = self.recs["name_off"], self.recs["name_len"]
        lo, hi = 0, len(order)
        while lo < hi:
            mid = (lo + hi) // 2
            i = int(order[mid])
            o = int(offs[i])
            cand = heap[o : o + int(lens[i])]
            if cand < key:
                lo = mid + 1
            elif cand > key:
                hi = mid
            else:
                for nb in (mid - 1, mid + 1):  # a sorted order puts a duplicate next to it
                    if 0 <= nb < len(order):
                        j = int(order[nb])
                        if heap[int(offs[j]) : int(offs[j]) + int(lens[j])] == key:
                            raise corrupt(self.path, f"blob name stored twice: {name!r}")
                return i
        return None

    def build_ids(self) -> dict[str, int]:
        if self._ids is None:
            self._ids = {nm: i for i, nm in enumerate(self.names())}
        return self._ids

    # ---- metas
    def entry(self, i: int) -> tuple[str, dict[str, Any]]:
        """``(kind, meta)`` of blob ``i``, parsed from only that blob's JSON when few are used."""
        mid = int(self.recs["meta_id"][i])
        got = self._meta_cache.get(mid)
        if got is not None:
            return got
        try:
            if self._metas is not None:
                item = self._metas[mid]
            else:
                o, ln = int(self.moffs["off"][mid]), int(self.moffs["len"][mid])
                item = strict_json.loads(self.metas_text[o : o + ln])
        except (ValueError, RecursionError, IndexError) as e:
            raise corrupt(self.path, f"blob meta is not valid JSON: {e}", self.name(i)) from None
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], dict)
        ):
            raise corrupt(self.path, "blob meta is not a [kind, meta] pair", self.name(i))
        got = (item[0], item[1])
        self._meta_cache[mid] = got
        return got

    def all_entries(self) -> list[tuple[str, dict[str, Any]]]:
        """``(kind, meta)`` of every distinct meta entry, by meta id (validated once each)."""
        if self._entries is None:
            self.parse_all_metas()
            assert self._metas is not None
            metas = self._metas
            # (json gives exact list/str/dict types, so ``type() is`` is isinstance here)
            if not all(
                type(item) is list and len(item) == 2 and type(item[0]) is str and type(item[1]) is dict
                for item in metas
            ):
                raise corrupt(self.path, "blob meta is not a [kind, meta] pair")
            self._entries = list(map(tuple, metas))  # type: ignore[arg-type]
        return self._entries

    def parse_all_metas(self) -> None:
        """Parse the whole metas array at once (faster than one by one for full loads)."""
        if self._metas is None:
            try:
                metas = strict_json.loads(self.metas_text)
            except (ValueError, RecursionError) as e:
                raise corrupt(self.path, f"index metas are not valid JSON: {e}") from None
            if not isinstance(metas, list) or len(metas) != len(self.moffs):
                raise corrupt(self.path, "index metas do not match the meta table")
            self._metas = metas

    def plain_1d_metas(self) -> tuple[list[bytes], list[int]] | None:
        """When every meta entry is exactly the text the writer gives a 1-D numpy array,
        ``["ndarray",{"dtype":"<text>","shape":[<n>]}]`` (printable ASCII without quotes or
        backslashes, an integer without leading zeros), each entry's dtype text and length,
        from one regex scan instead of a JSON parse (a full load of 20,000 arrays: the
        batch path's biggest CPU cost after the copy); else None (parse the JSON). Exact:
        the entries must rebuild the whole metas text, joined by commas, with the meta
        table's lengths, so each is one element of the JSON array and reads as JSON would."""
        text, moffs = self.metas_text, self.moffs
        if len(moffs) == 0:
            return None
        body = text[1:-1].tobytes()
        found = _PLAIN_1D.findall(body)
        if len(found) != len(moffs):
            return None
        dts = [d for d, _ in found]
        ns = [n for _, n in found]
        lens = (np.fromiter(map(len, dts), dtype=np.int64, count=len(dts))
                + np.fromiter(map(len, ns), dtype=np.int64, count=len(ns)) + _PLAIN_1D_FIXED)
        if not np.array_equal(lens, moffs["len"].astype(np.int64)):
            return None
        if b",".join(b'["ndarray",{"dtype":"%s","shape":[%s]}]' % f for f in found) != body:
            return None
        return dts, list(map(int, ns))

    def meta_ids(self) -> list[int]:
        """Every blob's meta id, as a list (cached)."""
        if self._meta_id_list is None:
            self._meta_id_list = self.recs["meta_id"].tolist()
        return self._meta_id_list

    def columns(self) -> Columns:
        """The tables as Python lists (fast per-blob access when many blobs are loaded)."""
        if self._cols is None:
            r, g = self.recs, self.segs
            self._cols = Columns(
                r["seg_first"].tolist(), r["seg_count"].tolist(), g["offset"].tolist(),
                g["length"].tolist(), g["pad"].tolist(), g["crc"].tolist(),
            )
        return self._cols

    def is_coded(self, i: int) -> bool:
        """Whether blob ``i`` has a compressed segment."""
        c = self.coded
        return c is not None and any(k in c.row_of for k in self.seg_range(i))

    def coded_blobs(self, ids: Sequence[int]) -> set[int]:
        """The blobs of ``ids`` that have a compressed segment."""
        c = self.coded
        if c is None:
            return set()
        owners = np.searchsorted(self.recs["seg_first"], c.coded["seg"], side="right") - 1
        return set(owners.tolist()) & set(ids)

    def sizes(self, i: int) -> list[int]:
        """The logical (decoded) length of each segment of blob ``i``."""
        r = self.seg_range(i)
        out: list[int] = self.segs["length"][r.start : r.stop].tolist()
        c = self.coded
        if c is not None:
            for j, k in enumerate(r):
                row = c.row(k)
                if row is not None:
                    out[j] = c.logical(row)
        return out

    def seg_range(self, i: int) -> range:
        r = self.recs[i]
        first = int(r["seg_first"])
        return range(first, first + int(r["seg_count"]))

    def info(self, i: int) -> BlobInfo:
        kind, meta = self.entry(i)
        segs = self.seg_range(i)
        rows = self.segs[segs.start : segs.stop]
        lengths, crcs = self.sizes(i), rows["crc"].tolist()
        dtype = meta.get("dtype")
        if dtype is not None and not isinstance(dtype, str):
            dtype = json.dumps(dtype, separators=(",", ":"))
        shape = meta.get("shape")
        try:
            shape_t = _codecs.check_shape(shape) if shape is not None else None
        except ValueError:
            shape_t = None
        checksum = (
            format_checksum(self.header.algorithm, crcs[0]) + "".join(f"+{c:08x}" for c in crcs[1:])
            if crcs
            else None
        )
        return BlobInfo(self.name(i), kind, dtype, shape_t, int(sum(lengths)), checksum, meta)
