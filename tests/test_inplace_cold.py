"""A cold in-place load verifies by big parallel reads instead of page faults on a map (issue
27): through the page cache (inplace.verify_direct_read, the default) or O_DIRECT reads into
staged copies (inplace.stage_direct, where tuning.DIRECT_STAGE_MAX allows); each test runs
both ways. The same bits restored, a
damaged byte or padding found before any live byte is written, and a cached file still
verified on the map."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")

from test_inplace_load import W, assert_same, big_segment, flip, make, seg_offset, snapshot  # noqa: E402

from epochal.errors import CheckpointCorruptError  # noqa: E402
from epochal.storage.formats.native import NativeBackend, write_native  # noqa: E402
from epochal.storage.formats.native.reads import inplace  # noqa: E402
from epochal.storage.io import tuning  # noqa: E402
from epochal.storage.io.local import RWF_NOWAIT  # noqa: E402


@pytest.fixture(params=["read", "stage"])
def cold_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The cold verification expected: "read" (the page cache, the default) or "stage"
    (O_DIRECT into staged copies, allowed by tuning.DIRECT_STAGE_MAX)."""
    monkeypatch.setattr(tuning, "DIRECT_STAGE_MAX", (1 << 40) if request.param == "stage" else 0)
    return str(request.param)


@pytest.fixture()
def paths(monkeypatch: pytest.MonkeyPatch, cold_path: str) -> list[str]:
    """Which verification each in-place load took ("read", "stage"; none: the map)."""
    took: list[str] = []
    read, stage = inplace.verify_direct_read, inplace.stage_direct

    def spy_read(f: Any, direct: Any) -> None:
        took.append("read")
        read(f, direct)

    def spy_stage(f: Any, direct: Any) -> Any:
        try:
            out = stage(f, direct)
        except Exception:
            took.append("stage")  # it read and refused
            raise
        if out is not None:
            took.append("stage")
        return out

    monkeypatch.setattr(inplace, "verify_direct_read", spy_read)
    monkeypatch.setattr(inplace, "stage_direct", spy_stage)
    return took


def _cold(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """RWF_NOWAIT reads fail with EAGAIN, as for a file not in the page cache."""
    calls: list[int] = []
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if flags & RWF_NOWAIT:
            calls.append(offset)
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return calls


pytestmark = pytest.mark.skipif(not RWF_NOWAIT, reason="no RWF_NOWAIT: every load takes the map")


@pytest.mark.parametrize("threads", [1, 4])
def test_cold_in_place_load_restores_every_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               paths: list[str], cold_path: str, threads: int) -> None:
    monkeypatch.setattr(tuning, "IO_THREADS", threads)
    monkeypatch.setattr(tuning, "READ_PIECE", 1 << 20)  # several pieces per segment
    src_model, src_opt = make(0, layers=4)
    path = tmp_path / "ck.db"
    write_native(path, {"model": src_model, "opt": src_opt, "tensor": torch.randn(W, W + 7)})
    want = snapshot(src_model, src_opt)
    model, opt = make(1, layers=4)
    tensor = torch.zeros(W, W + 7)
    ptrs = [p.data_ptr() for p in model.parameters()]
    probes = _cold(monkeypatch)
    got = NativeBackend().read(str(path), existing={"model": model, "opt": opt, "tensor": tensor})
    assert paths == [cold_path] and probes
    assert got["model"] is model and [p.data_ptr() for p in model.parameters()] == ptrs
    assert_same(snapshot(model, opt), want)
    assert torch.equal(tensor, NativeBackend().read(str(path), ["tensor"])["tensor"])


def test_a_cached_file_is_verified_on_the_map(tmp_path: Path, paths: list[str]) -> None:
    src_model, src_opt = make(0)
    path = tmp_path / "ck.db"
    write_native(path, {"model": src_model, "opt": src_opt})
    path.read_bytes()  # in the page cache
    model, opt = make(1)
    NativeBackend().read(str(path), existing={"model": model, "opt": opt})
    assert paths == []
    assert_same(snapshot(model, opt), snapshot(src_model, src_opt))


@pytest.mark.parametrize("where", ["model-big", "opt-big", "tensor", "model-small"])
def test_damage_found_before_any_live_byte_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      paths: list[str], cold_path: str, where: str) -> None:
    src_model, src_opt = make(0)
    path = tmp_path / "ck.db"
    write_native(path, {"model": src_model, "opt": src_opt, "tensor": torch.randn(W, W)})
    blob = where.split("-")[0]
    if where == "model-small":  # a bias: staged, not read in place
        off, ln = seg_offset(path, "model", 1)
    else:
        off, ln = big_segment(path, blob)
    flip(path, off + ln - 1)  # the last byte: in the last piece read
    model, opt = make(1)
    tensor = torch.full((W, W), 3.0)
    before = snapshot(model, opt)
    _cold(monkeypatch)
    with pytest.raises(CheckpointCorruptError) as ei:
        NativeBackend().read(str(path), existing={"model": model, "opt": opt, "tensor": tensor})
    assert ei.value.blob == blob and str(path) in str(ei.value)
    assert_same(snapshot(model, opt), before)
    assert torch.equal(tensor, torch.full((W, W), 3.0))
    assert paths == [cold_path]


def test_damaged_padding_found_cold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, paths: list[str],
                                   cold_path: str) -> None:
    path = tmp_path / "t.db"
    write_native(path, {"t": torch.randn(W * W + 3)})
    off, ln = seg_offset(path, "t")
    flip(path, off + ln + 1)
    live = torch.zeros(W * W + 3)
    _cold(monkeypatch)
    with pytest.raises(CheckpointCorruptError, match="padding"):
        NativeBackend().read(str(path), existing={"t": live})
    assert not live.any() and paths == [cold_path]


def test_a_truncated_file_is_reported_cold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cold_path: str) -> None:
    path = tmp_path / "t.db"
    write_native(path, {"t": torch.randn(W * W)})
    off, ln = seg_offset(path, "t")
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if flags & RWF_NOWAIT:
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        if offset == off:
            return 0  # the disk ends early, where the segment starts
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    live = torch.zeros(W * W)
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        NativeBackend().read(str(path), existing={"t": live})
    assert not live.any()
