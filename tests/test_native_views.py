"""NativeFile.views (native/reads/mapped.verified_views): verified read-only views of whole blobs on
a map of a cached file, for a reader that copies parts of them out (a DCP reshard).
Every checksum and padding is checked before a view is returned; the path declines (None,
nothing read) where it does not apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")

from epochal.errors import CheckpointCorruptError  # noqa: E402
from epochal.storage.formats.native import write_native  # noqa: E402
from epochal.storage.formats.native.reader import NativeFile  # noqa: E402
from epochal.storage.io import direct  # noqa: E402


def _values() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "big": torch.randn(700, 1000, generator=g),
        "half": torch.randn(33, 7, generator=g).to(torch.bfloat16),  # 462 bytes: padded to 512
        "arr": np.arange(1000, dtype=np.int64),
        "n": 3,  # no segment: JSON only
    }


def _segment(path: Path, blob: str) -> tuple[int, int]:
    with NativeFile(path) as f:
        idx = f._index
        i = idx.find(blob)
        assert i is not None
        k = idx.seg_range(i).start
        return int(idx.segs["offset"][k]), int(idx.segs["length"][k])


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x08
    path.write_bytes(bytes(raw))


@pytest.fixture()
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A db of the values, its file taken for cached (the probe patched: deterministic)."""
    monkeypatch.setattr(direct, "looks_cached", lambda *a, **k: True)
    path = tmp_path / "rank0.0"
    write_native(str(path), _values())
    return path


def _bytes(v: Any) -> bytes:
    return v.tobytes() if isinstance(v, np.ndarray) else v.contiguous().view(torch.uint8).numpy().tobytes()


def test_views_are_the_blobs_bytes_read_only(db: Path) -> None:
    vals = _values()
    with NativeFile(db) as f:
        mv = f.views(["half", "big", "arr"])
        assert mv is not None
        with mv:
            assert sorted(mv.views) == ["arr", "big", "half"]
            for name, view in mv.views.items():
                assert view.readonly and bytes(view) == _bytes(vals[name]), name
            keep = mv.views["big"]
        with pytest.raises(ValueError):  # released with the map
            bytes(keep)


def test_a_flipped_byte_is_named_before_any_view_is_returned(db: Path) -> None:
    off, n = _segment(db, "big")
    _flip(db, off + n // 2)
    with NativeFile(db) as f, pytest.raises(CheckpointCorruptError) as ei:
        f.views(["arr", "big"])
    assert ei.value.blob == "big" and ei.value.path == str(db)


def test_damaged_padding_is_named(db: Path) -> None:
    off, n = _segment(db, "half")
    assert n % 64  # (there is padding after it)
    _flip(db, off + n + 1)
    with NativeFile(db) as f, pytest.raises(CheckpointCorruptError, match="padding") as ei:
        f.views(["big", "half"])
    assert ei.value.blob == "half"


def test_declined_where_it_does_not_apply(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with NativeFile(db) as f:
        assert f.views(["n", "big"]) is None  # a blob without exactly one segment
        monkeypatch.setattr(direct, "looks_cached", lambda *a, **k: False)
        assert f.views(["big"]) is None  # a file that does not look cached: read it instead
