"""Incremental saves: a step writes only the bytes the newest committed step before it lacks.

Values and bits restored in fresh processes, bytes written measured by file sizes, references
to missing or damaged files named with both steps, retention that keeps referenced files,
SIGKILLs during incremental saves and retention, and a URL where a reference costs no upload."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _fresh import restore_script

import epochal as ep
from epochal.storage.formats.native.incremental import CHUNK_BYTES

ROWS, DIM = 8192, 256  # an 8 MiB float32 embedding table, 1 KiB rows

pytestmark = pytest.mark.unit


def _state(step: int) -> dict[str, Any]:
    """A LoRA-like state: a frozen 16 MiB base, a small adapter, and an embedding table of
    which 2% of the rows (fixed by the step) changed at each step."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal(4 << 20).astype(np.float32)
    emb = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    for s in range(1, step + 1):
        rows = np.random.default_rng(s).choice(ROWS, ROWS // 50, replace=False)
        emb[rows] += np.float32(s)
    adapter = np.full((64, 64), step, dtype=np.float32)
    return {"base": base, "emb": emb, "adapter": adapter, "step": step}


def _save_steps(d: Path, steps: range, **kw: Any) -> None:
    with ep.Checkpointer(str(d), incremental=True, progress=False, **kw) as ck:
        for s in steps:
            ck.save(s, _state(s))


RESTORE = textwrap.dedent("""
    import sys, json, numpy as np, epochal as ep
    d, step = sys.argv[1], int(sys.argv[2])
    st = {"base": np.zeros(4 << 20, np.float32), "emb": np.zeros((ROWS, DIM), np.float32),
          "adapter": np.zeros((64, 64), np.float32), "step": -1}
    try:
        with ep.Checkpointer(d, progress=False) as ck:
            got = ck.restore(st, step=step)
    except ep.CheckpointCorruptError as e:
        print(json.dumps({"error": str(e), "untouched": bool(not st["base"].any() and not st["emb"].any())}))
        sys.exit(3)
    np.save(sys.argv[3], np.concatenate([st["base"], st["emb"].ravel(), st["adapter"].ravel()]))
    print(json.dumps({"step": got, "saved_step": st["step"]}))
""").replace("ROWS", str(ROWS)).replace("DIM", str(DIM))


def _restore_fresh(d: Path, step: int, tmp: Path) -> tuple[int, dict[str, Any], np.ndarray | None]:
    return restore_script(RESTORE, tmp, d, step)


def _flat(s: dict[str, Any]) -> np.ndarray:
    return np.concatenate([s["base"], s["emb"].ravel(), s["adapter"].ravel()])


@pytest.mark.system
def test_frozen_base_and_changed_rows_write_only_what_changed_and_restore_bit_exact(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    _save_steps(d, range(1, 5))
    full = os.path.getsize(d / "local.1")
    assert full >= (16 << 20) + (8 << 20)
    changed = (ROWS // 50) * DIM * 4 + 64 * 64 * 4  # rows changed per step + the adapter
    for s in (2, 3, 4):
        size = os.path.getsize(d / f"local.{s}")
        # the frozen base costs nothing; the table's 2% of rows cost about their bytes
        assert size <= 1.5 * changed + 16384, (s, size, changed)
    for s in (1, 4):
        rc, info, flat = _restore_fresh(d, s, tmp_path)
        assert rc == 0 and info == {"step": s, "saved_step": s}
        assert flat is not None and flat.view(np.uint32).tobytes() == _flat(_state(s)).view(np.uint32).tobytes()
    v = subprocess.run([sys.executable, "-m", "epochal", "verify", str(d)], capture_output=True, text=True)
    assert v.returncode == 0 and "local.4" in v.stdout, v.stdout + v.stderr


@pytest.mark.system
def test_a_missing_referenced_file_names_both_steps_before_any_live_byte(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    _save_steps(d, range(1, 3))
    os.unlink(d / "local.1")
    rc, info, _ = _restore_fresh(d, 2, tmp_path)
    assert rc == 3 and info["untouched"], info
    assert "step 1" in info["error"] and "local.1" in info["error"] and "step 2" in info["error"]
    assert "missing" in info["error"]


@pytest.mark.system
def test_damaged_referenced_bytes_are_found_by_restore_and_verify(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    _save_steps(d, range(1, 3))
    with open(d / "local.1", "r+b") as f:  # a byte of the frozen base, which step 2 references
        f.seek(64 + (8 << 20))
        b = f.read(1)
        f.seek(64 + (8 << 20))
        f.write(bytes([b[0] ^ 0x40]))
    rc, info, _ = _restore_fresh(d, 2, tmp_path)
    assert rc == 3 and info["untouched"], info
    assert "local.1" in info["error"] and "step 1" in info["error"] and "damaged" in info["error"]
    v = subprocess.run([sys.executable, "-m", "epochal", "verify", str(d / "local.2")], capture_output=True, text=True)
    assert v.returncode != 0 and "local.1" in v.stdout + v.stderr


def test_retention_keeps_a_file_while_a_kept_step_references_it(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    _save_steps(d, range(1, 4), keep_last=1)
    assert sorted(p.name for p in (d / ".epochal").glob("manifest.*.json")) == ["manifest.3.json"]
    assert (d / "local.1").exists()  # the frozen base lives there and step 3 uses it
    with ep.Checkpointer(str(d), incremental=True, keep_last=1, progress=False) as ck:
        ck.restore({"step": 0})
        new = {k: (v + 1 if isinstance(v, np.ndarray) else v) for k, v in _state(3).items()}
        ck.save(4, new)  # every byte changed: nothing older is referenced any more
        ck.save(5, new)  # the next retention pass removes the unreferenced files
    assert not (d / "local.1").exists() and not (d / "local.2").exists()
    with ep.Checkpointer(str(d), progress=False) as ck:
        st = {k: np.zeros_like(v) if isinstance(v, np.ndarray) else v for k, v in new.items()}
        assert ck.restore(st) == 5
        assert all(np.array_equal(st[k], new[k]) for k in ("base", "emb", "adapter"))


def test_a_later_full_run_keeps_the_files_its_kept_incremental_steps_reference(tmp_path: Path) -> None:
    """The location is marked incremental by its first incremental save; a later run without
    ``incremental=True`` still keeps what a kept incremental step references, while one that
    never saved incrementally reads no db at retention (tests/test_commit_cost.py)."""
    d = tmp_path / "ck"
    _save_steps(d, range(1, 4))
    assert (d / ".epochal" / "incremental").exists()
    with ep.Checkpointer(str(d), keep_last=2, progress=False) as ck:
        ck.restore({"step": 0})
        ck.save(4, _state(4))  # a full save: steps 3 (incremental, on local.1's base) and 4 kept
    assert sorted(p.name for p in (d / ".epochal").glob("manifest.*.json")) == ["manifest.3.json",
                                                                                "manifest.4.json"]
    assert (d / "local.1").exists()
    rc, info, flat = _restore_fresh(d, 3, tmp_path)
    assert rc == 0 and flat is not None and flat.tobytes() == _flat(_state(3)).tobytes()


def test_inspect_and_export_read_an_incremental_step(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    _save_steps(d, range(1, 3))
    p = subprocess.run([sys.executable, "-m", "epochal", "inspect", str(d / "local.2")], capture_output=True, text=True)
    assert p.returncode == 0 and "emb" in p.stdout and "8192" in p.stdout, p.stdout + p.stderr
    from epochal.storage.formats.native.backend import NativeBackend

    got = NativeBackend().read(str(d / "local.2"), ["emb"])
    assert np.array_equal(got["emb"], _state(2)["emb"])


def test_async_incremental_saves_restore_bit_exact(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    _save_steps(d, range(1, 4), async_save=True)
    assert os.path.getsize(d / "local.3") < CHUNK_BYTES
    with ep.Checkpointer(str(d), progress=False) as ck:
        st = {k: np.zeros_like(v) if isinstance(v, np.ndarray) else v for k, v in _state(3).items()}
        assert ck.restore(st) == 3
    assert _flat(st).tobytes() == _flat(_state(3)).tobytes()


KILLED = textwrap.dedent("""
    import sys, numpy as np, epochal as ep
    sys.path.insert(0, sys.argv[2])
    from test_incremental import _state
    with ep.Checkpointer(sys.argv[1], incremental=True, keep_last=2, progress=False) as ck:
        start = (ck.restore({"step": 0}) or 0) + 1
        for s in range(start, 40):
            ck.save(s, _state(s))
            print(s, flush=True)
""")


@pytest.mark.system
@pytest.mark.skipif(sys.platform == "win32", reason="needs SIGKILL")
def test_sigkill_during_incremental_saves_and_retention_leaves_every_committed_step_loadable(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    here = os.path.dirname(os.path.abspath(__file__))
    rnd = random.Random(7)
    for _ in range(6):
        p = subprocess.Popen([sys.executable, str(script), str(d), here], stdout=subprocess.PIPE, text=True)
        time.sleep(rnd.uniform(0.8, 2.5))
        p.send_signal(signal.SIGKILL)
        p.wait()
        committed = sorted(int(m.name.split(".")[1]) for m in (d / ".epochal").glob("manifest.*.json"))
        for s in committed:
            with ep.Checkpointer(str(d), progress=False) as ck:
                st = {k: np.zeros_like(v) if isinstance(v, np.ndarray) else v for k, v in _state(s).items()}
                assert ck.restore(st, step=s) == s
            assert _flat(st).tobytes() == _flat(_state(s)).tobytes(), s
    assert committed and committed[-1] >= 3


@pytest.mark.system
def test_incremental_and_compressed_steps_restore_bit_exact(tmp_path: Path) -> None:
    """Both byte savers at once: compressed dbs (deterministic frames) still share the frozen
    base's bytes with the step before, and every step restores bit for bit."""
    pytest.importorskip("zstandard")
    d = tmp_path / "ck"
    _save_steps(d, range(1, 4), compression="zstd")
    first = os.path.getsize(d / "local.1")
    assert first < (16 << 20) + (8 << 20)  # compressed: smaller than the raw state
    for s in (2, 3):
        # the frozen base (2/3 of the bytes) is a reference; the table's changed rows touch
        # every 4 MiB frame of it, and a compressed frame with a change is stored whole
        assert os.path.getsize(d / f"local.{s}") < first / 2, s
    for s in (1, 3):
        rc, info, flat = _restore_fresh(d, s, tmp_path)
        assert rc == 0 and info == {"step": s, "saved_step": s}
        assert flat is not None and flat.view(np.uint32).tobytes() == _flat(_state(s)).view(np.uint32).tobytes()


@pytest.mark.system
def test_a_compressed_incremental_save_compresses_each_segment_as_it_streams(tmp_path: Path, monkeypatch) -> None:
    """With compression, a segment is compressed when the write reaches it (its chunks are
    known only then), not all first: each compression follows the extents written for the
    segment before it; the logical file is byte for byte write_native's of the same blobs."""
    pytest.importorskip("zstandard")
    from epochal.storage.encoding.compress import WriteOptions, write_options
    from epochal.storage.formats.native import write as native_write
    from epochal.storage.formats.native.incremental import write_incremental
    from epochal.storage.formats.native.write import write_native
    from epochal.storage.io.extents import open_db
    from epochal.storage.io.extents.sink import ExtentSink

    events: list[str] = []
    real_compress, real_add = native_write.compress_segment, ExtentSink.add_chunks
    monkeypatch.setattr(native_write, "compress_segment", lambda *a, **k: events.append("compress") or real_compress(*a, **k))
    monkeypatch.setattr(ExtentSink, "add_chunks", lambda self, c: events.append("chunks") or real_add(self, c))
    blobs = [_state(s) for s in (1, 2)]
    blobs[1]["ints"] = np.arange(1 << 20, dtype=np.int64)  # (8 MiB more, after the floats)
    with write_options(WriteOptions(compression="zstd")):
        write_incremental(tmp_path / "local.1", blobs[0], step=1)
        events.clear()
        write_incremental(tmp_path / "local.2", blobs[1], base=str(tmp_path / "local.1"), step=2)
        n = len(events)
        write_native(tmp_path / "full.2", blobs[1])
    # each segment of 64 KiB or more (base, emb, ints) chunked right after it is compressed
    # (the 16 KiB adapter is compressed and stored whole)
    got = events[:n]
    assert got.count("chunks") == 3 and all(got[i - 1] == "compress" for i, e in enumerate(got) if e == "chunks"), got
    src = open_db(str(tmp_path / "local.2"))
    try:
        logical = src.read(src.size(), 0)
    finally:
        src.close()
    assert logical == (tmp_path / "full.2").read_bytes()
    assert os.path.getsize(tmp_path / "local.2") < os.path.getsize(tmp_path / "full.2") / 2  # the base referenced
    v = subprocess.run([sys.executable, "-m", "epochal", "verify", str(tmp_path / "local.2")], capture_output=True,
                       text=True, timeout=120)
    assert v.returncode == 0, v.stdout + v.stderr


def test_the_format_docs_numpy_reader_rebuilds_an_incremental_db(tmp_path: Path) -> None:
    """docs/format.md's plain-numpy reader of an extent file, run as printed: the logical
    bytes it rebuilds are those every reader sees, a native db holding step 3's values."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()
    block = next(b for b in doc.split("```python")[1:] if "def logical_bytes" in b).split("```")[0]
    scope: dict[str, Any] = {}
    exec(compile(block, "format.md", "exec"), scope)
    d = tmp_path / "ck"
    _save_steps(d, range(1, 4))
    from epochal.storage.io.extents import open_db

    src = open_db(str(d / "local.3"))
    try:
        want = src.read(src.size(), 0)
    finally:
        src.close()
    got = scope["logical_bytes"](str(d / "local.3"))
    assert got == want and os.path.getsize(d / "local.3") < len(got) // 4
    (tmp_path / "plain.db").write_bytes(got)
    from epochal.storage.formats.native.backend import NativeBackend

    assert np.array_equal(NativeBackend().read(str(tmp_path / "plain.db"), ["emb"])["emb"], _state(3)["emb"])
