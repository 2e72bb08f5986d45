"""Incremental saves over many steps: compaction bounds the older files a chunk's bytes lie
in and the pieces it is cut into; reads that take pieces of many files, in any order and
overlapping in their source, restore bit-exact (in fresh processes); the sink's extents,
built in numpy, tile the file as a full save's bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import epochal as ep
from epochal import knobs
from epochal.storage.formats.native import incremental
from epochal.storage.io.extents import open_db

pytestmark = pytest.mark.unit

ROWS, DIM = 8192, 256  # an 8 MiB float32 table, 1 KiB rows: two content chunks


def _table(step: int) -> np.ndarray:
    """The table at ``step``: 2% of its rows (fixed by the step) changed at each step."""
    emb = np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)
    for s in range(1, step + 1):
        emb[np.random.default_rng(s).choice(ROWS, ROWS // 50, replace=False)] += np.float32(s)
    return emb


RESTORE = textwrap.dedent("""
    import sys, numpy as np, epochal as ep
    d, step, shape = sys.argv[1], int(sys.argv[2]), tuple(int(x) for x in sys.argv[4].split(","))
    st = {"emb": np.zeros(shape, np.float32)}
    with ep.Checkpointer(d, progress=False) as ck:
        got = ck.restore(st, step=step)
    np.save(sys.argv[3], st["emb"])
    print(got)
""")


def _restore_fresh(d: Path, step: int, shape: tuple[int, ...], tmp: Path) -> np.ndarray:
    script = tmp / "restore.py"
    script.write_text(RESTORE)
    out = tmp / f"r{step}.npy"
    p = subprocess.run([sys.executable, str(script), str(d), str(step), str(out), ",".join(map(str, shape))],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == str(step), p.stderr
    return np.load(out)


def _sources_per_chunk(path: Path, lo: int, hi: int) -> list[int]:
    """For each content chunk of logical bytes lo..hi: how many older files its bytes lie in."""
    src = open_db(str(path))
    try:
        ext = src.ex.ext
        out = []
        for c in range(lo, hi, incremental.CHUNK_BYTES):
            e = min(hi, c + incremental.CHUNK_BYTES)
            a, b = ext["loff"].astype(np.int64), ext["loff"].astype(np.int64) + ext["length"].astype(np.int64)
            sel = (a < e) & (b > c)
            out.append(len({int(s) for s in ext["source"][sel] if s}))
        return out
    finally:
        src.close()


def _emb_range(path: Path) -> tuple[int, int]:
    from epochal.storage.formats.native.reads.ranges import RangedFile

    with RangedFile(str(path)) as f:
        i = f.index.find("emb")
        row = f.index.segs[f.index.seg_range(i).start]
        return int(row["offset"]), int(row["offset"]) + int(row["length"])


@pytest.mark.system
def test_compaction_bounds_the_files_a_chunk_spans_and_every_step_restores_bit_exact(tmp_path):
    d = tmp_path / "ck"
    with knobs.override(incremental_sources=2), ep.Checkpointer(str(d), incremental=True, progress=False) as ck:
        for s in range(1, 8):
            ck.save(s, {"emb": _table(s)})
    lo, hi = _emb_range(d / "local.1")
    sizes = {s: os.path.getsize(d / f"local.{s}") for s in range(1, 8)}
    spans = {s: _sources_per_chunk(d / f"local.{s}", lo, hi) for s in range(2, 8)}
    for s, per in spans.items():
        assert max(per) <= 2, (s, per)  # never more than incremental_sources older files per chunk
    table = ROWS * DIM * 4
    # steps 2 and 3 reference one and two older files; step 4 would span three: the table is
    # written whole again, and the steps after it reference it
    assert sizes[2] < table // 10 and sizes[3] < table // 10
    assert sizes[4] >= table
    assert sizes[5] < table // 10 and spans[5] == [1, 1]
    assert sizes[7] >= table  # (steps 4 and 5 referenced, then 6 would add a third)
    for s in (3, 4, 6, 7):
        assert _restore_fresh(d, s, (ROWS, DIM), tmp_path).tobytes() == _table(s).tobytes(), s
    v = subprocess.run([sys.executable, "-m", "epochal", "verify", str(d)], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr


@pytest.mark.system
def test_a_chunk_cut_into_more_pieces_than_the_bound_is_stored_whole(tmp_path):
    d = tmp_path / "ck"  # (a chunk with 2% of 4096 rows changed: ~160 pieces)
    with knobs.override(incremental_pieces=100), ep.Checkpointer(str(d), incremental=True, progress=False) as ck:
        for s in (1, 2):
            ck.save(s, {"emb": _table(s)})
    assert os.path.getsize(d / "local.2") >= ROWS * DIM * 4
    assert _restore_fresh(d, 2, (ROWS, DIM), tmp_path).tobytes() == _table(2).tobytes()


@pytest.mark.system
def test_the_bound_is_a_knob_read_at_each_save(tmp_path):
    # the same 9 steps under the default bound (8 older files: step 10 would be the first
    # rewrite) and under 3 (steps 5 and 9 rewrite the table whole), then the default again
    # in the same process: only the steps the knob rewrote are the table's size
    table = ROWS * DIM * 4
    sizes = {}
    for bound in (None, 3, None):
        d = tmp_path / f"ck{len(sizes)}"
        with knobs.override(**({"incremental_sources": bound} if bound else {})), \
                ep.Checkpointer(str(d), incremental=True, progress=False) as ck:
            for s in range(1, 10):
                ck.save(s, {"emb": _table(s)})
        sizes[len(sizes)] = [s for s in range(2, 10) if os.path.getsize(d / f"local.{s}") >= table]
        assert _restore_fresh(d, 9, (ROWS, DIM), tmp_path).tobytes() == _table(9).tobytes()
    assert sizes == {0: [], 1: [5, 9], 2: []}


@pytest.mark.system
def test_pieces_that_share_their_source_bytes_restore_bit_exact(tmp_path):
    # step 2: the second half of x becomes a copy of the first half of step 1: both halves
    # then reference the same stored bytes of step 1 (one read with overlapping sources)
    half = 1 << 20  # floats: 4 MiB, one content chunk
    rng = np.random.default_rng(3)
    x1 = rng.standard_normal(2 * half).astype(np.float32)
    x2 = np.concatenate([x1[:half], x1[:half]])
    d = tmp_path / "ck"
    with ep.Checkpointer(str(d), incremental=True, progress=False) as ck:
        ck.save(1, {"emb": x1.reshape(2, half)})
        ck.save(2, {"emb": x2.reshape(2, half)})
    assert os.path.getsize(d / "local.2") < 64 << 10  # both halves are references
    src = open_db(str(d / "local.2"))
    try:
        ext = src.ex.ext[src.ex.ext["source"] != 0]
        soff = ext["soff"].astype(np.int64)
        assert len(ext) >= 2 and len(set(soff.tolist())) < len(soff)  # the same source bytes twice
    finally:
        src.close()
    assert _restore_fresh(d, 2, (2, half), tmp_path).tobytes() == x2.tobytes()


def test_changed_runs_and_references_tile_the_chunk_like_a_full_save(tmp_path):
    # the logical bytes of an incremental step are those of a full save, byte for byte
    d_inc, d_full = tmp_path / "inc", tmp_path / "full"
    for d, inc in ((d_inc, True), (d_full, False)):
        with ep.Checkpointer(str(d), incremental=inc, progress=False) as ck:
            for s in (1, 2, 3):
                ck.save(s, {"emb": _table(s)})
    src = open_db(str(d_inc / "local.3"))
    try:
        n = src.size()
        buf = bytearray(n)
        assert src.read_into([memoryview(buf)], 0) == n
        ext = src.ex.ext
        assert ext["loff"][0] == 0 and int(ext["loff"][-1] + ext["length"][-1]) == n
        assert np.all(ext["loff"][1:] == ext["loff"][:-1] + ext["length"][:-1])
        # adjacent references to the same file whose bytes follow each other were merged
        same = (ext["source"][1:] == ext["source"][:-1]) & (ext["source"][1:] != 0)
        follows = ext["soff"][1:] == ext["soff"][:-1] + ext["length"][:-1]
        assert not np.any(same & follows)
    finally:
        src.close()
    full = (d_full / "local.3").read_bytes()
    assert bytes(buf) == full


def test_one_changed_byte_anywhere_in_a_unit_stores_exactly_that_unit(tmp_path):
    # a unit's comparison reads its word flags in groups: a byte changed at a unit's first,
    # last or a group's edge, or in the short unit at the segment's end, is still found
    n = 262_144 + 25  # float32: 1 MiB and 100 bytes, the last unit short
    a = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    b = a.copy()
    u = incremental.DIFF_UNIT
    at = [0, 10 * u + u - 1, 20 * u + 63, 20 * u + 64, 30 * u + 100, 4 * n - 1]
    b.view(np.uint8)[at] ^= 0x5A
    d = tmp_path / "d"
    with ep.Checkpointer(str(d), incremental=True, progress=False) as ck:
        ck.save(1, {"emb": a})
        ck.save(2, {"emb": b})
    lo, hi = _emb_range(d / "local.2")
    src = open_db(str(d / "local.2"))
    try:
        ext = src.ex.ext
        loff = ext["loff"].astype(np.int64)
        sel = (loff >= lo) & (loff < hi) & (ext["source"] == 0)
        end = np.minimum(loff[sel] + ext["length"][sel].astype(np.int64), hi)  # (the stored index follows)
        stored = sorted(zip((loff[sel] - lo).tolist(), (end - loff[sel]).tolist()))
    finally:
        src.close()
    units = sorted({x // u for x in at})
    assert stored == [(k * u, min(u, 4 * n - k * u)) for k in units]
    assert _restore_fresh(d, 2, (n,), tmp_path).tobytes() == b.tobytes()
