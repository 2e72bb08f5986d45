"""The output buffers of compressed segments are given back once their file is written and
reused by the next save: a save in a loop compresses into memory it touched before. Reused
buffers hold the previous save's bytes; every file still holds exactly its own."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from epochal import knobs
from epochal.storage.encoding import compress, planes
from epochal.storage.encoding.compress import WriteOptions
from epochal.storage.encoding.planes import SPARES, SpareBuffers
from epochal.storage.formats.native import NativeFile, write_native

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _empty_spares():
    SPARES.clear()
    yield
    SPARES.clear()


def _state(seed: int, mib: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.02, mib * MIB // 2).astype(np.float32)
    bf16 = (w.view(np.uint32) >> 16).astype("<u2").view(np.float16)  # (bf16 bits, any 2-byte float)
    return {"w": bf16, "f32": rng.normal(0, 1, mib * MIB // 8).astype(np.float32),
            "small": np.arange(100, dtype=np.float32)}


def _save(path, state) -> None:
    with compress.write_options(WriteOptions("zstd", threads=1)):
        write_native(str(path), state)


def _read(path) -> dict[str, np.ndarray]:
    with NativeFile(str(path), mmap=False) as f:
        return f.read()


@pytest.mark.unit
def test_a_save_in_a_loop_reuses_its_buffers_and_every_file_holds_its_own_bytes(tmp_path):
    states = [_state(s) for s in range(4)]
    fresh0 = SPARES.fresh
    _save(tmp_path / "0.db", states[0])
    made = SPARES.fresh - fresh0
    assert made == 2  # the two big blobs' outputs (the small one is stored raw)
    assert SPARES.kept_bytes > 2 * MIB
    reused0 = SPARES.reused
    for i in (1, 2, 3):
        _save(tmp_path / f"{i}.db", states[i])
    assert SPARES.fresh - fresh0 == made  # nothing fresh after the first save
    assert SPARES.reused - reused0 == 3 * made
    with NativeFile(str(tmp_path / "3.db"), mmap=False) as f:
        assert f.stat().format_version.startswith("3.")  # compressed
    for i, state in enumerate(states):  # each file its own bits, none of an older save's
        got = _read(tmp_path / f"{i}.db")
        assert sorted(got) == sorted(state)
        for k, v in state.items():
            assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), (i, k)


@pytest.mark.unit
def test_a_smaller_output_in_a_bigger_reused_buffer_stores_only_its_bytes(tmp_path):
    """The second save's segment compresses to fewer bytes than the buffer it reuses, which
    still holds the first save's: the file's stored bytes are the second's alone."""
    noisy = np.random.default_rng(1).integers(0, 1 << 16, 2 * MIB, dtype=np.uint64).astype("<u2").view(np.float16)
    zeros = np.zeros_like(noisy)
    noisy[::2] = 0  # compresses somewhat: stored compressed
    _save(tmp_path / "a.db", {"x": noisy})
    reused = SPARES.reused
    _save(tmp_path / "b.db", {"x": zeros})
    assert SPARES.reused == reused + 1
    assert (tmp_path / "b.db").stat().st_size < (tmp_path / "a.db").stat().st_size // 10
    assert _read(tmp_path / "b.db")["x"].tobytes() == zeros.tobytes()
    assert _read(tmp_path / "a.db")["x"].tobytes() == noisy.tobytes()


@pytest.mark.unit
def test_a_failed_write_gives_its_buffers_back_and_the_knob_bounds_what_is_kept(tmp_path, monkeypatch):
    from epochal.storage.io import local

    fresh = SPARES.fresh
    with pytest.raises(FileNotFoundError):
        _save(tmp_path / "missing" / "a.db", _state(0))
    assert SPARES.fresh == fresh  # nothing compressed before the file could be made
    real, calls = local.LocalSink.write, []

    def failing(self, data):
        calls.append(1)
        if len(calls) > 4:  # (after the first segment's pieces)
            raise OSError(28, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(local.LocalSink, "write", failing)
    with pytest.raises(OSError, match="No space"):
        _save(tmp_path / "b.db", _state(0))
    monkeypatch.undo()
    assert not (tmp_path / "b.db").exists()
    assert SPARES.kept_bytes > 2 * MIB  # the segment compressed before the failure: given back
    SPARES.clear()
    with knobs.override(spare_bytes=0):
        _save(tmp_path / "a.db", _state(0))
        assert SPARES.kept_bytes == 0
        fresh = SPARES.fresh
        _save(tmp_path / "b.db", _state(1))
        assert SPARES.fresh == fresh + 2
    with knobs.override(spare_bytes=5 * MIB // 2):  # room for the bigger one only
        _save(tmp_path / "c.db", _state(2))
        assert 0 < SPARES.kept_bytes <= 5 * MIB // 2
    assert _read(tmp_path / "c.db")["w"].tobytes() == _state(2)["w"].tobytes()


@pytest.mark.unit
def test_a_spare_serves_sizes_up_to_a_quarter_below_it_and_the_oldest_goes_first():
    pool = SpareBuffers()
    a, b = pool.take(4 * MIB), pool.take(8 * MIB)
    assert (len(a), len(b), pool.fresh) == (4 * MIB, 8 * MIB, 2)
    pool.give_back([a, b])
    assert pool.take(7 * MIB) is b  # 8 MiB holds 7 and is at most 1.25x it
    assert pool.take(3 * MIB) is not a  # 4 MiB is more than 1.25x 3 MiB: fresh
    assert pool.take(4 * MIB) is a and pool.kept_bytes == 0
    with knobs.override(spare_bytes=10 * MIB):
        pool.give_back([a, b])
        c = pool.take(2 * MIB)
        pool.give_back([c])  # over 10 MiB: a (the oldest) is dropped
        assert pool.kept_bytes == 10 * MIB and pool.take(4 * MIB) is not a
    small = pool.take(planes.SPARE_MIN - 1)
    pool.give_back([small])
    assert pool.take(planes.SPARE_MIN - 1) is not small  # small ones are malloc's


@pytest.mark.system
def test_a_file_written_from_reused_buffers_loads_bit_exact_in_a_fresh_process(tmp_path):
    for i in range(3):
        _save(tmp_path / f"{i}.db", _state(10 + i))
    assert SPARES.reused >= 4
    code = (
        "import hashlib, sys\n"
        "from epochal.storage.formats.native import NativeFile\n"
        "for i in range(3):\n"
        "    with NativeFile(sys.argv[1] + f'/{i}.db') as f: got = f.read()\n"
        "    for k in sorted(got): print(i, k, got[k].dtype, hashlib.sha256(got[k].tobytes()).hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    want = []
    for i in range(3):
        for k in sorted(_state(10 + i)):
            v = _state(10 + i)[k]
            want.append(f"{i} {k} {v.dtype} {hashlib.sha256(v.tobytes()).hexdigest()}")
    assert out.stdout.split("\n")[:-1] == want


def _mixed() -> dict[str, object]:
    rng = np.random.default_rng(9)
    out: dict[str, object] = {f"small{i}": rng.normal(0, 1, 300).astype(np.float32) for i in range(80)}  # grouped
    for i in range(3):
        out[f"w{i}"] = _state(i, 2)["w"]  # compressed
    out["noise"] = rng.integers(0, 256, 3 * MIB, dtype=np.uint8)  # stored raw: does not compress
    out["mid"] = rng.normal(0, 0.02, 5000).astype(np.float32)  # 20 KB: compressed, in no group
    out["step"] = 7
    return out


@pytest.mark.unit
def test_a_file_compressed_segment_by_segment_is_the_file_compressed_all_first(tmp_path):
    """write_native compresses each segment as the write reaches it; the file is byte for
    byte the one laid out after compressing every segment first (offsets, paddings, index,
    groups, superblock), and reads back bit-exact."""
    from epochal.storage.formats.native import write, writer
    from epochal.storage.io.checksum import checksum_function, default_algorithm

    blobs = _mixed()
    options = WriteOptions("zstd", threads=1)
    with compress.write_options(options):
        write_native(str(tmp_path / "streamed.db"), blobs)
    fn = checksum_function(default_algorithm())
    plan = writer.plan_file(blobs, options, fn)  # (every segment compressed first)
    assert not plan.lazy and len(plan.coded) == 4 and len(plan.groups) >= 1
    write._write_planned(str(tmp_path / "planned.db"), plan, default_algorithm(), fn)
    a, b = (tmp_path / "streamed.db").read_bytes(), (tmp_path / "planned.db").read_bytes()
    assert len(a) == len(b) and a == b
    got = _read(tmp_path / "streamed.db")
    for k, v in blobs.items():
        assert (got[k] == v) if k == "step" else got[k].tobytes() == v.tobytes(), k


@pytest.mark.unit
def test_a_compressed_save_holds_a_few_segments_compressed_bytes_not_all_of_them(tmp_path):
    """Twelve segments of 2 MiB: each one's compressed bytes are given back once written (and
    checksummed), so the save takes at most a few buffers at a time, reusing them."""
    held, most = [0], [0]
    take, give = SPARES.take, SPARES.give_back

    def counted_take(n):
        held[0] += 1
        most[0] = max(most[0], held[0])
        return take(n)

    def counted_give(bufs):
        held[0] -= len(bufs)
        give(bufs)

    blobs = {f"w{i}": _state(20 + i, 2)["w"][: MIB] for i in range(12)}
    SPARES.take, SPARES.give_back = counted_take, counted_give  # type: ignore[method-assign]
    try:
        fresh = SPARES.fresh
        _save(tmp_path / "a.db", blobs)
    finally:
        del SPARES.take, SPARES.give_back
    assert held[0] == 0 and most[0] <= 4, most  # (the checksum thread gives each back)
    assert SPARES.fresh - fresh <= 4
    got = _read(tmp_path / "a.db")
    assert all(got[k].tobytes() == v.tobytes() for k, v in blobs.items())
