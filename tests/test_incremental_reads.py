"""The restore of an incremental step whose bytes span many older steps: bit-identical, its
extent table parsed once, and every older file read in about as many calls as it has merged
spans (not one per extent). The restore runs in a fresh process that counts the parses and
the read calls per file through wrappers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import epochal as ep
from epochal.storage.io.extents import ExtentSource, open_db
from epochal.storage.io.extents.reads import MAX_PIECES_READ, MERGE_GAP, MERGE_SPAN

ROWS, DIM, STEPS = 8192, 256, 6  # an 8 MiB float32 table of 1 KiB rows

pytestmark = pytest.mark.system


def _table(step: int) -> np.ndarray:
    emb = np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)
    for s in range(1, step + 1):  # 2% of the rows change at each step
        emb[np.random.default_rng(s).choice(ROWS, ROWS // 50, replace=False)] += np.float32(s)
    return emb


RESTORE = textwrap.dedent("""
    import collections, json, os, sys
    import numpy as np
    import epochal as ep
    from epochal.storage.io import extents, local
    from epochal.storage.io.extents import reads as extent_reads

    d, out = sys.argv[1], sys.argv[2]
    parses, calls, windows = [0], collections.Counter(), [0]
    parse = extents.parse_extents
    def counted_parse(*a, **k):
        parses[0] += 1
        return parse(*a, **k)
    extents.parse_extents = counted_parse
    def name(fd):
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    iov = extent_reads.preadv_iov
    def counted_iov(fd, rows, off):
        calls[name(fd)] += 1
        return iov(fd, rows, off)
    extent_reads.preadv_iov = counted_iov
    read_into = local.LocalSource.read_into
    def counted_read_into(self, views, offset, **k):
        calls[name(self.fd)] += 1
        return read_into(self, views, offset, **k)
    local.LocalSource.read_into = counted_read_into
    gather = extents.ExtentSource.read_into
    def counted_window(self, views, offset, **k):
        windows[0] += 1
        return gather(self, views, offset, **k)
    extents.ExtentSource.read_into = counted_window
    st = {"emb": np.zeros((ROWS, DIM), np.float32)}
    with ep.Checkpointer(d, progress=False) as ck:
        step = ck.restore(st)
    np.save(out, st["emb"])
    print(json.dumps({"step": step, "parses": parses[0], "calls": calls, "windows": windows[0]}))
""").replace("ROWS", str(ROWS)).replace("DIM", str(DIM))


def _spans(soff: np.ndarray, length: np.ndarray) -> tuple[int, int]:
    """The merged spans of one file's pieces (sorted by offset there: gaps of at most
    MERGE_GAP, at most MERGE_SPAN long) and the buffers they take (a piece, or a gap)."""
    order = np.argsort(soff, kind="stable")
    o, n = soff[order], length[order]
    gap = o[1:] - (o + n)[:-1]
    spans, start = 1, int(o[0])
    for k in range(1, len(o)):
        if gap[k - 1] > MERGE_GAP or gap[k - 1] < 0 or (int(o[k]) - start) // MERGE_SPAN:
            spans, start = spans + 1, int(o[k])
    return spans, len(o) + int((gap > 0).sum())


def test_a_step_spanning_many_older_steps_restores_bit_exact_with_one_parse_and_few_reads(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    with ep.Checkpointer(str(d), incremental=True, progress=False) as ck:
        for s in range(1, STEPS + 1):
            ck.save(s, {"emb": _table(s)})
    src = open_db(str(d / f"local.{STEPS}"))
    try:
        assert isinstance(src, ExtentSource)
        ext, refs = src.ex.ext, src.ex.refs
        assert len(refs) == STEPS - 1 and len(ext) > 1000  # every older step, a thousand extents and more
    finally:
        src.close()
    script = tmp_path / "restore.py"
    script.write_text(RESTORE)
    out = tmp_path / "emb.npy"
    p = subprocess.run([sys.executable, str(script), str(d), str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert info["step"] == STEPS
    assert np.load(out).view(np.uint32).tobytes() == _table(STEPS).view(np.uint32).tobytes()
    assert info["parses"] == 1, info  # the step's extent table, once per restore
    windows = info["windows"]
    for k, r in enumerate(refs, 1):
        sel = ext["source"] == k
        pieces = int(sel.sum())
        spans, bufs = _spans(ext["soff"][sel].astype(np.int64), ext["length"][sel].astype(np.int64))
        got = info["calls"].get(r.file, 0)
        # per window a file's pieces are cut at most once more than its spans over the file,
        # and a span of more than MAX_PIECES_READ buffers is read in that many at a time
        bound = spans + windows + -(-bufs // MAX_PIECES_READ)
        assert 0 < got <= bound, (r.file, got, spans, pieces, windows)
        assert pieces < 50 or got * 10 <= pieces, (r.file, got, pieces)  # not a call per extent


@pytest.mark.unit
def test_short_reads_of_a_span_resume_where_they_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``preadv`` that returns fewer bytes than its buffers hold (a signal) is continued
    from the first buffer it did not fill: the logical bytes read are the same."""
    from epochal.storage.io.extents import reads as extent_reads

    d = tmp_path / "ck"
    with ep.Checkpointer(str(d), incremental=True, progress=False) as ck:
        for s in range(1, 4):
            ck.save(s, {"emb": _table(s)})
    path = str(d / "local.3")

    def whole() -> bytes:
        src = open_db(path)
        try:
            buf = bytearray(src.size())
            for o in range(0, len(buf), 1 << 20):  # windows of 1 MiB
                n = min(1 << 20, len(buf) - o)
                assert src.read_into([memoryview(buf)[o:o + n]], o) == n
            return bytes(buf)
        finally:
            src.close()

    want = whole()
    real, short = extent_reads.preadv_iov, [0]

    def at_most_3000(fd: int, iov: np.ndarray, off: int) -> int:
        cum = np.cumsum(iov[:, 1].astype(np.int64))
        if cum[-1] <= 3000:
            return real(fd, iov, off)
        k = int(np.searchsorted(cum, 3000))  # the rows that hold the first 3000 bytes
        part = iov[: k + 1].copy()
        if cum[k] > 3000:
            part[-1, 1] -= np.uint64(cum[k] - 3000)
            short[0] += 1
        return real(fd, part, off)

    monkeypatch.setattr(extent_reads, "preadv_iov", at_most_3000)
    assert whole() == want
    assert short[0] > 10  # the short reads happened
