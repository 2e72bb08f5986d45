"""Read path: loads of many small plain numpy arrays (one read per group of segments).

Taken by loads of more than tuning.MANY_BLOBS blobs without a memory map; the blobs it
does not take (other kinds, big or empty segments, metas that do not fit) go on to the
general path, which reports their errors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ....encoding import codecs as _codecs
from ....encoding.dtypes import MAX_DIM
from ....io import tuning
from ....io.checksum import checksum_function
from ....io.reads import Prefetcher, merged_ranges
from ....io.threads import Worker
from ..index import Index
from ..items import Opened
from ..layout import ALIGN, DAMAGED_DATA, DAMAGED_GROUP, DAMAGED_PAD, corrupt

__all__ = ["read_small_arrays"]



def read_small_arrays(
    f: Opened, ids: list[int], verify: bool, suspect: set[int] | frozenset[int] = frozenset()
) -> tuple[dict[str, np.ndarray], list[int], int]:
    """The batch path for many small plain numpy arrays (pread only).

    Blobs whose codec is the built-in NdarrayCodec and whose one segment is small are
    read in groups of adjacent segments (about GROUP_BYTES each) with one ``preadv``
    into one fresh buffer per group; the checksums are checked (one call per checksum
    group of the file, docs/format.md, when the read holds all of its segments; else each
    segment's checksum and padding); the arrays are writable, non-overlapping views of that
    buffer, exactly the dtype, shape and bytes NdarrayCodec would give. Returns ``{name:
    array}`` in file order, the blob indices left to the general path (other kinds, big or
    empty segments, metas that do not fit: the general path reports those) and the data
    bytes read.

    The calling thread only issues the ``preadv`` calls (candidates are chosen from the
    segment table alone); a worker thread meanwhile parses the metas, then per read
    (in order, as each is read) checks the checksums and builds the views of the blobs
    that fit. Candidates whose meta does not fit are left to the general path (their bytes
    here are not used). ``suspect``: checksum groups whose stored checksum disagrees with
    their segments' (:meth:`Index.disagreeing_groups`): their segments are checked one by
    one, so the damage is named as verify names it."""
    if _codecs.plain_ndarray_codec() is None:
        return {}, ids, 0
    idx, path = f.index, f.path
    big, group_bytes = tuning.BIG_SEGMENT, tuning.GROUP_BYTES
    ids_arr = np.asarray(ids, dtype=np.int64)
    recs, segs = idx.recs, idx.segs
    if not len(segs):
        return {}, ids, 0  # no blob has data (e.g. only Python scalars)
    first = recs["seg_first"][ids_arr].astype(np.int64)
    one = recs["seg_count"][ids_arr] == 1
    # a blob without segments has seg_first == its successor's (possibly past the table)
    seg_len = np.where(one, segs["length"][np.minimum(first, len(segs) - 1)].astype(np.int64), 0)
    cand = one & (seg_len > 0) & (seg_len < big)
    if int(cand.sum()) < 2:
        return {}, ids, 0
    cand_ids = ids_arr[cand]
    ks = first[cand]
    offs = segs["offset"][ks].astype(np.int64)
    lens = seg_len[cand]
    pads = segs["pad"][ks].astype(np.int64)
    ends = offs + lens + pads
    # the file's checksum groups whose every segment is a candidate ("whole"): one checksum
    # call each; per candidate, its whole group (-1: none) and whether it starts it
    whole_w, wfirst_j = _whole_groups(idx.groups, ks) if verify else (np.zeros(0, np.int64),) * 2
    w_of_j = np.full(len(ks), -1, dtype=np.int64)
    if len(whole_w):
        gcount = idx.groups["seg_count"][whole_w].astype(np.int64)
        for_j = np.repeat(np.arange(len(whole_w)), gcount)
        w_of_j[np.concatenate([np.arange(a, a + c) for a, c in zip(wfirst_j.tolist(), gcount.tolist())])] = for_j
    # reads of file-adjacent segments, cut where the file is not contiguous, or a
    # GROUP_BYTES boundary is crossed outside a whole group
    cut = np.ones(len(ks), dtype=bool)
    inside = (w_of_j[1:] >= 0) & (w_of_j[1:] == w_of_j[:-1])
    cut[1:] = (offs[1:] != ends[:-1]) | ((offs[1:] // group_bytes != offs[:-1] // group_bytes) & ~inside)
    starts_j = np.flatnonzero(cut).tolist()
    bounds = list(zip(starts_j, [*starts_j[1:], len(ks)]))
    read_cuts = np.asarray(starts_j + [len(ks)], dtype=np.int64)  # candidates of read g: [g, g+1)
    offs_l, ends_l = offs.tolist(), ends.tolist()
    ranges = merged_ranges([(offs_l[a], ends_l[b - 1]) for a, b in bounds])
    ahead = Prefetcher(f.src, ranges if int(lens.sum()) >= tuning.PREFETCH_MIN else [])
    fn = checksum_function(idx.header.algorithm, inline=True)
    fn_big = checksum_function(idx.header.algorithm)  # releases the GIL
    cols64 = np.arange(ALIGN, dtype=np.int64)
    bad: list[tuple[str, int]] = []  # (message, candidate j) of the first damage found
    out: dict[str, np.ndarray] = {}
    # filled by prepare() on the worker
    st: dict[str, Any] = {}

    def prepare() -> None:
        lay = _layouts(idx)
        names_ = idx.names()
        mids = recs["meta_id"][cand_ids].astype(np.int64)
        fit = lay.nbytes[mids] == lens
        isz = lay.isz[mids]
        code = lay.code[mids]
        st["views"] = lay.views
        st["code_l"] = code.tolist()
        st["names_l"] = (
            names_ if len(cand_ids) == len(names_) else [names_[i] for i in cand_ids.tolist()]
        )
        st["layout_of"], st["mids_l"], st["fit"] = lay.layout, mids.tolist(), fit
        # fitting blobs per read: fj[gcut[g] : gcut[g + 1]] are its candidates j
        fj = np.flatnonzero(fit)
        st["fj"] = fj.tolist()
        st["gcut"] = np.searchsorted(fj, read_cuts).tolist()
        # per fitting blob, its element range in its read's buffer (for the typed views)
        read_of = np.searchsorted(read_cuts[:-1], fj, side="right") - 1
        f_isz = isz[fj]
        r0 = (offs[fj] - offs[read_cuts[:-1][read_of]]) // f_isz
        st["r0_l"], st["r1_l"] = r0.tolist(), (r0 + lens[fj] // f_isz).tolist()
        if verify:
            st["lens_l"] = lens.tolist()
            st["crcs_l"] = segs["crc"][ks].tolist()
            # per read: the whole groups it holds (as [wcut[g], wcut[g + 1]) of whole_w)
            # and the fitting candidates outside them, checked one by one
            loose = fit & (w_of_j < 0)
            lj = np.flatnonzero(loose)
            st["lj"] = lj.tolist()
            st["lcut"] = np.searchsorted(lj, read_cuts).tolist()
            st["wcut"] = np.searchsorted(wfirst_j, read_cuts).tolist()
            if len(whole_w):
                gstart, gend = idx.group_ranges()
                st["w_l"] = list(zip(gstart[whole_w].tolist(), gend[whole_w].tolist(),
                                     idx.groups["crc"][whole_w].tolist(), wfirst_j.tolist(),
                                     [w not in suspect for w in whole_w.tolist()]))
            else:
                st["w_l"] = []

    def check_groups(g: int, mv: memoryview, start: int) -> bool:
        """One checksum per whole group of this read; on a mismatch, name the damaged blob."""
        w_l, wcut = st["w_l"], st["wcut"]
        for gs, ge, want, j0, agrees in w_l[wcut[g] : wcut[g + 1]]:
            if not agrees or fn_big(mv[gs - start : ge - start], 0) != want:
                crcs_l, lens_l = st["crcs_l"], st["lens_l"]
                j = j0
                while j < len(offs_l) and offs_l[j] < ge:  # which segment (or padding) it is
                    rel = offs_l[j] - start
                    if fn(mv[rel : rel + lens_l[j]], 0) != crcs_l[j]:
                        bad.append((DAMAGED_DATA, j))
                        return False
                    if any(mv[rel + lens_l[j] : ends_l[j] - start]):
                        bad.append((DAMAGED_PAD, j))
                        return False
                    j += 1
                bad.append((DAMAGED_GROUP, j0))
                return False
        return True

    def check_loose(g: int, buf: np.ndarray, mv: memoryview, start: int) -> bool:
        """Each segment's checksum and padding, for the fitting candidates outside whole groups."""
        lj_l, lcut = st["lj"], st["lcut"]
        sel_j = lj_l[lcut[g] : lcut[g + 1]]
        if not sel_j:
            return True
        crcs_l, lens_l = st["crcs_l"], st["lens_l"]
        for j in sel_j:
            rel = offs_l[j] - start
            if fn(mv[rel : rel + lens_l[j]], 0) != crcs_l[j]:
                bad.append((DAMAGED_DATA, j))
                return False
        # each padding is the tail of the 64-byte block that ends where it ends
        sel = np.asarray(sel_j, dtype=np.int64)
        p_ = pads[sel]
        nz = np.flatnonzero(p_)
        if len(nz):
            rows = buf.reshape(-1, ALIGN)[(ends[sel[nz]] - start) // ALIGN - 1]
            badm = (rows != 0) & (cols64[None, :] >= ALIGN - p_[nz][:, None])
            if badm.any():
                bad.append((DAMAGED_PAD, int(sel[nz[int(np.flatnonzero(badm.any(axis=1))[0])]])))
                return False
        return True

    def check(g: int, buf: np.ndarray, start: int) -> None:
        # runs on the worker thread, overlapped with the next read's preadv
        if bad:
            return
        mv = memoryview(buf)  # type: ignore[arg-type]
        if verify and not (check_groups(g, mv, start) and check_loose(g, buf, mv, start)):
            return
        a, b = st["gcut"][g], st["gcut"][g + 1]
        views, r0_l, r1_l = st["views"], st["r0_l"], st["r1_l"]
        fj_l, names_l, code_l = st["fj"], st["names_l"], st["code_l"]
        tvs: list[Any] = [None] * len(views)  # typed views of the buffer, as needed
        new_array = np.ndarray
        for k in range(a, b):
            j = fj_l[k]
            c = code_l[j]
            if c >= 0:
                tv = tvs[c]
                if tv is None:
                    tv = tvs[c] = buf.view(views[c])
                out[names_l[j]] = tv[r0_l[k] : r1_l[k]]
            else:
                dt, shape = st["layout_of"](st["mids_l"][j])
                out[names_l[j]] = new_array(shape, dtype=dt, buffer=buf, offset=offs_l[j] - start)

    worker = Worker()
    cand_l = cand_ids.tolist()
    try:
        worker.submit(prepare)
        for g, (a, b) in enumerate(bounds):
            start = offs_l[a]
            buf = np.empty(ends_l[b - 1] - start, dtype=np.uint8)
            ahead.read([memoryview(buf)], start, idx.name(cand_l[a]))  # type: ignore[arg-type]
            if not ahead.cached and g + 1 < len(bounds):
                # later hints from the worker, which has time to spare
                worker.submit(ahead.advance, offs_l[bounds[g + 1][0]])
            worker.submit(check, g, buf, start)
        worker.wait()
    finally:
        worker.close()
    if bad:
        msg, j = bad[0]
        raise corrupt(path, msg, st["names_l"][j])
    fit = st["fit"]
    if not fit.all():
        rest_ids = np.sort(np.concatenate([ids_arr[~cand], cand_ids[~fit]]))
    else:
        rest_ids = ids_arr[~cand]
    total = int(lens[fit].sum())
    return out, rest_ids.tolist(), total


@dataclass
class _Layouts:
    """What each distinct meta entry of a file means for the batch path, by meta id:
    ``nbytes`` (-1: not a well-formed ndarray meta: the general path reports it), ``code``
    (which typed view a 1-D array is a slice of, -1: built with np.ndarray), ``isz``
    (itemsize, 1 when unused), ``views`` (the dtype of each code) and ``layout(mid)``:
    (dtype, shape) of a well-formed meta."""

    nbytes: np.ndarray
    code: np.ndarray
    isz: np.ndarray
    views: list[np.dtype]
    layout: Callable[[int], tuple[np.dtype, tuple[int, ...]]]


def _view_code(dt: np.dtype, views: list[np.dtype], view_ids: dict[np.dtype, int]) -> int:
    """The typed-view code of ``dt`` (an itemsize dividing ALIGN), else -1."""
    if not dt.itemsize or ALIGN % dt.itemsize:
        return -1
    c = view_ids.get(dt, -1)
    if c < 0:
        c = view_ids[dt] = len(views)
        views.append(dt)
    return c


def _layouts(idx: Index) -> _Layouts:
    views: list[np.dtype] = []
    view_ids: dict[np.dtype, int] = {}
    plain = idx.plain_1d_metas()
    if plain is not None:  # every meta a 1-D array: no JSON parse, nothing per meta in Python
        dts, ns = plain
        uniq = list(dict.fromkeys(dts))
        kinds: list[tuple[np.dtype | None, int]] = []
        for dtext in uniq:
            try:
                dt: np.dtype | None = _codecs.dtype_from_json(dtext.decode("ascii"))
            except ValueError:
                dt = None  # the general path raises the error, naming the blob
            kinds.append((dt, -1 if dt is None else _view_code(dt, views, view_ids)))
        uid = np.fromiter(map(dict(zip(uniq, range(len(uniq)))).__getitem__, dts), dtype=np.int64, count=len(dts))
        n = np.asarray(ns, dtype=np.uint64)  # (19 digits at most: below 2**64)
        n_ok = n <= np.uint64(MAX_DIM)
        n64 = np.where(n_ok, n, 0).astype(np.int64)
        isz_u = np.asarray([dt.itemsize if dt is not None else 0 for dt, _ in kinds], dtype=np.int64)
        ok_u = np.asarray([dt is not None for dt, _ in kinds], dtype=bool)
        size = isz_u[uid]
        # n * itemsize without overflow: lengths that fit are below BIG_SEGMENT anyway
        small_n = n_ok & (n64 <= (1 << 40))
        nbytes = np.where(ok_u[uid] & small_n, n64 * size, -2)
        code_u = np.asarray([c for _, c in kinds], dtype=np.int64)
        dt_u = [dt for dt, _ in kinds]
        return _Layouts(
            np.append(nbytes, -1), np.append(code_u[uid], -1), np.append(np.maximum(size, 1), 1),
            views, lambda mid: (dt_u[int(uid[mid])], (ns[mid],)),  # type: ignore[arg-type, return-value]
        )
    entries = idx.all_entries()
    layouts: list[tuple[np.dtype, tuple[int, ...]] | None] = []
    nbytes_of = [-1] * (len(entries) + 1)  # (lists while filled: cheaper than numpy items)
    code_of = [-1] * (len(entries) + 1)
    isz_of = [1] * (len(entries) + 1)
    known: dict[Any, tuple[np.dtype, int]] = {}  # dtype JSON text -> (dtype, view code)
    for mid, (kind, meta) in enumerate(entries):
        lay: tuple[np.dtype, tuple[int, ...]] | None = None
        if kind == "ndarray":
            d, sh = meta.get("dtype"), meta.get("shape")
            hit = known.get(d) if type(d) is str else None
            if (  # the common 1-D case, checked as check_shape would
                hit is not None and type(sh) is list and len(sh) == 1
                and type(sh[0]) is int and 0 <= sh[0] <= MAX_DIM
            ):
                dt_, c = hit
                nbytes_of[mid] = sh[0] * dt_.itemsize
                lay = (dt_, (sh[0],))
                if c >= 0:
                    code_of[mid], isz_of[mid] = c, dt_.itemsize
            else:
                try:
                    dt_ = _codecs.dtype_from_json(d)
                    shape = _codecs.check_shape(sh)
                    nbytes_of[mid] = _codecs.expected_nbytes(dt_, shape)
                    lay = (dt_, shape)
                except ValueError:
                    lay = None  # the general path raises the error, naming the blob
                else:
                    c = _view_code(dt_, views, view_ids)
                    if type(d) is str:
                        known[d] = (dt_, c)
                    if c >= 0 and len(shape) == 1:
                        code_of[mid], isz_of[mid] = c, dt_.itemsize
        layouts.append(lay)
    return _Layouts(
        np.asarray(nbytes_of, dtype=np.int64), np.asarray(code_of, dtype=np.int64),
        np.asarray(isz_of, dtype=np.int64), views, layouts.__getitem__,  # type: ignore[arg-type]
    )


def _whole_groups(groups: np.ndarray, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The checksum groups all of whose segments are among the (sorted) candidate segments
    ``ks``, and the candidate index of each one's first segment."""
    if not len(groups):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    gfirst = groups["seg_first"].astype(np.int64)
    gcount = groups["seg_count"].astype(np.int64)
    j0 = np.searchsorted(ks, gfirst)  # where each group's first segment would be
    j1 = np.searchsorted(ks, gfirst + gcount)
    # candidates are distinct and sorted: all members present iff the count matches and
    # the first one is there
    ok = ((j1 - j0) == gcount) & (j0 < len(ks))
    ok &= ks[np.minimum(j0, len(ks) - 1)] == gfirst
    w = np.flatnonzero(ok)
    return w, j0[w]
