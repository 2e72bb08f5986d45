"""Property-based tests of the native format: random blobs round-trip exactly; every random
truncation and byte flip is detected as CheckpointCorruptError (never a crash, a hang or a
wrong value)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_native_format import same

from epochal.errors import CheckpointCorruptError
from epochal.storage.formats.native import NativeBackend, layout, open_native, write_native

DTYPES = [
    "<f2", "<f4", ">f4", "<f8", ">f8", "|i1", "<i2", ">i2", "<i4", "<i8", ">i8", "|u1", "<u2",
    "<u4", "<u8", "|b1", "<c8", ">c16", "|S3", "<U2", "<M8[s]", "<m8[ms]",
]

arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(
        np.dtype(dt),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
        elements=None if np.dtype(dt).kind in "fc" else None,
    )
)
py_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=200),
)
np_scalars = st.sampled_from(["<f4", "<f8", "<i8", "|u1", "|b1"]).flatmap(
    lambda dt: hnp.from_dtype(np.dtype(dt)).map(lambda v, dt=dt: np.dtype(dt).type(v))
)
values = st.one_of(arrays, py_values, np_scalars)
blob_dicts = st.dictionaries(st.text(max_size=12), values, max_size=8)

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _tmp() -> str:
    fd, path = tempfile.mkstemp(suffix=".db", dir=os.environ.get("TMPDIR"))
    os.close(fd)
    return path


@SETTINGS
@given(blobs=blob_dicts)
def test_round_trip(blobs: dict[str, Any]) -> None:
    path = _tmp()
    try:
        write_native(path, blobs)
        out = NativeBackend().read(path)
        assert list(out) == list(blobs)
        for k, v in blobs.items():
            assert same(out[k], v), k
        with open_native(path) as f:  # memory-mapped view gives the same values
            for k, v in blobs.items():
                assert same(f[k], v) if not isinstance(v, np.ndarray) else (
                    f[k].tobytes() == v.tobytes() and f[k].dtype == v.dtype and f[k].shape == v.shape
                )
        names = list(blobs)[::2]
        assert list(NativeBackend().read(path, names)) == sorted(names, key=list(blobs).index)
    finally:
        os.unlink(path)


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A small file with every kind of part: arrays, scalars, strings, empty segments."""
    path = tmp_path_factory.mktemp("victim") / "v.db"
    rng = np.random.default_rng(5)
    blobs = {
        "w": rng.standard_normal((7, 5)).astype(np.float32),
        "b": rng.integers(0, 9, 13).astype(">i2"),
        "s": "checkpoint ✓",
        "n": None,
        "i": 12345678901234567890,
        "e": np.empty(0, dtype=np.float64),
        "x": np.float64(2.5),
        "raw": b"\x00" * 70,
    }
    write_native(path, blobs)
    return Path(path).read_bytes()


def _expect_detected(raw: bytes) -> None:
    path = _tmp()
    try:
        Path(path).write_bytes(raw)
        with pytest.raises(CheckpointCorruptError) as ei:
            NativeBackend().read(path)
        assert ei.value.path == path
        with pytest.raises(CheckpointCorruptError):
            with open_native(path) as f:
                f.read()
    finally:
        os.unlink(path)


@SETTINGS
@given(data=st.data())
def test_every_truncation_is_detected(victim: bytes, data: st.DataObject) -> None:
    cut = data.draw(st.integers(min_value=0, max_value=len(victim) - 1))
    _expect_detected(victim[:cut])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_byte_flip_is_detected(victim: bytes, data: st.DataObject) -> None:
    pos = data.draw(st.integers(min_value=0, max_value=len(victim) - 1))
    mask = data.draw(st.integers(min_value=1, max_value=255))
    raw = bytearray(victim)
    raw[pos] ^= mask
    _expect_detected(bytes(raw))


@SETTINGS
@given(data=st.data())
def test_random_garbage_never_crashes(victim: bytes, data: st.DataObject) -> None:
    """Overwrite a random span with random bytes: always a clean CheckpointCorruptError."""
    start = data.draw(st.integers(min_value=0, max_value=len(victim) - 1))
    junk = data.draw(st.binary(min_size=1, max_size=64))
    raw = bytearray(victim)
    raw[start : start + len(junk)] = junk
    raw = raw[: len(victim)]
    if bytes(raw) == victim:
        return
    _expect_detected(bytes(raw))


def test_exhaustive_single_bit_flips_in_header(victim: bytes) -> None:
    """Every bit of the superblock and of the first index bytes, one at a time."""
    ioff = layout.SUPER.unpack(victim[:64])[5]
    positions = list(range(64)) + list(range(ioff, min(len(victim), ioff + 96)))
    for pos in positions:
        for bit in range(8):
            raw = bytearray(victim)
            raw[pos] ^= 1 << bit
            _expect_detected(bytes(raw))
