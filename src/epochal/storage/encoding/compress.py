"""Lossless compression of a blob's segments: byte planes of floats, then zstd, in frames.

A segment is cut into *frames* of at most :data:`FRAME_BYTES` logical bytes; each frame is
encoded on its own, so a ranged read decodes only the frames that hold its bytes. Two codecs
(docs/format.md, "Compressed segments"):

* :data:`CODEC_ZSTD`: each frame is one zstd frame of its bytes (any data);
* :data:`CODEC_PLANES`: a segment of floats of ``w`` bytes (bf16/fp16: 2, fp32: 4, fp64: 8)
  is read as little-endian words of ``w`` bytes, each rotated left by one bit (the sign bit
  moves to bit 0, so the exponent fills the word's top byte: ZipNN's trick), and split into
  ``w`` byte planes (plane ``j`` holds byte ``j`` of every word); each plane of each frame is
  one zstd frame. The exponent plane compresses well, the low mantissa planes hardly: a
  plane whose sample does not shrink is written as a zstd frame of raw blocks
  (:func:`raw_frame`), which any zstd decoder reads, so the format is the same.

Every zstd frame is a *stream*; a frame of codec 2 has ``w`` streams, one of codec 1 one.
Streams are concatenated in order (frame 0's planes 0..w-1, frame 1's, ...).

``compression`` (:class:`WriteOptions`): None stores raw; ``"zstd"`` compresses every
segment of at least :data:`MIN_BYTES`; ``"auto"`` first compresses a sample (three pieces of
:data:`SAMPLE_BYTES`) and stores the segment raw when the sample gains less than
:data:`AUTO_MIN_RATIO`. Either way a segment whose compressed form is not smaller than its
bytes is stored raw, so a file is never larger than without compression (but for the index).
zstd releases the GIL, so frames are compressed and decompressed on a small thread pool
(``threads``); the numpy plane split and merge release it too.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np

from .planes import (
    SPARES,
    _bound,
    _buf,
    _merge,
    _raw_frame_into,
    _raw_size,
    _split,
    _words,
    raw_frame,
)

__all__ = [
    "AUTO_MIN_RATIO", "CODEC_PLANES", "CODEC_ZSTD", "COMPRESSIONS", "FRAME_BYTES", "MIN_BYTES",
    "Compressed", "WRITE_OPTIONS", "WriteOptions", "check_compression", "compress_segment",
    "decode_frames", "numpy_width", "plane_widths", "raw_frame", "write_options",
]

CODEC_ZSTD = 1
CODEC_PLANES = 2
#: the logical bytes of a frame (the last one of a segment may hold fewer); a multiple of 8
FRAME_BYTES = 4 << 20
#: segments shorter than this are stored raw (nothing to gain, one index row to pay)
MIN_BYTES = 4096
#: ``"auto"``: three pieces of this many bytes (start, middle, end) are compressed first
SAMPLE_BYTES = 64 << 10
#: ``"auto"``: a sample that compresses by less than this leaves its segment raw
AUTO_MIN_RATIO = 1.02
COMPRESSIONS = (None, "zstd", "auto")
#: torch dtype names of floats split into byte planes, and their widths
_TORCH_FLOATS = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "complex64": 4, "complex128": 8}


def check_compression(value: Any) -> str | None:
    """``value`` when it is a known compression setting, else ValueError naming the choices."""
    if value not in COMPRESSIONS or not (value is None or isinstance(value, str)):
        raise ValueError(f"compression must be one of None, 'zstd', 'auto'; got {value!r}")
    return value  # type: ignore[no-any-return]


@dataclass(frozen=True)
class WriteOptions:
    """How a native db is written. ``compression``: None (raw), ``"zstd"`` or ``"auto"``
    (see the module doc); ``level``: the zstd level (3: fast, most of the gain);
    ``threads``: how many frames are compressed at once (zstd and numpy release the GIL)."""

    compression: str | None = None
    level: int = 3
    threads: int = 2

    def __post_init__(self) -> None:
        check_compression(self.compression)


#: the write options of the save in progress; a background save's writer thread runs in a
#: copy of the saving thread's context, so it sees the options the save was started with
WRITE_OPTIONS: ContextVar[WriteOptions] = ContextVar("epochal_write_options", default=WriteOptions())  # noqa: B039


@contextmanager
def write_options(options: WriteOptions) -> Iterator[WriteOptions]:
    """Make ``options`` the write options of this context for the ``with`` block."""
    token = WRITE_OPTIONS.set(options)
    try:
        yield options
    finally:
        WRITE_OPTIONS.reset(token)


# ---------------------------------------------------------------- which segments are floats
def plane_widths(kind: str, meta: dict[str, Any], nseg: int) -> list[int]:
    """Per segment of a blob of ``kind`` and ``meta``: the float width to split into byte
    planes (2, 4 or 8), or 0 (compressed as bytes). Unknown kinds are bytes."""
    out = [0] * nseg
    if nseg == 1 and kind == "ndarray":
        out[0] = numpy_width(meta.get("dtype"))
    elif (nseg == 1 and kind == "torch.tensor") or kind == "torch.chunked_tensor":  # chunks: each segment
        out = [_TORCH_FLOATS.get(str(meta.get("dtype")), 0)] * nseg
    elif kind == "tree" and isinstance(meta.get("leaves"), list):
        at = 0
        for leaf in meta["leaves"]:
            if not (isinstance(leaf, list) and len(leaf) == 3 and isinstance(leaf[2], int)):
                return [0] * nseg
            k, m, n = leaf
            if at + n > nseg:
                return [0] * nseg
            if isinstance(k, str) and isinstance(m, dict):
                out[at:at + n] = plane_widths(k, m, n)
            at += n
    return out


def numpy_width(dtype: Any) -> int:
    """The plane width of a numpy dtype (or its JSON string): 2, 4 or 8 for floats and
    complex numbers of those parts, 0 for anything else."""
    if isinstance(dtype, np.dtype):
        dt = dtype
    elif not isinstance(dtype, str):
        return 0
    else:
        try:
            dt = np.dtype(dtype)
        except (TypeError, ValueError):
            return 0
    if dt.byteorder == ">" or dt.kind not in "fcV" or dt.fields is not None:
        return 0
    if dt.kind == "c":
        return dt.itemsize // 2 if dt.itemsize in (8, 16) else 0
    if dt.kind == "V" and dt.name != "bfloat16":  # (ml_dtypes' bfloat16 is kind V)
        return 0
    return dt.itemsize if dt.itemsize in (2, 4, 8) else 0


# ---------------------------------------------------------------- zstd, one context per thread
_local = threading.local()
#: byte planes are compressed with these zstd parameters instead of a level: matches of at
#: least 7 bytes in a 64-entry hash table (so almost every byte is a literal, entropy coded
#: by zstd's Huffman stage: an exponent plane is a few bits of entropy per byte with few
#: long repeats), 128 KiB blocks. On bf16 N(0, 0.02) exponent planes: 3.07x at 0.75 GB/s,
#: where level 3 gives 2.47x at 0.12 GB/s (bench/bench_bytes.py). Still plain zstd frames.
PLANE_PARAMS = {"strategy": 1, "min_match": 7, "search_log": 1, "hash_log": 6, "chain_log": 6,
                "window_log": 17, "target_length": 0}
PLANE_LEVEL = -(1 << 20)  # (the cache key of the plane compressor)


def _zstd() -> Any:
    """The ``zstandard`` module (the optional extra ``epochal[compress]``)."""
    try:
        import zstandard
    except ImportError:
        raise ImportError("compressed checkpoints need the zstandard package: "
                          "pip install 'epochal[compress]' (or zstandard)") from None
    return zstandard


def _compressor(level: int) -> Any:
    """This thread's zstd compressor: of ``level``, or for level :data:`PLANE_LEVEL` the
    parameters byte planes are written with (see :data:`PLANE_PARAMS`)."""
    zstandard = _zstd()

    cache = getattr(_local, "c", None)
    if cache is None:
        cache = _local.c = {}
    c = cache.get(level)
    if c is None:
        if level == PLANE_LEVEL:
            params = zstandard.ZstdCompressionParameters(write_content_size=True, **PLANE_PARAMS)
            c = zstandard.ZstdCompressor(compression_params=params)
        else:
            c = zstandard.ZstdCompressor(level=level, write_content_size=True)
        cache[level] = c
    return c


def _decompressor() -> Any:
    zstandard = _zstd()

    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def _pool(threads: int) -> ThreadPoolExecutor | None:
    if threads <= 1:
        return None
    pools = _POOLS
    p = pools.get(threads)
    if p is None:
        p = pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="epochal-zstd")
    return p


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _forget_pools() -> None:
    _POOLS.clear()  # a forked child has none of its parent's threads: it starts its own


os.register_at_fork(after_in_child=_forget_pools)


def _map(fn: Callable[[int], Any], n: int, threads: int) -> list[Any]:
    pool = _pool(min(threads, n))
    return list(map(fn, range(n))) if pool is None else list(pool.map(fn, range(n)))


# ---------------------------------------------------------------- compress
@dataclass
class Compressed:
    """A segment's encoded form: codec, planes per frame (1 for zstd), logical bytes per
    frame, logical length, the stored bytes (its streams one after the other), each
    stream's length and checksum, and the buffer the stored bytes lie in (to give back to
    :data:`~.planes.SPARES` once they are written; None: not from there)."""

    codec: int
    planes: int
    frame_bytes: int
    logical: int
    data: memoryview
    lengths: list[int]
    crcs: list[int]
    buffer: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def streams(self) -> list[memoryview]:
        """Each stream's bytes (views of :attr:`data`)."""
        ends = np.cumsum(self.lengths).tolist()
        return [self.data[e - n:e] for e, n in zip(ends, self.lengths)]


#: a byte plane whose sample shrinks by less than this is stored in raw zstd blocks
PLANE_MIN_RATIO = 1.03
#: float segments of at least this many bytes sample their planes first (smaller ones zstd
#: every plane: the sample would cost more than it saves); the sample is eight pieces of
#: :data:`PLANE_SAMPLE_BYTES` spread over the segment
PLANE_SAMPLE_MIN = 4 << 20
PLANE_SAMPLE_BYTES = 16 << 10


def _encode(data: np.ndarray, w: int, level: int, threads: int,
            raw: Sequence[bool]) -> tuple[np.ndarray, list[int], np.ndarray]:
    """Every frame of ``data`` encoded (as :func:`_frames`), the streams written one after
    the other into one buffer: (those bytes, each stream's length, the buffer, from
    :data:`~.planes.SPARES`: give it back once the bytes are written). It is sized for
    the worst case but touched only where written (a fresh page costs a fault per 4 KiB, so
    streams are never joined afterwards); a raw plane goes from the words straight into it
    and a zstd stream is copied in as it comes. Each of ``threads`` workers encodes a run
    of whole frames into its own region of it; the runs are then moved down, each to the
    end of the one before (``memmove``: no second buffer)."""
    n = len(data)
    size = FRAME_BYTES
    nframes = -(-n // size)
    runs = max(1, min(threads, nframes))
    cuts = [nframes * i // runs for i in range(runs + 1)]

    def bound(m: int) -> int:  # (a frame of m words)
        return sum(_raw_size(m) if raw and raw[j] else _bound(m) for j in range(w))

    last = (n - (nframes - 1) * size) // w
    full = bound(size // w)
    starts = [full * k for k in cuts[:-1]]  # (every frame but the last is full)
    buffer = SPARES.take(full * (nframes - 1) + bound(last))
    out = buffer[:full * (nframes - 1) + bound(last)]
    lengths: list[list[int]] = [[] for _ in range(runs)]

    def run(i: int) -> int:
        c = _compressor(level if w == 1 else PLANE_LEVEL)
        at, mine = starts[i], lengths[i]
        for k in range(cuts[i], cuts[i + 1]):
            frame = data[k * size:min(n, (k + 1) * size)]
            planes: Iterator[np.ndarray] = iter((frame,)) if w == 1 else _words(frame, w)
            for j, r in enumerate(planes):
                m = len(r)
                if raw and raw[j]:
                    got = _raw_frame_into(out[at:], r, m)
                else:
                    if w > 1:
                        p = _buf(2 + j, np.uint8, m)
                        np.copyto(p, r, casting="unsafe")  # (keeps the low byte)
                        r = p
                    s = c.compress(r)
                    got = len(s)
                    out[at:at + got] = np.frombuffer(s, dtype=np.uint8)
                at += got
                mine.append(got)
        return at - starts[i]

    used = _map(run, runs, threads)
    mv = out.data
    at = used[0]
    for i in range(1, runs):  # (memoryview slice assignment is a memmove: overlap allowed)
        mv[at:at + used[i]] = mv[starts[i]:starts[i] + used[i]]
        at += used[i]
    return out[:at], [x for ls in lengths for x in ls], buffer


def _frames(data: np.ndarray, w: int, level: int, threads: int, raw: Sequence[bool] = ()) -> list[list[Any]]:
    """Each frame of ``data`` compressed: one stream (``w`` 1) or its ``w`` planes' streams;
    the planes ``raw`` marks are stored in raw blocks instead of compressed."""
    return _frames_of(data, w, FRAME_BYTES, level, threads, raw)


def _frames_of(data: np.ndarray, w: int, size: int, level: int = 3, threads: int = 1,
               raw: Sequence[bool] = ()) -> list[list[Any]]:
    """:func:`_frames` with frames of ``size`` bytes."""
    n = len(data)

    def one(k: int) -> list[Any]:
        frame = data[k * size:min(n, (k + 1) * size)]
        c = _compressor(level if w == 1 else PLANE_LEVEL)
        parts = _split(frame, w) if w > 1 else [frame]
        return [raw_frame(p) if raw and raw[j] else c.compress(p) for j, p in enumerate(parts)]

    return _map(one, -(-n // size), threads)


def _sample(data: np.ndarray, w: int, piece: int, count: int) -> np.ndarray:
    """``count`` pieces of ``piece`` bytes, from the start to the end of ``data`` at even
    spacing, cut on word boundaries (``len(data)`` is at least ``count * piece``)."""
    n = len(data)
    step = piece - piece % max(w, 1)
    align = max(w, 8)
    starts = [min(n - step, (n - step) * i // max(count - 1, 1)) for i in range(count)]
    return np.concatenate([data[a - a % align:a - a % align + step] for a in starts])


def _raw_planes(data: np.ndarray, w: int) -> list[bool]:
    """Per byte plane of ``data``'s words: whether to store it raw, from a sample of eight
    pieces of :data:`PLANE_SAMPLE_BYTES` whose planes are compressed piece by piece (a
    plane that compresses in some regions of a segment only, like an optimizer state that
    holds two tensors, still counts: one zstd pass over pieces mixed together would not)."""
    sample = _sample(data, w, PLANE_SAMPLE_BYTES, 8)
    piece = len(sample) // 8
    sizes = np.zeros(w, dtype=np.int64)
    for f in _frames_of(sample, w, piece):
        sizes += [len(s) for s in f]
    return [int(z) * PLANE_MIN_RATIO > len(sample) // w for z in sizes]


def compress_segment(view: memoryview, width: int, options: WriteOptions, fn: Any) -> Compressed | None:
    """``view`` (one segment's bytes) compressed as ``options`` says, or None to store it
    raw (compression off, too short, an ``"auto"`` sample that does not compress, or a result
    not smaller than the bytes). ``width``: :func:`plane_widths`' value for it; ``fn``: the
    file's checksum function (each stream gets its own checksum, for ranged reads).

    A float segment of at least :data:`PLANE_SAMPLE_MIN` bytes first compresses a sample of
    its planes; a plane whose sample shrinks by less than :data:`PLANE_MIN_RATIO` (bf16's
    low byte, most often fp32's three low ones) is stored in raw zstd blocks in every frame,
    which costs a copy instead of a zstd pass that would gain nothing."""
    mode = options.compression
    n = view.nbytes
    if mode is None or n < MIN_BYTES:
        return None
    data = np.frombuffer(view, dtype=np.uint8)
    w = width if width > 1 and n % width == 0 else 1
    if mode == "auto" and n > 3 * SAMPLE_BYTES:
        sample = _sample(data, w, SAMPLE_BYTES, 3)
        got = sum(len(s) for f in _frames(sample, w, options.level, 1) for s in f)
        if got * AUTO_MIN_RATIO > len(sample):
            return None
    raw = _raw_planes(data, w) if w > 1 and n >= PLANE_SAMPLE_MIN else []
    out, lengths, buffer = _encode(data, w, options.level, options.threads, raw)
    size = len(out)
    if size >= n or (mode == "auto" and size * AUTO_MIN_RATIO > n):
        SPARES.give_back([buffer])  # (nothing reads it)
        return None
    stored = out.data
    ends = np.cumsum(lengths).tolist()
    return Compressed(CODEC_PLANES if w > 1 else CODEC_ZSTD, w, FRAME_BYTES, n, stored, lengths,
                      [fn(stored[e - ln:e], 0) for e, ln in zip(ends, lengths)], buffer)


# ---------------------------------------------------------------- decode
def decode_frames(
    codec: int, planes: int, frame_bytes: int, logical: int, first: int,
    streams: Sequence[memoryview], out: memoryview, threads: int = 2,
) -> None:
    """Decode the frames ``first, first + 1, ...`` of a segment (``streams``: their streams,
    in order, ``planes`` per frame) into ``out``, which holds exactly their logical bytes.
    ValueError when a stream does not decode to its frame's bytes (a damaged or forged
    stream whose checksum matched: the caller names the file and blob)."""
    if codec not in (CODEC_ZSTD, CODEC_PLANES) or planes < 1 or len(streams) % planes:
        raise ValueError(f"unknown compressed segment layout (codec {codec}, {planes} planes)")
    nframes = len(streams) // planes
    dst = np.frombuffer(out, dtype=np.uint8)
    start = first * frame_bytes

    def one(k: int) -> None:
        lo = (first + k) * frame_bytes
        hi = min(logical, lo + frame_bytes)
        size = (hi - lo) // planes
        d = _decompressor()
        parts = []
        for s in streams[k * planes:(k + 1) * planes]:
            try:
                got = d.decompress(s, max_output_size=size)
            except Exception as e:  # zstandard.ZstdError, or a frame without its size
                raise ValueError(f"compressed frame {first + k} does not decode: {e}") from None
            if len(got) != size:
                raise ValueError(f"compressed frame {first + k} decodes to {len(got)} bytes, not {size}")
            parts.append(got)
        target = dst[lo - start:hi - start]
        if planes == 1:
            target[:] = np.frombuffer(parts[0], dtype=np.uint8)
        else:
            _merge(parts, target, planes)

    if len(dst) != min(logical, (first + nframes) * frame_bytes) - start:
        raise ValueError("output buffer does not fit the frames")
    _map(one, nframes, threads)
