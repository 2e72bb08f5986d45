"""Row blocks (epochal.integrations.dcp.blocks): a big saved chunk is several blobs along dim 0,
each with its own checksum, so a rank resharding on load reads only about its rows; damage in
a block is named and found before any live tensor changes; checkpoints without blocks load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402
from _dist_workers import run_ranks  # noqa: E402
from _dist_workers_blocks import BLOCK_BYTES, COLS, ROWS, big_full, blocks_load, blocks_save  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from epochal.errors import CheckpointCorruptError  # noqa: E402
from epochal.integrations.dcp import EpochalStorageReader, EpochalStorageWriter, blocks  # noqa: E402
from epochal.integrations.dcp.metadata_json import metadata_from_json  # noqa: E402
from epochal.storage.formats.native.reader import NativeFile  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to")  # DCP without a process group

CHUNK_BYTES = ROWS // 2 * COLS * 4  # one of the 2 saving ranks' chunk of w
BLOCK_ROWS = -(-BLOCK_BYTES // (COLS * 4))  # 132


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Step 0 of a (3000, 1000) float32 parameter sharded on dim 0 by 2 ranks (6 MB chunks,
    blocks of 132 rows), plus a small sharded tensor and a plain value."""
    path = tmp_path_factory.mktemp("blocks") / "ckpt"
    run_ranks(blocks_save, 2, str(path))
    return path


def _results(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _metadata(path: Path) -> tuple[str, Any]:
    with NativeFile(str(path / "dcp.0")) as f:
        text = f["metadata"]
    return text, metadata_from_json(text, str(path / "dcp.0"))


def test_big_chunks_are_stored_as_checked_row_blocks(saved: Path) -> None:
    text, md = _metadata(saved)
    assert json.loads(text)["version"] == 2
    locs = {idx.offset[0]: loc for idx, loc in md.storage_data.items() if idx.fqn == "w"}
    assert sorted(locs) == [0, 1500]
    for r, (first, loc) in enumerate(sorted(locs.items())):
        assert loc.rows == BLOCK_ROWS and loc.blob == f"w@{first},0" and loc.db == f"rank{r}.0"
        assert loc.length == CHUNK_BYTES
        with NativeFile(str(saved / f"rank{r}.0")) as f:
            names = [n for n in f.names() if n.startswith("w@")]
            nblocks = -(-1500 // BLOCK_ROWS)  # 12: eleven of 132 rows, the last of 48
            assert sorted(names) == sorted(f"w@{first},0#b{k}" for k in range(nblocks))
            for k in range(nblocks):
                got = f[f"w@{first},0#b{k}"]
                lo = first + k * BLOCK_ROWS
                want = big_full()[lo:min(lo + BLOCK_ROWS, first + 1500)]
                assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # the small tensor's chunks stay one blob each, with no rows field
    small = [loc for idx, loc in md.storage_data.items() if idx.fqn == "small"]
    assert len(small) == 2 and all(loc.rows == 0 for loc in small)


def test_two_to_four_reads_about_each_ranks_share_bit_equal(saved: Path, tmp_path: Path) -> None:
    run_ranks(blocks_load, 4, str(saved), str(tmp_path))
    for r, res in enumerate(_results(tmp_path, 4)):
        assert res["error"] is None
        w_reads = [(file, blob, n) for file, blob, n in res["reads"] if blob.startswith("w@")]
        # rank r's rows are in rank (r // 2)'s chunk, and only there
        assert {file for file, _, _ in w_reads} == {f"rank{r // 2}.0"}
        read = sum(n for _, _, n in w_reads)
        share = CHUNK_BYTES // 2
        assert share <= read < 0.6 * CHUNK_BYTES, (r, read, CHUNK_BYTES)
        assert len({blob for _, blob, _ in w_reads}) == len(w_reads)  # no block read twice


def _flip(db: Path, block: torch.Tensor) -> None:
    raw = bytearray(db.read_bytes())
    at = raw.find(block.numpy().tobytes())
    assert at > 0
    raw[at + 77] ^= 0x20
    db.write_bytes(bytes(raw))


def test_flipped_byte_in_a_partly_wanted_block_is_named_and_nothing_restored(saved: Path, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    # block 5 of rank 0's chunk (rows 660..791): rank 0 of 4 wants 660..749, rank 1 750..791
    _flip(path / "rank0.0", big_full()[5 * BLOCK_ROWS:6 * BLOCK_ROWS])
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(blocks_load, 4, str(path), str(out))  # (each rank catches its load's error)
    res = _results(out, 4)
    for r in (0, 1):  # (each checked in its process that its live shard is still untouched)
        assert res[r]["error"]["path"] == "rank0.0" and res[r]["error"]["blob"] == "w@0,0#b5", res[r]
        assert "rank0.0" in res[r]["error"]["text"] and "w@0,0#b5" in res[r]["error"]["text"]
    for r in (2, 3):  # their own reads were intact; the collective load failed for them too
        assert res[r]["error"] == {"other": True}


@pytest.mark.parametrize("cached", [True, False], ids=["mapped", "read"])
def test_columns_reshard_each_block_partly_wanted_and_damage_named_first(saved: Path, tmp_path: Path,
                                                                         cached: bool) -> None:
    """2 -> 2 ranks, ``w`` resharded on dim 1: every rank wants half the columns of every
    block of both dbs. A cached file's blocks are verified on a map and their columns copied
    out of it (``mapped``), a cold one's read into fresh memory; either way each block is
    read once, the shards load bit-equal, and a flipped byte in one block is named by both
    ranks, every live shard still as it was (checked in each rank's process)."""
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(blocks_load, 2, str(saved), str(out), 1, cached)
    nblocks = -(-1500 // BLOCK_ROWS)
    blocks_w = {f"w@{first},0#b{k}" for first in (0, 1500) for k in range(nblocks)}
    for res in _results(out, 2):
        assert res["error"] is None
        w_reads = [blob for _, blob, _ in res["reads"] if blob.startswith("w@")]
        assert sorted(w_reads) == sorted(blocks_w)  # every block, each once
        assert set(res["mapped"]) == (blocks_w if cached else set())
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    _flip(path / "rank1.0", big_full()[1500 + 7 * BLOCK_ROWS:1500 + 8 * BLOCK_ROWS])
    bad = tmp_path / "bad"
    bad.mkdir()
    run_ranks(blocks_load, 2, str(path), str(bad), 1, cached)
    for res in _results(bad, 2):
        assert res["error"]["path"] == "rank1.0" and res["error"]["blob"] == "w@1500,0#b7", res
        assert "rank1.0" in res["error"]["text"] and "w@1500,0#b7" in res["error"]["text"]
        # rank0.0's blocks verified on their map first, intact; rank1.0's raised
        assert set(res["mapped"]) == ({b for b in blocks_w if b.startswith("w@0,")} if cached else set())


def test_flipped_byte_in_another_db_raises_before_any_live_write(saved: Path, tmp_path: Path) -> None:
    """One process loads the whole parameter: rank 0's blocks are read straight into the live
    tensor, rank 1's verified first; a damaged block there leaves the live tensor as it was."""
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    _flip(path / "rank1.0", big_full()[1500 + 3 * BLOCK_ROWS:1500 + 4 * BLOCK_ROWS])
    sd = {"w": torch.full((ROWS, COLS), 7.0), "small": torch.zeros(12, dtype=torch.float64), "step": 0}
    with pytest.raises(CheckpointException) as ei:
        dcp.load(sd, storage_reader=EpochalStorageReader(str(path)))
    err = next(iter(ei.value.failures.values()))[0]
    assert isinstance(err, CheckpointCorruptError)
    assert err.path == str(path / "rank1.0") and err.blob == "w@1500,0#b3"
    assert bool((sd["w"] == 7.0).all()) and bool((sd["small"] == 0).all()) and sd["step"] == 0
    # the intact checkpoint loads whole, bit-equal
    dcp.load(sd, storage_reader=EpochalStorageReader(str(saved)))
    assert torch.equal(sd["w"].view(torch.int32), big_full().view(torch.int32))
    assert torch.equal(sd["small"], torch.arange(12, dtype=torch.float64)) and sd["step"] == 3


def test_a_checkpoint_without_blocks_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written as before row blocks (the threshold patched off): version 1, one blob a chunk;
    it loads whole in one process and resharded into 4 ranks."""
    monkeypatch.setattr(blocks, "BLOCK_MIN", 1 << 60)
    path = tmp_path / "ckpt"
    full = big_full()
    dcp.save({"w": full, "small": torch.arange(12, dtype=torch.float64), "step": 3},
             storage_writer=EpochalStorageWriter(str(path), step=0))
    text, md = _metadata(path)
    assert json.loads(text)["version"] == 1 and '"rows"' not in text
    with NativeFile(str(path / "rank0.0")) as f:
        assert "w@0,0" in f.names() and not any("#b" in n for n in f.names())
    sd = {"w": torch.zeros(ROWS, COLS), "small": torch.zeros(12, dtype=torch.float64), "step": 0}
    dcp.load(sd, storage_reader=EpochalStorageReader(str(path)))
    assert torch.equal(sd["w"].view(torch.int32), full.view(torch.int32)) and sd["step"] == 3
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(blocks_load, 4, str(path), str(out))
    for res in _results(out, 4):  # (each rank checked its rows) the one chunk read whole
        assert res["error"] is None
        assert [(b, n) for _, b, n in res["reads"] if b.startswith("w@")] == [("w@0,0", ROWS * COLS * 4)]


def test_one_row_and_one_dim_chunks(tmp_path: Path) -> None:
    """A 1-row chunk stays one blob; a 1-D one is split into blocks of elements; both load."""
    g = torch.Generator().manual_seed(3)
    one_row = torch.randn(1, 1_500_000, generator=g)
    flat = torch.randn(1_500_000, generator=g)
    path = tmp_path / "ckpt"
    dcp.save({"r": one_row, "f": flat}, storage_writer=EpochalStorageWriter(str(path), step=0))
    with NativeFile(str(path / "rank0.0")) as f:
        names = set(f.names())
    per = -(-blocks.BLOCK_BYTES // 4)
    assert "r@0,0" in names and not any(n.startswith("r@") and "#b" in n for n in names)
    assert {n for n in names if n.startswith("f@")} == {f"f@0#b{k}" for k in range(-(-1_500_000 // per))}
    sd = {"r": torch.zeros(1, 1_500_000), "f": torch.zeros(1_500_000)}
    dcp.load(sd, storage_reader=EpochalStorageReader(str(path)))
    assert torch.equal(sd["r"].view(torch.int32), one_row.view(torch.int32))
    assert torch.equal(sd["f"].view(torch.int32), flat.view(torch.int32))


def test_non_contiguous_tensors_round_trip(tmp_path: Path) -> None:
    """A transposed (non-contiguous) parameter is saved as blocks of its rows (views, the
    codec lays each out) and loaded into a non-contiguous live tensor, bit-equal."""
    base = big_full()
    t = base.t()  # (1000, 3000), not contiguous
    assert not t.is_contiguous()
    path = tmp_path / "ckpt"
    dcp.save({"t": t}, storage_writer=EpochalStorageWriter(str(path), step=0))
    _, md = _metadata(path)
    (loc,) = md.storage_data.values()
    assert loc.rows == -(-blocks.BLOCK_BYTES // (3000 * 4)) and loc.rows < 1000
    live = torch.zeros(ROWS, COLS).t()  # (1000, 3000), not contiguous
    assert not live.is_contiguous()
    dcp.load({"t": live}, storage_reader=EpochalStorageReader(str(path)))
    assert torch.equal(live.contiguous().view(torch.int32), t.contiguous().view(torch.int32))


def test_blocks_over_a_row_range() -> None:
    got = list(blocks.blocks_over("w@0,0", 132, 1500, 700, 1000))
    assert [(b.blob, b.first, b.count, b.at, b.whole) for b in got] == [
        ("w@0,0#b5", 40, 92, 0, False), ("w@0,0#b6", 0, 132, 92, True),
        ("w@0,0#b7", 0, 76, 224, False)]
    last = list(blocks.blocks_over("w@0,0", 132, 1500, 1400, 1500))
    assert [(b.blob, b.first, b.count, b.whole) for b in last] == [("w@0,0#b10", 80, 52, False),
                                                                    ("w@0,0#b11", 0, 48, True)]
    with pytest.raises(ValueError):
        list(blocks.blocks_over("w@0,0", 132, 1500, 0, 1501))


def test_metadata_rows_field_needs_version_2(saved: Path) -> None:
    text, _ = _metadata(saved)
    doc = json.loads(text)
    doc["version"] = 1
    with pytest.raises(CheckpointCorruptError, match="rows per block"):
        metadata_from_json(json.dumps(doc), "dcp.0")
    doc["version"] = 3
    with pytest.raises(CheckpointCorruptError, match="version 3"):
        metadata_from_json(json.dumps(doc), "dcp.0")


def test_a_url_checkpoint_with_blocks_loads_and_damage_is_found_first(saved: Path, tmp_path: Path) -> None:
    """The 2-rank step copied to memory://: loaded whole in one process (rank0's blocks by
    its in-place read, fetched once; rank1's held), bit-equal; then a flipped byte in one of
    rank1's blocks raises, naming it, before the live tensor changed."""
    import secrets

    import fsspec

    fs = fsspec.filesystem("memory")
    url = f"memory://blocks-{secrets.token_hex(4)}/ckpt"
    for p in sorted(saved.rglob("*")):
        if p.is_file():
            fs.pipe(f"{url}/{p.relative_to(saved).as_posix()}", p.read_bytes())
    sd = {"w": torch.full((ROWS, COLS), 7.0), "small": torch.zeros(12, dtype=torch.float64), "step": 0}
    dcp.load(sd, storage_reader=EpochalStorageReader(url))
    assert torch.equal(sd["w"].view(torch.int32), big_full().view(torch.int32)) and sd["step"] == 3
    raw = bytearray(fs.cat(f"{url}/rank1.0"))
    at = raw.find(big_full()[1500 + 2 * BLOCK_ROWS:1500 + 3 * BLOCK_ROWS].numpy().tobytes())
    assert at > 0
    raw[at + 11] ^= 0x04
    fs.pipe(f"{url}/rank1.0", bytes(raw))
    sd["w"].fill_(7.0)
    with pytest.raises(CheckpointException) as ei:
        dcp.load(sd, storage_reader=EpochalStorageReader(url))
    err = next(iter(ei.value.failures.values()))[0]
    assert isinstance(err, CheckpointCorruptError) and err.blob == "w@1500,0#b2" and "rank1.0" in str(err)
    assert bool((sd["w"] == 7.0).all())
