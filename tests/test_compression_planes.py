"""Byte planes that do not compress: stored as zstd frames of raw blocks (no zstd pass),
chosen from a sample compressed piece by piece; bit-exact round trips through epochal and
the documented numpy reader; a blob whose planes gain nothing stays raw."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import zstandard
from _format_doc import documented_read_native

from epochal.storage.encoding import compress
from epochal.storage.encoding.compress import WriteOptions
from epochal.storage.formats.native import NativeFile, stat_native, write_native

FRAME = 64 << 10


@pytest.fixture(autouse=True)
def _small_frames(monkeypatch):
    monkeypatch.setattr(compress, "FRAME_BYTES", FRAME)
    monkeypatch.setattr(compress, "PLANE_SAMPLE_MIN", 4 * FRAME, raising=False)
    monkeypatch.setattr(compress, "PLANE_SAMPLE_BYTES", 4 << 10, raising=False)


class _Counting:
    """Wraps the zstd compressors: the bytes each ``compress`` call was given."""

    def __init__(self, monkeypatch):
        self.sizes: list[int] = []
        real = compress._compressor

        def wrapped(level):
            c = real(level)
            sizes = self.sizes

            class C:
                def compress(self, data):
                    sizes.append(memoryview(data).nbytes)
                    return c.compress(data)

            return C()

        monkeypatch.setattr(compress, "_compressor", wrapped)


@pytest.mark.unit
@pytest.mark.parametrize("n", [1, 5, 131_071, 131_072, 131_073, 3 * 131_072, 1_000_003])
def test_a_raw_frame_is_a_zstd_frame_of_its_bytes(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    f = compress.raw_frame(data)
    blocks = -(-n // (128 << 10))
    assert len(f) == n + 9 + 3 * blocks  # header, then a 3-byte header per 128 KiB block
    assert f[:4] == b"\x28\xb5\x2f\xfd" and int.from_bytes(f[5:9], "little") == n
    assert zstandard.ZstdDecompressor().decompress(f, max_output_size=n) == data.tobytes()
    assert zstandard.ZstdDecompressor().decompress(f) == data.tobytes()  # its content size


def _planes_of(path, name):
    """(stored streams of ``name``'s one compressed segment, its planes)."""
    with NativeFile(str(path), mmap=False) as f:
        idx = f._index
        table = idx.coded
        row = next(r for r, k in enumerate(table.coded["seg"].tolist()) if idx.name(idx.blob_of_segment(k)) == name)
        k = int(table.coded["seg"][row])
        start, stop, lengths, _ = table.stream_range(row, 0, table.frame_count(row))
        off = int(idx.segs["offset"][k])
        _, planes, _, _ = table.layout(row)
    raw = Path(path).read_bytes()[off + start:off + stop]
    out, at = [], 0
    for n in lengths:
        out.append(raw[at:at + n])
        at += n
    return out, planes


@pytest.mark.unit
@pytest.mark.parametrize("dtype,raw_planes", [(np.float16, 1), (np.float32, 3)])
def test_planes_that_do_not_compress_skip_zstd_and_round_trip(tmp_path, monkeypatch, dtype, raw_planes):
    rng = np.random.default_rng(7)
    w = (rng.standard_normal(10 * FRAME // np.dtype(dtype).itemsize + 3) * 0.02).astype(dtype)  # 11 frames
    counting = _Counting(monkeypatch)
    path = tmp_path / "p.db"
    write_native(str(path), {"w": w}, options=WriteOptions("zstd"))
    width = np.dtype(dtype).itemsize
    nframes = -(-w.nbytes // FRAME)
    full = [s for s in counting.sizes if s >= FRAME // width - 8]
    assert len(full) == (w.nbytes // FRAME) * (width - raw_planes)  # only the compressible planes saw zstd
    streams, planes = _planes_of(path, "w")
    assert planes == width and len(streams) == nframes * width
    words = w.view({2: np.uint16, 4: np.uint32}[width])
    rot = (words << 1) | (words >> (8 * width - 1))
    for fr in range(nframes - 1):  # (the last frame holds 3 values)
        chunk = rot[fr * FRAME // width:(fr + 1) * FRAME // width]
        for j in range(raw_planes):  # the low planes: exactly a raw frame of their bytes
            plane = ((chunk >> (8 * j)) & 0xFF).astype(np.uint8)
            assert streams[fr * width + j] == compress.raw_frame(plane)
        assert len(streams[fr * width + width - 1]) < 0.9 * len(chunk)  # the exponent plane compressed
    with NativeFile(str(path), mmap=False) as f:
        got = f.read()["w"]
        f.verify()
    assert got.dtype == w.dtype and got.tobytes() == w.tobytes()


@pytest.mark.unit
def test_a_plane_that_compresses_in_part_of_a_segment_is_compressed(tmp_path):
    rng = np.random.default_rng(8)
    noisy = (rng.standard_normal(60_000) * 0.02).astype(np.float32)
    rounded = noisy.copy()
    rounded.view(np.uint32)[:] &= 0xFFFFFF00  # 8 low mantissa bits zero: its low plane compresses
    # two tensors back to back, like an optimizer's two moments: plane 0 compresses in one half
    data = np.concatenate([noisy, rounded, noisy, rounded]).view(np.uint8)
    raw = compress._raw_planes(data, 4)
    assert raw == [False, True, True, False]
    whole = compress._raw_planes(noisy.view(np.uint8), 4)
    assert whole == [True, True, True, False]


@pytest.mark.unit
def test_random_floats_are_stored_raw_and_no_larger(tmp_path, monkeypatch):
    bits = np.random.default_rng(9).integers(0, 2**32, 300_000, dtype=np.uint32).view(np.float32)
    counting = _Counting(monkeypatch)
    sizes = {}
    for mode in (None, "zstd"):
        path = tmp_path / f"{mode}.db"
        write_native(str(path), {"noise": bits}, options=WriteOptions(mode))
        sizes[mode] = stat_native(str(path)).data_bytes
        with NativeFile(str(path), mmap=False) as f:
            assert f._index.coded is None or not len(f._index.coded.coded)  # stored raw
            assert f.read()["noise"].tobytes() == bits.tobytes()
    assert sizes["zstd"] == sizes[None] == bits.nbytes
    # every plane of the sample stayed over the bar; the frames went through zstd at most for the
    # exponent plane (random exponents), never for the three low planes
    assert sum(s >= FRAME // 4 - 8 for s in counting.sizes) <= -(-bits.nbytes // FRAME)


@pytest.mark.unit
def test_the_documented_numpy_reader_decodes_raw_planes(tmp_path):
    read_native = documented_read_native()  # the documented reader, as printed
    rng = np.random.default_rng(10)
    blobs = {"w32": (rng.standard_normal(6 * FRAME // 4) * 0.02).astype(np.float32),
             "w16": (rng.standard_normal(6 * FRAME // 2 + 1) * 0.02).astype(np.float16)}
    path = str(tmp_path / "c.db")
    write_native(path, blobs, options=WriteOptions("zstd"))
    for name in blobs:
        streams, _ = _planes_of(path, name)
        assert streams[0][4] == 0xA0  # a raw frame (single segment, 4-byte content size)
    got = read_native(path)
    for k, v in blobs.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k


@pytest.mark.unit
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("mapped", [False, True])
def test_a_segment_is_its_streams_one_after_the_other_on_any_threads(threads, mapped, monkeypatch):
    """The stored bytes of a segment (several frames, the last one short; the low plane raw)
    are its streams in order, each with its length and checksum; several threads encoding
    runs of frames store the same bytes as one; they decode to the same bits. ``mapped``:
    in the anonymous map a large segment's bytes are written to."""
    from epochal.storage.encoding import planes
    from epochal.storage.io.checksum import checksum_function, default_algorithm

    if mapped:
        monkeypatch.setattr(planes, "_MAP_MIN", 0)

    fn = checksum_function(default_algorithm())
    rng = np.random.default_rng(threads)
    words = (rng.normal(0, 0.02, 9 * FRAME // 4 + 3).astype(np.float32).view(np.uint32) >> 16).astype("<u2")
    view = memoryview(words.view(np.uint8))
    c = compress.compress_segment(view, 2, WriteOptions("zstd", threads=threads), fn)
    one = compress.compress_segment(view, 2, WriteOptions("zstd", threads=1), fn)
    assert c is not None and one is not None
    root = c.data.obj
    while isinstance(root, (np.ndarray, memoryview)):
        root = root.base if isinstance(root, np.ndarray) else root.obj
    assert isinstance(root, mmap.mmap) == mapped
    assert bytes(c.data) == bytes(one.data) and c.lengths == one.lengths and c.crcs == one.crcs
    streams = c.streams
    assert len(streams) == 2 * 5 and [len(s) for s in streams] == c.lengths
    assert b"".join(streams) == bytes(c.data) and c.nbytes == sum(c.lengths)
    assert c.crcs == [fn(s, 0) for s in streams]
    rotated = (words << 1) | (words >> 15)
    for fr in range(5):
        low = rotated[fr * FRAME // 2:(fr + 1) * FRAME // 2].astype(np.uint8)
        assert bytes(streams[2 * fr]) == bytes(compress.raw_frame(low))  # written from the words
    out = memoryview(bytearray(view.nbytes))
    compress.decode_frames(c.codec, c.planes, c.frame_bytes, c.logical, 0, streams, out, threads)
    assert bytes(out) == view.tobytes()
