"""Lossless compression of native dbs (format 3.0): bit-exact round trips of every float
dtype and its special values, ranged reads that decode only their frames, ``"auto"`` leaving
incompressible blobs raw, damage refused before any live byte changes, files of earlier
versions still read, and compression on the background writer of an async save."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from _format_doc import documented_read_native

from epochal import Checkpointer
from epochal.errors import CheckpointCorruptError
from epochal.storage.encoding import compress
from epochal.storage.encoding.compress import WriteOptions
from epochal.storage.formats.native import NativeFile, stat_native, write_native
from epochal.storage.formats.native import write as native_write
from epochal.storage.formats.native import writer as native_writer
from epochal.storage.formats.native.reads import coded as coded_path

DATA = Path(__file__).resolve().parent / "data"
FRAME = 64 << 10  # small frames, so that a few hundred KiB hold many


@pytest.fixture(autouse=True)
def _small_frames(monkeypatch):
    monkeypatch.setattr(compress, "FRAME_BYTES", FRAME)


def _coded_segments(path) -> dict[str, int]:
    """Blob name -> its compressed segments' logical bytes, from the file's index."""
    with NativeFile(path, mmap=False) as f:
        idx = f._index
        if idx.coded is None:
            return {}
        out: dict[str, int] = {}
        for r, k in enumerate(idx.coded.coded["seg"].tolist()):
            name = idx.name(idx.blob_of_segment(k))
            out[name] = out.get(name, 0) + idx.coded.logical(r)
        return out


def _specials(dtype: torch.dtype, n: int) -> torch.Tensor:
    """``n`` values of ``dtype``: N(0, 0.02) (so the blob compresses), then every special
    value (NaN with payloads, both zeros, infinities, subnormals) and random bit patterns."""
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 0.02).to(dtype)
    bits = t.view(torch.uint8 if dtype.itemsize == 1 else {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize])
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")], dtype=torch.float64).to(dtype)
    t[: len(special)] = special
    if dtype.is_floating_point and dtype.itemsize > 1:
        info = torch.finfo(dtype)
        t[5] = info.tiny / 4  # subnormal
        t[6] = -info.tiny / 8
        bits[7] = (1 << (dtype.itemsize * 8 - 1)) - 1  # a positive NaN, every payload bit set
        bits[8] = -1  # a negative NaN, every bit set
        bits[9] = (1 << (dtype.itemsize * 8 - 1)) - 2  # another payload
    rnd = torch.randint(-128, 127, (n * dtype.itemsize // 16,), dtype=torch.int8, generator=g)
    t.view(torch.int8)[-len(rnd):] = rnd  # the tail: arbitrary bit patterns
    return t


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["zstd", "auto"])
def test_round_trip_is_bit_exact_for_every_float_dtype(tmp_path, dtype, mode):
    n = 3 * FRAME // dtype.itemsize + 7  # not a multiple of the frame (nor of 8 bytes)
    t = _specials(dtype, n)
    arr = (torch.randn(5 * FRAME // 4 + 3) * 0.02).numpy()  # a numpy fp32 blob too
    path = str(tmp_path / "c.db")
    write_native(path, {"t": t, "a": arr, "tree": {"w": t[:1001].clone(), "step": 3}},
                 options=WriteOptions(mode))
    coded = _coded_segments(path)
    assert coded["t"] == t.numel() * t.element_size() and coded["a"] == arr.nbytes  # both compressed
    assert stat_native(path).format_version == "3.0"
    with NativeFile(path, mmap=False) as f:
        got = f.read()
        f.verify()
    raw = lambda x: x.contiguous().view(torch.uint8)  # noqa: E731
    assert got["t"].dtype == dtype and torch.equal(raw(got["t"]), raw(t))
    assert got["a"].tobytes() == arr.tobytes() and got["a"].dtype == arr.dtype
    assert torch.equal(raw(got["tree"]["w"]), raw(t[:1001])) and got["tree"]["step"] == 3


def test_ranged_read_decodes_only_the_frames_of_its_row(tmp_path):
    rows, cols = 200, 1000  # fp32 rows of 4000 bytes: 800 KB, 13 frames of 64 KiB
    w = (np.random.default_rng(1).standard_normal((rows, cols)) * 0.02).astype(np.float32)
    other = (np.random.default_rng(2).standard_normal(100_000) * 0.02).astype(np.float32)
    path = str(tmp_path / "r.db")
    write_native(path, {"w": w, "other": other}, options=WriteOptions("zstd"))
    row_bytes = cols * 4
    with NativeFile(path, mmap=False) as f:
        for r in (0, 16, 17, 199):  # row 16 crosses a frame boundary (65536 / 4000 = 16.4)
            lo, hi = r * row_bytes, (r + 1) * row_bytes
            want = hi // FRAME - lo // FRAME + (1 if hi % FRAME else 0)
            before = coded_path.stats.frames
            got = np.frombuffer(f.read_range("w", lo, hi), dtype=np.float32)
            assert coded_path.stats.frames - before == want <= 2
            assert np.array_equal(got, w[r])
        before = coded_path.stats.frames
        assert np.array_equal(f.read(["other"])["other"], other)  # a partial load: its frames only
        assert coded_path.stats.frames - before == -(-other.nbytes // FRAME)


def test_ranged_read_checks_the_streams_it_reads(tmp_path):
    w = (np.random.default_rng(3).standard_normal(200_000) * 0.02).astype(np.float32)
    path = tmp_path / "d.db"
    write_native(str(path), {"w": w}, options=WriteOptions("zstd"))
    with NativeFile(str(path), mmap=False) as f:
        off = int(f._index.segs["offset"][0])
    raw = bytearray(path.read_bytes())
    raw[off + 20] ^= 0x10  # in the first frame's streams
    path.write_bytes(bytes(raw))
    with NativeFile(str(path), mmap=False) as f:
        assert np.array_equal(np.frombuffer(f.read_range("w", 700_000, 700_040), np.float32), w[175_000:175_010])
        with pytest.raises(CheckpointCorruptError, match="checksum") as ei:
            f.read_range("w", 0, 40)
        assert ei.value.blob == "w"


def test_auto_leaves_an_incompressible_blob_raw_and_no_blob_grows(tmp_path):
    rng = np.random.default_rng(4)
    noise = rng.integers(0, 2**32, 300_000, dtype=np.uint32).view(np.float32)  # random bits
    weights = (rng.standard_normal(300_000) * 0.02).astype(np.float32)
    blobs = {"noise": noise, "weights": weights, "small": np.arange(10, dtype=np.float32)}
    sizes = {}
    for mode in (None, "auto", "zstd"):
        path = str(tmp_path / f"{mode}.db")
        write_native(path, blobs, options=WriteOptions(mode))
        sizes[mode] = stat_native(path).data_bytes
        coded = _coded_segments(path)
        assert "noise" not in coded and "small" not in coded  # stored raw
        assert ("weights" in coded) == (mode is not None)
        with NativeFile(path, mmap=False) as f:
            got = f.read()
        assert all(got[k].tobytes() == v.tobytes() for k, v in blobs.items())
    assert sizes["auto"] == sizes["zstd"] < sizes[None] - weights.nbytes // 10


_RESTORE = r"""
import json, sys, torch
from epochal import Checkpointer
from epochal.errors import CheckpointCorruptError
state = {"w": torch.full((300, 1000), 7.0), "b": torch.full((1000,), 7.0)}
out = {}
with Checkpointer(sys.argv[1]) as ckpt:
    out["resumed"] = ckpt.restore(state)  # a resume skips a damaged step (and says why)
    out["untouched_by_resume"] = all(bool((t == 7.0).all()) for t in state.values())
    try:
        ckpt.restore(state, step=1)  # asked for: refused
        out["error"] = None
    except CheckpointCorruptError as e:
        out["error"], out["path"], out["blob"] = str(e), e.path, e.blob
out["untouched"] = all(bool((t == 7.0).all()) for t in state.values())
out["w0"] = state["w"][0, :4].tolist()
print(json.dumps(out))
"""


def _restore_in_child(directory) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-c", _RESTORE, str(directory)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.system
def test_a_flipped_stored_byte_is_refused_before_any_live_byte_changes(tmp_path):
    state = {"w": torch.randn(300, 1000) * 0.02, "b": torch.randn(1000) * 0.02}
    with Checkpointer(tmp_path, compression="zstd") as ckpt:
        ckpt.save(1, state)
    db = Path(ckpt.db_path(1))
    assert _coded_segments(str(db)).get("w") == 300 * 1000 * 4
    good = _restore_in_child(tmp_path)  # first: a sound file restores, bit for bit
    assert good["resumed"] == 1 and good["error"] is None and good["w0"] == state["w"][0, :4].tolist()
    with NativeFile(str(db), mmap=False) as f:
        i = f._index.find("w")
        k = f._index.seg_range(i).start
        off, length = int(f._index.segs["offset"][k]), int(f._index.segs["length"][k])
    raw = bytearray(db.read_bytes())
    raw[off + length // 2] ^= 0x01
    db.write_bytes(bytes(raw))
    got = _restore_in_child(tmp_path)
    assert got["resumed"] is None and got["untouched_by_resume"]
    assert got["error"] and got["blob"] == "w" and got["path"] == str(db) and "checksum" in got["error"]
    assert got["untouched"]


def test_files_of_earlier_versions_still_read():
    # written by the writer before compression existed (1.0 without, 2.0 with checksum groups)
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((64, 33)) * 0.02).astype(np.float32)
    for name, version, count in (("native_v1.db", "1.0", 2), ("native_v2.db", "2.0", 72)):
        path = str(DATA / name)
        assert stat_native(path).format_version == version
        with NativeFile(path, mmap=False) as f:
            f.verify()
            got = f.read()
            assert len(got) == count and got["w"].tobytes() == w.tobytes()
            assert got["name"] == "written before compression"
            assert f.read_range("w", 132, 264) == w[1].tobytes()  # a raw blob's range
            if count > 2:
                assert all(np.array_equal(got[f"many/{i}"], np.full(i + 1, i, np.int16)) for i in range(70))


def test_uncompressed_writes_keep_the_earlier_versions(tmp_path):
    path = str(tmp_path / "n.db")
    write_native(path, {"w": np.zeros(100_000, np.float32)})
    assert stat_native(path).format_version == "1.0"


def test_unknown_compression_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="'zstd', 'auto'"):
        Checkpointer(tmp_path, compression="lz4")


def test_async_save_compresses_on_the_background_writer(tmp_path, monkeypatch):
    threads: list[str] = []
    real = native_writer.compress_segment

    def spy(*args, **kw):
        threads.append(threading.current_thread().name)
        return real(*args, **kw)

    monkeypatch.setattr(native_writer, "compress_segment", spy)  # (segments compressed first)
    monkeypatch.setattr(native_write, "compress_segment", spy)  # (... as the stream reaches them)
    model = torch.nn.Linear(400, 300).to(torch.bfloat16)
    state = {"model": model, "step_weights": torch.randn(200_000) * 0.02}
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(tmp_path, async_save=True, compression="zstd") as ckpt:
        ckpt.save(5, state)
        ckpt.wait()
        db = ckpt.db_path(5)
    assert threads and threading.main_thread().name not in threads
    assert stat_native(db).format_version == "3.0" and "step_weights" in _coded_segments(db)
    live = torch.nn.Linear(400, 300).to(torch.bfloat16)
    back = {"model": live, "step_weights": torch.zeros(200_000)}
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(back) == 5
    assert all(torch.equal(live.state_dict()[k].view(torch.int16), v.view(torch.int16)) for k, v in want.items())
    assert torch.equal(back["step_weights"], state["step_weights"])


def test_the_documented_numpy_reader_decodes_compressed_blobs(tmp_path):
    read_native = documented_read_native()  # the documented reader, as printed
    rng = np.random.default_rng(5)
    blobs = {
        "w16": (rng.standard_normal(3 * FRAME // 2 + 5) * 0.02).astype(np.float16),
        "w32": (rng.standard_normal((300, 77)) * 0.02).astype(np.float32),
        "w64": (rng.standard_normal(20_000) * 0.02),
        "ids": np.arange(50_000, dtype=np.int64),
        "name": "not an array",
    }
    path = str(tmp_path / "c.db")
    write_native(path, blobs, options=WriteOptions("zstd"))
    assert sorted(_coded_segments(path)) == ["ids", "w16", "w32", "w64"]
    got = read_native(path)
    arrays = {k: v for k, v in blobs.items() if isinstance(v, np.ndarray)}
    assert sorted(got) == sorted(arrays)
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes(), k


def test_a_forged_stream_with_matching_checksums_is_refused_naming_the_blob(tmp_path):
    import struct

    from epochal.storage.io.checksum import checksum_function

    w = (np.random.default_rng(6).standard_normal(100_000) * 0.02).astype(np.float32)
    path = tmp_path / "f.db"
    write_native(str(path), {"w": w, "b": np.arange(10)}, options=WriteOptions("zstd"))
    with NativeFile(str(path), mmap=False) as f:
        idx, h = f._index, f.header
        fn = checksum_function(h.algorithm)
        k = idx.seg_range(idx.find("w")).start
        off, length = int(idx.segs["offset"][k]), int(idx.segs["length"][k])
        lengths = idx.coded.streams["length"].tolist()
    raw = bytearray(path.read_bytes())
    raw[off:off + length] = np.random.default_rng(7).integers(0, 256, length, dtype=np.uint8).tobytes()
    ix = bytearray(raw[h.index_offset:])  # every checksum made to match the garbage
    struct.pack_into("<I", ix, 32 + 24 * h.blob_count + 24 * k + 16, fn(raw[off:off + length], 0))
    at, streams_at = off, len(ix) - 8 * len(lengths)
    for s, n in enumerate(lengths):
        struct.pack_into("<I", ix, streams_at + 8 * s + 4, fn(raw[at:at + n], 0))
        at += n
    raw[h.index_offset:] = ix
    struct.pack_into("<I", raw, 56, fn(bytes(ix), 0))
    struct.pack_into("<I", raw, 60, fn(bytes(raw[:60]), 0))
    path.write_bytes(bytes(raw))
    with NativeFile(str(path), mmap=False) as f:
        assert np.array_equal(f.read(["b"])["b"], np.arange(10))  # the index is sound
        for act in (lambda: f.read(["w"]), f.verify, lambda: f.read_range("w", 0, 8)):
            with pytest.raises(CheckpointCorruptError, match="does not decode") as ei:
                act()
            assert ei.value.blob == "w" and ei.value.path == str(path)


@pytest.mark.parametrize("async_save", [False, True])
def test_the_distributed_checkpointer_compresses_each_rank_db(tmp_path, async_save):
    from epochal.integrations.distributed import DistributedCheckpointer

    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 256, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    want = [t.clone() for t in model.state_dict().values()]
    with DistributedCheckpointer(tmp_path, async_save=async_save, compression="zstd") as ck:
        ck.save(3, {"model": model, "opt": opt})
    db = str(tmp_path / "rank0.3")
    assert stat_native(db).format_version == "3.0" and _coded_segments(db)  # (one process, no group)
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)).to(torch.bfloat16)
    with Checkpointer(tmp_path) as ck:
        assert ck.restore({"model": fresh, "opt": torch.optim.AdamW(fresh.parameters(), lr=1e-3)}) == 3
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(fresh.state_dict().values(), want))


def test_a_compressed_jax_checkpoint_restores_through_its_ranged_reader(tmp_path):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import epochal.jax as ej

    w = (np.random.default_rng(8).standard_normal((300, 257)) * 0.02).astype(np.float32)
    tree = {"w": jnp.asarray(w).astype(jnp.bfloat16), "b": (w[0] * 3).copy(), "n": 3}
    with Checkpointer(tmp_path, compression="zstd") as ck:
        ej.save(ck, 2, tree)
        db = ck.db_path(2)
    assert _coded_segments(db)  # stored compressed
    abstract = {"w": jax.ShapeDtypeStruct((300, 257), jnp.bfloat16), "b": np.zeros(257, np.float32), "n": 0}
    got = ej.restore(str(tmp_path), abstract)
    assert np.asarray(got["w"]).view(np.uint16).tobytes() == np.asarray(tree["w"]).view(np.uint16).tobytes()
    assert got["b"].tobytes() == tree["b"].tobytes() and got["n"] == 3
