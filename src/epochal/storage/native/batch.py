"""Read path: loads of many small plain numpy arrays (one read per group of segments).

Taken by loads of more than tuning.MANY_BLOBS blobs without a memory map; the blobs it
does not take (other kinds, big or empty segments, metas that do not fit) go on to the
general path, which reports their errors.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import codecs as _codecs
from .. import tuning
from ..checksum import checksum_function
from ..io.reads import Prefetcher, merged_ranges
from ..io.threads import Worker
from .items import Opened
from .layout import ALIGN, corrupt

__all__ = ["read_small_arrays"]


def read_small_arrays(
    f: Opened, ids: list[int], verify: bool
) -> tuple[dict[str, np.ndarray], list[int], int]:
    """The batch path for many small plain numpy arrays (pread only).

    Blobs whose codec is the built-in NdarrayCodec and whose one segment is small are
    read in groups of adjacent segments (about GROUP_BYTES each) with one ``preadv``
    into one fresh buffer per group; each segment's checksum and padding are checked;
    the arrays are writable, non-overlapping views of that buffer, exactly the dtype,
    shape and bytes NdarrayCodec would give. Returns ``{name: array}`` in file order,
    the blob indices left to the general path (other kinds, big or empty segments,
    metas that do not fit: the general path reports those) and the data bytes read.

    The calling thread only issues the ``preadv`` calls (candidates are chosen from the
    segment table alone); a worker thread meanwhile parses the metas, then per group
    (in order, as each is read) checks the checksums and padding of the blobs that fit
    and builds their views. Candidates whose meta does not fit are left to the general
    path (their bytes here are not used)."""
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
    # groups of file-adjacent segments, cut where the file is not contiguous or a
    # GROUP_BYTES boundary is crossed
    cut = np.ones(len(ks), dtype=bool)
    cut[1:] = (offs[1:] != ends[:-1]) | (offs[1:] // group_bytes != offs[:-1] // group_bytes)
    starts_j = np.flatnonzero(cut).tolist()
    bounds = list(zip(starts_j, [*starts_j[1:], len(ks)]))
    offs_l, ends_l = offs.tolist(), ends.tolist()
    ranges = merged_ranges([(offs_l[a], ends_l[b - 1]) for a, b in bounds])
    ahead = Prefetcher(f.src, ranges if int(lens.sum()) >= tuning.PREFETCH_MIN else [])
    fn = checksum_function(idx.header.algorithm, inline=True)
    cols64 = np.arange(ALIGN, dtype=np.int64)
    bad: list[str] = []
    out: dict[str, np.ndarray] = {}
    # filled by prepare() on the worker
    st: dict[str, Any] = {}

    def prepare() -> None:
        entries = idx.all_entries()
        st["names"] = idx.names()
        # per distinct meta: (dtype, shape) when it is a well-formed ndarray meta
        layouts: list[tuple[np.dtype, tuple[int, ...]] | None] = []
        nbytes_of = np.full(len(entries) + 1, -1, dtype=np.int64)
        dtypes: dict[Any, np.dtype] = {}
        for mid, (kind, meta) in enumerate(entries):
            lay: tuple[np.dtype, tuple[int, ...]] | None = None
            if kind == "ndarray":
                d, sh = meta.get("dtype"), meta.get("shape")
                dt = dtypes.get(d) if type(d) is str else None
                if (  # the common 1-D case, checked as check_shape would
                    dt is not None and type(sh) is list and len(sh) == 1
                    and type(sh[0]) is int and 0 <= sh[0] <= _codecs.MAX_DIM
                ):
                    nbytes_of[mid] = sh[0] * dt.itemsize
                    lay = (dt, (sh[0],))
                else:
                    try:
                        dt = _codecs.dtype_from_json(d)
                        shape = _codecs.check_shape(sh)
                        nbytes_of[mid] = _codecs.expected_nbytes(dt, shape)
                        lay = (dt, shape)
                        if type(d) is str:
                            dtypes[d] = dt
                    except ValueError:
                        lay = None  # the general path raises the error, naming the blob
            layouts.append(lay)
        mids = recs["meta_id"][cand_ids].astype(np.int64)
        fit = nbytes_of[mids] == lens
        st["layouts"] = layouts
        st["fit"] = fit
        st["mids_l"] = mids.tolist()
        st["fast_l"] = cand_ids.tolist()
        st["lens_l"] = lens.tolist()
        st["crcs_l"] = segs["crc"][ks].tolist() if verify else None
        # fitting blobs per group: sel_lists[g] = relative indices j of fitting segments
        fj = np.flatnonzero(fit)
        st["fj"] = fj.tolist()
        st["gcut"] = np.searchsorted(fj, np.asarray(starts_j + [len(ks)], dtype=np.int64)).tolist()

    def check(g: int, buf: np.ndarray, start: int) -> None:
        # runs on the worker thread, overlapped with the next group's preadv
        if bad:
            return
        a, b = bounds[g]
        fj_l, gcut = st["fj"], st["gcut"]
        sel_j = fj_l[gcut[g] : gcut[g + 1]]
        if not sel_j:
            return
        crcs_l = st["crcs_l"]
        lens_l = st["lens_l"]
        mv = memoryview(buf)  # type: ignore[arg-type]
        if crcs_l is not None:
            for j in sel_j:
                rel = offs_l[j] - start
                if fn(mv[rel : rel + lens_l[j]], 0) != crcs_l[j]:
                    bad.append(f"d{j}")
                    return
            # each padding is the tail of the 64-byte block that ends where it ends
            fit_g = st["fit"][a:b]
            p_ = np.where(fit_g, pads[a:b], 0)
            sel = np.flatnonzero(p_)
            if len(sel):
                rows = buf.reshape(-1, ALIGN)[(ends[a:b][sel] - start) // ALIGN - 1]
                badm = (rows != 0) & (cols64[None, :] >= ALIGN - p_[sel][:, None])
                if badm.any():
                    bad.append(f"p{a + int(sel[int(np.flatnonzero(badm.any(axis=1))[0])])}")
                    return
        names, layouts, mids_l, fast_l = st["names"], st["layouts"], st["mids_l"], st["fast_l"]
        new_array = np.ndarray
        for j in sel_j:
            i = fast_l[j]
            dt, shape = layouts[mids_l[j]]
            out[names[i]] = new_array(shape, dtype=dt, buffer=buf, offset=offs_l[j] - start)

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
        what, j = bad[0][0], int(bad[0][1:])
        msg = ("data checksum mismatch (blob damaged)" if what == "d"
               else "nonzero padding after the data (blob damaged)")
        raise corrupt(path, msg, st["names"][cand_l[j]])
    fit = st["fit"]
    if not fit.all():
        rest_ids = np.sort(np.concatenate([ids_arr[~cand], cand_ids[~fit]]))
    else:
        rest_ids = ids_arr[~cand]
    total = int(lens[fit].sum())
    return out, rest_ids.tolist(), total
