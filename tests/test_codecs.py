"""Blob codecs: every value type of the API round-trips exactly through encode/allocate/decode."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from epochal import UnsupportedBlobError
from epochal.storage.encoding import codecs


def roundtrip(value):
    enc = codecs.encode(value, "b")
    codec = codecs.codec_for_kind(enc.kind)
    bufs = codec.allocate(enc.meta, [s.nbytes for s in enc.segments])
    for buf, seg in zip(bufs, enc.segments):
        buf[:] = seg.cast("B") if seg.nbytes else b""
    return codec.decode(enc.meta, bufs, None)


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=np.int32).reshape(3, 4),
        np.array(3.5, dtype=np.float16),  # 0-d
        np.zeros((0, 5), dtype=np.float64),  # empty
        np.array([True, False]),
        np.array([1 + 2j, -0.0 - 1j], dtype=np.complex64),
        np.array(["ab", "", "xyz"]),  # <U3
        np.array([b"a\x00b", b"c"]),  # |S3
        np.arange(6, dtype=">i8").reshape(2, 3),  # big-endian
        np.arange(20, dtype=np.uint16)[::3],  # non-contiguous
        np.arange(24, dtype=np.float32).reshape(2, 3, 4).transpose(2, 0, 1),
        np.array([(1, 2.5), (3, -1.0)], dtype=[("a", "<i4"), ("b", "<f8")]),
        np.array(["2020-01-01"], dtype="datetime64[ns]"),
    ],
)
def test_ndarray_roundtrip_exact(arr):
    out = roundtrip(arr)
    assert isinstance(out, np.ndarray)
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert out.tobytes() == np.ascontiguousarray(arr).tobytes()
    assert out.flags.writeable


def test_float_bits_nan_payload_and_negative_zero():
    nan = np.array([struct.unpack("<f", b"\x01\x00\xc0\x7f")[0], -0.0], dtype=np.float32)
    nan.view(np.uint32)[0] = 0x7FC00001
    out = roundtrip(nan)
    assert out.view(np.uint32).tolist() == nan.view(np.uint32).tolist()
    payload_nan = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000123))[0]
    back = roundtrip(payload_nan)
    assert struct.pack("<d", back) == struct.pack("<d", payload_nan)
    assert math.copysign(1.0, roundtrip(-0.0)) == -1.0


@pytest.mark.parametrize(
    "value",
    [None, True, False, 0, -7, 2**200, -(2**70), 1.25, float("inf"), "", "héllo\U0001f600",
     b"", b"\x00\xff", bytearray(b"xy")],
)
def test_python_scalars(value):
    out = roundtrip(value)
    assert type(out) is type(value) and out == value


@pytest.mark.parametrize("value", [np.float32(1.5), np.int8(-3), np.bool_(True), np.complex128(1j),
                                   np.str_("abc"), np.bytes_(b"q"), np.uint64(2**64 - 1)])
def test_numpy_scalars_keep_their_type(value):
    out = roundtrip(value)
    assert type(out) is type(value) and out == value


def test_unsupported_values_name_the_blob():
    class Opaque:
        pass

    with pytest.raises(UnsupportedBlobError, match="blob 'weights'.*Opaque"):
        codecs.encode(Opaque(), "weights")
    with pytest.raises(UnsupportedBlobError, match="objects"):
        codecs.encode(np.array([object()], dtype=object), "objs")


def test_bad_meta_is_a_value_error():
    codec = codecs.codec_for_kind("ndarray")
    with pytest.raises(ValueError):
        codec.allocate({"dtype": "|O", "shape": [1]}, [8])
    with pytest.raises(ValueError):
        codec.allocate({"dtype": "<f4", "shape": [2]}, [4])
    with pytest.raises(ValueError):
        codec.allocate({"dtype": "<f4", "shape": [-1]}, [4])
    with pytest.raises(ValueError):
        codec.allocate({"dtype": "not-a-dtype", "shape": [1]}, [4])
    with pytest.raises(ValueError, match="unknown blob kind"):
        codecs.codec_for_kind("martian")
