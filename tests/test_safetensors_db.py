"""The safetensors db_type: files the safetensors library opens, holding every blob exactly."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_native_format import same, sample_blobs

from epochal.errors import CheckpointCorruptError, MissingBlobError, UnsupportedBlobError
from epochal.storage.formats.base import ReadStats, get_db_type
from epochal.storage.formats.safetensors_db import SafetensorsBackend

st_numpy = pytest.importorskip("safetensors.numpy")


def expected(v: Any) -> Any:
    return v.copy(order="C") if isinstance(v, np.ndarray) else v


@pytest.fixture
def db(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    blobs = sample_blobs()
    blobs["big_be"] = np.arange(3000, dtype=">f8")  # not a safetensors dtype: hidden U8 tensor
    blobs["big_bytes"] = bytes(range(256)) * 40
    path = str(tmp_path / "model.safetensors")
    SafetensorsBackend().write(path, blobs)
    return path, blobs


def test_registered() -> None:
    assert isinstance(get_db_type("safetensors"), SafetensorsBackend)


def test_round_trip(db: tuple[str, dict[str, Any]]) -> None:
    path, blobs = db
    out = SafetensorsBackend().read(path)
    assert list(out) == list(blobs)
    for k, v in blobs.items():
        assert same(out[k], expected(v)), k


def test_safetensors_library_opens_it(db: tuple[str, dict[str, Any]]) -> None:
    path, blobs = db
    loaded = st_numpy.load_file(path)
    for k in ("f32", "f16", "u64", "bool", "zero_d", "empty", "ünï/cödé name", "noncontig"):
        assert same(loaded[k], expected(blobs[k])), k
    assert "str" not in loaded and "f64_be" not in loaded  # kept in the metadata instead
    from safetensors import safe_open

    with safe_open(path, framework="np") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and json.loads(meta["epochal.blobs"])[0]["name"] == "f32"


def test_reads_foreign_safetensors_files(tmp_path: Path) -> None:
    path = str(tmp_path / "hf.safetensors")
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, dtype=np.int64)}
    st_numpy.save_file(arrays, path)
    out = SafetensorsBackend().read(path)
    assert set(out) == {"w", "b"} and same(out["w"], arrays["w"])
    assert {i.name for i in SafetensorsBackend().describe(path)} == {"w", "b"}


def test_partial_missing_stats(db: tuple[str, dict[str, Any]]) -> None:
    path, blobs = db
    b = SafetensorsBackend()
    stats = ReadStats()
    out = b.read(path, ["big_be", "str"], stats=stats)
    assert same(out["big_be"], blobs["big_be"]) and stats.blobs == 2
    with pytest.raises(MissingBlobError) as ei:
        b.read(path, ["nope"])
    assert "nope" in str(ei.value) and path in str(ei.value)
    assert list(b.read(path, ["nope", "str"], allow_incomplete=True)) == ["str"]


def test_describe_and_digest(db: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    path, blobs = db
    b = SafetensorsBackend()
    infos = b.describe(path)
    assert [i.name for i in infos] == list(blobs)
    f32 = infos[0]
    assert f32.dtype == "<f4" and f32.shape == (3, 4) and f32.nbytes == 48
    d = b.digest(path)
    other = str(tmp_path / "o.safetensors")
    b.write(other, blobs)
    assert b.digest(other) == d
    b.write(other, dict(blobs, int=1))
    assert b.digest(other) != d


def test_unsupported_and_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedBlobError):
        SafetensorsBackend().write(str(tmp_path / "x.safetensors"), {"o": object()})
    with pytest.raises(FileNotFoundError):
        SafetensorsBackend().write(str(tmp_path / "no" / "x.safetensors"), {"o": 1})
    assert list(tmp_path.iterdir()) == []


def test_damaged_tensor_data_names_blob(db: tuple[str, dict[str, Any]]) -> None:
    path, _ = db
    raw = bytearray(Path(path).read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    b, _e = header["u64"]["data_offsets"]
    raw[8 + n + b] ^= 1
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError) as ei:
        SafetensorsBackend().read(path)
    assert ei.value.blob == "u64"
    assert SafetensorsBackend().read(path, verify=False)["u64"][0] == 1


@pytest.mark.parametrize("cut", [0, 5, 50, -1])
def test_truncated(db: tuple[str, dict[str, Any]], cut: int) -> None:
    path, _ = db
    raw = Path(path).read_bytes()
    Path(path).write_bytes(raw[:cut])
    with pytest.raises(CheckpointCorruptError):
        SafetensorsBackend().read(path)


def test_damaged_blob_list(db: tuple[str, dict[str, Any]]) -> None:
    path, _ = db
    raw = bytearray(Path(path).read_bytes())
    pos = raw.index(b"\\u00e9") if b"\\u00e9" in raw else raw.index(b"llo")
    raw[pos + 1] ^= 2
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError):
        SafetensorsBackend().read(path)
