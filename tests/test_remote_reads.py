"""Loads from a URL: big blobs in ranged pieces fetched in parallel, each piece checksummed
and the checksums combined; padding read with the last piece; an open costs one round trip
after the HEAD (header and tail together); a small object is fetched once, whole; a full
load (every blob, a resume, a verify) fetches the whole object in one round trip of
parallel ranges. memory:// and moto's S3 on 127.0.0.1."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fsspec", reason="the s3 extra is not installed")

from epochal.errors import CheckpointCorruptError  # noqa: E402
from epochal.storage.formats.base import get_db_type  # noqa: E402
from epochal.storage.formats.native.layout import DAMAGED_DATA, DAMAGED_PAD  # noqa: E402
from epochal.storage.io import tuning  # noqa: E402
from epochal.storage.io.remote import fsspec_store  # noqa: E402
from epochal.storage.io.remote.fsspec_store import filesystem_for, set_storage_options  # noqa: E402

PIECE = (1 << 20) + 4096  # pieces straddle segment and piece boundaries


@pytest.fixture(params=["memory", "s3"])
def where(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return f"memory://reads-{secrets.token_hex(4)}/run"
    url = f"s3://ckpts/reads-{secrets.token_hex(4)}/run"
    set_storage_options(url, request.getfixturevalue("s3"))
    return url


@pytest.fixture
def fetched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[tuple[int, int]], str]]:
    """Every request batch asked of the store: ``([(start, end), ...], thread name)``."""
    seen: list[tuple[list[tuple[int, int]], str]] = []
    real = fsspec_store.FsspecSource._fetch

    def spy(self: Any, starts: list[int], ends: list[int]) -> list[bytes]:
        seen.append((list(zip(starts, ends)), str(threading.get_ident())))
        if ends[0] - starts[0] >= PIECE:
            time.sleep(0.02)  # a slow store: the other threads take the next pieces meanwhile
        return real(self, starts, ends)

    monkeypatch.setattr(fsspec_store.FsspecSource, "_fetch", spy)
    monkeypatch.setattr(tuning, "REMOTE_PIECE", PIECE)
    return seen


def _blobs() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "big1": rng.standard_normal(450_000),  # 3.6 MB: 4 pieces
        "big2": rng.integers(0, 255, 2_100_001, dtype=np.uint8),  # not a multiple of 64: padded
        "small": np.arange(100, dtype=np.int32),
        "step": 12,
    }


def _written(url: str) -> tuple[dict[str, Any], int]:
    """``_blobs()`` written as a native db at ``url``, and the db's size."""
    blobs = _blobs()
    return blobs, get_db_type("native").write(url, blobs)


def _flip(url: str, locate: Callable[[bytearray, dict[str, Any]], int], blobs: dict[str, Any], mask: int) -> int:
    """XOR ``mask`` into the stored byte at ``locate(bytes, blobs)``; the byte it was."""
    fs, path = filesystem_for(url)
    data = bytearray(fs.cat_file(path))
    at = locate(data, blobs)
    old = data[at]
    data[at] ^= mask
    fs.pipe_file(path, bytes(data))
    fs.invalidate_cache()
    return old


def test_big_blobs_come_in_parallel_pieces_and_the_open_in_one_round_trip(
    where: str, fetched: list[tuple[list[tuple[int, int]], str]],
) -> None:
    url = f"{where}/trainer_0.3"
    blobs, size = _written(url)
    backend = get_db_type("native")
    fetched.clear()
    got = backend.read(url, list(blobs))  # (names given, no resume: not known to be whole)
    for name in ("big1", "big2", "small"):
        assert got[name].tobytes() == blobs[name].tobytes(), name
    assert got["step"] == 12
    head, tail = fetched[0][0]
    assert head == (0, 64) and tail == (size - tuning.REMOTE_TAIL, size)  # header + index: one batch
    assert all(len(ranges) == 1 for ranges, _ in fetched[1:])
    lengths = [b - a for ranges, _ in fetched[1:] for a, b in ranges]
    assert max(lengths) <= PIECE + 63  # a piece (with the padding after a segment's last one)
    assert min(lengths) > 64  # no request for a padding on its own
    assert sum(1 for n in lengths if n >= PIECE) >= 4  # big1 and big2 cut into pieces
    assert len({thread for _, thread in fetched[1:]}) > 1  # several requests in flight
    big = blobs["big1"].nbytes + blobs["big2"].nbytes
    assert big <= sum(lengths) < big + 128  # every big byte once (the small ones and the index
    # sit in the tail fetched at open)


def test_a_small_object_is_fetched_once_whole(where: str, fetched: list[tuple[list[tuple[int, int]], str]]) -> None:
    url = f"{where}/trainer_0.4"
    backend = get_db_type("native")
    size = backend.write(url, {"w": np.arange(1000.0), "step": 4})
    assert size <= tuning.REMOTE_WHOLE
    fetched.clear()
    got = backend.read(url)
    assert got["w"].tolist() == list(np.arange(1000.0)) and got["step"] == 4
    assert [ranges for ranges, _ in fetched] == [[(0, size)]]


@pytest.mark.parametrize("damage", ["data", "padding"])
def test_a_damaged_piece_or_padding_is_found_naming_the_blob(
    where: str, fetched: list[tuple[list[tuple[int, int]], str]], damage: str,
) -> None:
    url = f"{where}/trainer_0.5"
    blobs, _ = _written(url)
    backend = get_db_type("native")
    if damage == "data":  # a byte in big1's third piece
        name = "big1"
        old = _flip(url, lambda d, b: d.find(b["big1"].tobytes()) + 2 * PIECE + 5, blobs, 0x10)
    else:  # a byte of the zero padding after big2
        name = "big2"
        old = _flip(url, lambda d, b: d.find(b["big2"].tobytes()) + b["big2"].nbytes + 3, blobs, 0x10)
        assert old == 0
    with pytest.raises(CheckpointCorruptError) as e:
        backend.read(url)
    text = str(e.value)
    assert url in text and name in text and (DAMAGED_DATA if damage == "data" else DAMAGED_PAD) in text
    assert backend.read(url, ["small", "step"])["step"] == 12  # the rest still loads


def test_a_load_into_live_tensors_fetches_every_byte_once(
    where: str, fetched: list[tuple[list[tuple[int, int]], str]],
) -> None:
    """In place from a URL: not a verify pass then a second read into live memory (every
    byte fetched twice, the verify pass in small sequential requests), but one parallel
    fetch into fresh buffers, verified, then copied into the live tensors."""
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    url = f"{where}/trainer_0.6"
    src = {"a": torch.randn(700, 1000), "b": torch.randn(300, 999)}  # 2.8 MB and 1.2 MB
    backend = get_db_type("native")
    size = backend.write(url, src)
    live = {"a": torch.zeros(700, 1000), "b": torch.zeros(300, 999)}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    fetched.clear()
    got = backend.read(url, existing=live)
    assert all(got[k] is live[k] and live[k].data_ptr() == ptrs[k] for k in live)
    assert all(torch.equal(live[k], src[k]) for k in src)
    total = sum(b - a for ranges, _ in fetched for a, b in ranges)
    assert size - tuning.REMOTE_TAIL <= total <= size + tuning.REMOTE_TAIL, (total, size)  # (the tail: once more)


def _one_round_trip(fetched: list[tuple[list[tuple[int, int]], str]], size: int) -> None:
    """Every byte was asked for in one batch of ranges that tile the object, nothing else."""
    assert len(fetched) == 1, [r for r, _ in fetched]
    ranges = fetched[0][0]
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no overlap
    assert len(ranges) == -(-size // PIECE) - (size % PIECE < PIECE // 4)  # a short rest joins the last
    assert max(b - a for a, b in ranges) < PIECE + PIECE // 4


def test_a_full_load_fetches_the_whole_object_in_one_round_trip(
    where: str, fetched: list[tuple[list[tuple[int, int]], str]],
) -> None:
    url = f"{where}/trainer_0.7"
    blobs, size = _written(url)
    backend = get_db_type("native")
    fetched.clear()
    got = backend.read(url)  # every blob: header, index and data in one batch
    assert all(got[n].tobytes() == blobs[n].tobytes() for n in ("big1", "big2", "small")) and got["step"] == 12
    _one_round_trip(fetched, size)
    fetched.clear()
    backend.verify(url)  # a verify reads it all too
    _one_round_trip(fetched, size)


def test_a_resume_from_a_url_fetches_its_db_in_one_round_trip(
    where: str, fetched: list[tuple[list[tuple[int, int]], str]],
) -> None:
    from epochal import Checkpointer

    blobs = _blobs()
    with Checkpointer(where, async_save=False) as ck:
        ck.save(3, dict(blobs))
    fetched.clear()
    state = {n: np.zeros_like(v) if isinstance(v, np.ndarray) else 0 for n, v in blobs.items()}
    with Checkpointer(where, async_save=False) as ck:
        assert ck.restore(state) == 3
    assert all(state[n].tobytes() == blobs[n].tobytes() for n in ("big1", "big2", "small")) and state["step"] == 12
    db_batches = [r for r, _ in fetched if sum(b - a for a, b in r) > tuning.REMOTE_TAIL + 64]
    assert len(db_batches) == 1 and len(db_batches[0]) > 1  # the data: one batch, ranges in flight together
    assert db_batches[0][0][0] == 0 and all(a[1] == b[0] for a, b in zip(db_batches[0], db_batches[0][1:]))
    # the rest: the quick check's superblock (+ tail) read of the step's digest
    assert all(sum(b - a for a, b in r) <= tuning.REMOTE_TAIL + 64 for r, _ in fetched if r not in db_batches)


def test_damage_is_found_in_a_whole_fetch_and_big_objects_keep_the_open_round_trip(
    where: str, fetched: list[tuple[list[tuple[int, int]], str]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = f"{where}/trainer_0.8"
    blobs, size = _written(url)
    backend = get_db_type("native")
    _flip(url, lambda d, b: d.find(b["big2"].tobytes()) + 3 * PIECE // 2, blobs, 1)
    fetched.clear()
    with pytest.raises(CheckpointCorruptError) as e:
        backend.read(url)
    assert url in str(e.value) and "big2" in str(e.value) and DAMAGED_DATA in str(e.value)
    _one_round_trip(fetched, size)
    monkeypatch.setattr(tuning, "REMOTE_WHOLE_LOAD", size - 1)  # too big to hold: as before
    fetched.clear()
    with pytest.raises(CheckpointCorruptError):
        backend.read(url)
    assert fetched[0][0] == [(0, 64), (size - tuning.REMOTE_TAIL, size)]


def test_segments_side_by_side_come_in_one_request_up_to_a_piece(
    where: str, fetched: list[tuple[list[tuple[int, int]], str]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A db of many tensors of a few MiB (a model's layers): the segments a load wants that
    follow each other in the file are fetched together, one ranged request of up to a piece,
    not one request per segment; every byte once, bit-exact; a damaged byte in a segment in
    the middle of a request still names its blob; a load without checks reads the same."""
    piece = 8 << 20
    monkeypatch.setattr(tuning, "REMOTE_PIECE", piece)
    rng = np.random.default_rng(3)
    blobs = {f"layer{i:02d}": rng.standard_normal(190_000 + 17 * i) for i in range(12)}  # 1.5 MB each
    url = f"{where}/trainer_0.9"
    backend = get_db_type("native")
    size = backend.write(url, blobs)
    assert size > tuning.REMOTE_WHOLE
    names = sorted(blobs)
    fetched.clear()
    got = backend.read(url, names)
    assert all(got[n].tobytes() == blobs[n].tobytes() for n in names)
    data = [ranges for ranges, _ in fetched[1:]]  # (after the open's header + tail)
    assert all(len(r) == 1 for r in data)
    lengths = sorted(b - a for r in data for a, b in r)
    total = sum(v.nbytes for v in blobs.values())
    assert len(lengths) == 3 and max(lengths) <= piece  # 18 MB in 8 MiB requests, not 12
    assert total <= sum(lengths) < total + 12 * 64  # every byte once (and the paddings)
    starts = sorted(a for r in data for a, _ in r)
    ends = sorted(b for r in data for _, b in r)
    assert starts[1:] == ends[:-1]  # requests tile the data area
    fetched.clear()
    unchecked = backend.read(url, names, verify=False)
    assert all(unchecked[n].tobytes() == blobs[n].tobytes() for n in names)
    assert len(fetched) - 1 == 3
    middle = "layer05"  # inside the first request, neither at its start nor its end
    _flip(url, lambda d, b: d.find(b[middle].tobytes()) + 1000, blobs, 0x40)
    with pytest.raises(CheckpointCorruptError) as e:
        backend.read(url, names)
    assert url in str(e.value) and middle in str(e.value) and DAMAGED_DATA in str(e.value)
