"""docs/format.md's plain-numpy reader of a native db: run the code block as it is printed, on
files epochal writes, and compare every array bit for bit; damage is caught."""

from __future__ import annotations

import numpy as np
import pytest
from _format_doc import documented_read_native

from epochal import get_db_type


@pytest.fixture(scope="module")
def read_native():
    return documented_read_native()


def test_the_documented_reader_reads_what_epochal_writes(tmp_path, read_native):
    rng = np.random.default_rng(0)
    blobs = {
        "w": rng.standard_normal((17, 5)).astype(np.float32),
        "ids": np.arange(1000, dtype=np.int64),
        "empty": np.zeros((0, 3), np.float64),
        "scalar": np.float64(2.5),
        "name": "not an array",
        **{f"many/{i}": np.full(i + 1, i, np.int16) for i in range(80)},  # the batched writer path
    }
    path = str(tmp_path / "n.db")
    get_db_type("native").write(path, blobs)
    got = read_native(path)
    arrays = {k: v for k, v in blobs.items() if isinstance(v, np.ndarray)}
    assert sorted(got) == sorted(arrays)
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes(), k


def test_the_documented_reader_catches_a_flipped_byte(tmp_path, read_native):
    path = tmp_path / "n.db"
    get_db_type("native").write(str(path), {"w": np.arange(100, dtype=np.float64)})
    raw = bytearray(path.read_bytes())
    raw[64 + 10] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(AssertionError, match="blob 'w' is damaged"):
        read_native(str(path))
