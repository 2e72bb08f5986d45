"""torch.distributed.checkpoint with epochal's storage (epochal.integrations.dcp): 2 gloo ranks
on CPU, resharding 2 -> 1 and 1 -> 2, no unpickling on load, damage found and named."""

from __future__ import annotations

import _pickle
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402
from _dist_workers import dcp_load_two_ranks, dcp_two_ranks, full_state, run_ranks  # noqa: E402
from _torch_bits import bits  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.errors import CheckpointCorruptError, UnsupportedBlobError  # noqa: E402
from epochal.integrations.dcp import EpochalStorageReader, EpochalStorageWriter  # noqa: E402
from epochal.storage.formats.native.reader import NativeFile  # noqa: E402

pytestmark = [pytest.mark.slow,  # spawns gloo ranks and the CLI
              pytest.mark.filterwarnings("ignore:.*assuming the intent is to")]  # DCP without a process group

EPOCHAL = [sys.executable, "-m", "epochal"]


@pytest.fixture(scope="module")
def two_rank_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Step 0 saved by 2 ranks (w sharded on dim 0, b a replicated DTensor, h a plain tensor,
    two plain values); each rank also loaded it back (same layout and w resharded on dim 1)
    with pickle.load/loads and torch.load made to raise, checking every bit."""
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    run_ranks(dcp_two_ranks, 2, str(path))
    return path


def _no_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any, **__: Any) -> Any:
        raise AssertionError("unpickling on a load path")

    for mod in (pickle, _pickle):  # (one process: no collective needs an Unpickler either)
        for name in ("load", "loads", "Unpickler"):
            monkeypatch.setattr(mod, name, boom)
    monkeypatch.setattr(torch, "load", boom)


def _failure(ex: BaseException) -> BaseException:
    """DCP wraps each rank's exception in a CheckpointException: the first rank's."""
    assert isinstance(ex, CheckpointException), ex
    return next(iter(ex.failures.values()))[0]


def _plain(full: dict[str, Any], zero: bool) -> dict[str, Any]:
    def z(t: Any) -> Any:
        return torch.zeros_like(t) if zero else t.clone()

    return {"w": z(full["w"]), "b": z(full["b"]), "h": z(full["h"]),
            "step": 0 if zero else 5, "cfg": {"lr": 0.0, "names": []} if zero else {"lr": 0.25, "names": ["a", "b"]}}


def test_two_ranks_write_their_shards_once_and_commit_one_step(two_rank_ckpt: Path) -> None:
    d = CheckpointDirectory(str(two_rank_ckpt))
    assert d.committed_epochs() == [0]
    assert sorted(d.read_manifest(0).nodes) == ["dcp", "rank0", "rank1"]
    names = {}
    for r in (0, 1):
        with NativeFile(str(two_rank_ckpt / f"rank{r}.0")) as f:
            names[r] = set(f.names())
    # each rank wrote only its rows of w; replicated b and h once, plain values once
    assert "w@0,0" in names[0] and "w@4,0" in names[1]
    assert "w@4,0" not in names[0] and "w@0,0" not in names[1]
    every = sorted(names[0] | names[1])
    assert sorted([*names[0], *names[1]]) == every  # nothing written twice
    assert {"b@0", "h@0,0", "step", "cfg.lr", "cfg.names"} <= set(every)
    with NativeFile(str(two_rank_ckpt / "rank1.0")) as f:
        assert bits(f["w@4,0"]) == bits(full_state()["w"][4:])
    # the metadata is JSON text in a checksummed db, not a pickle
    with NativeFile(str(two_rank_ckpt / "dcp.0")) as f:
        text = f["metadata"]
    assert isinstance(text, str) and text.startswith('{"format":"epochal-dcp-metadata"')


def test_two_to_one_loads_bit_equal_without_unpickling(two_rank_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_pickle(monkeypatch)
    sd = _plain(full_state(), zero=True)
    dcp.load(sd, storage_reader=EpochalStorageReader(str(two_rank_ckpt)))
    for k, t in full_state().items():
        assert sd[k].dtype == t.dtype and bits(sd[k]) == bits(t), k
    assert sd["step"] == 5 and sd["cfg"] == {"lr": 0.25, "names": ["a", "b"]}


def test_one_to_two_loads_bit_equal_shards(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sd = _plain(full_state(2.0), zero=False)
    w = EpochalStorageWriter(str(path), step=3)
    dcp.save(sd, storage_writer=w)
    assert w.committed == 3 and CheckpointDirectory(str(path)).committed_epochs() == [3]
    dcp.save(_plain(full_state(), zero=False), storage_writer=EpochalStorageWriter(str(path)))  # step 4
    assert CheckpointDirectory(str(path)).committed_epochs() == [3, 4]
    run_ranks(dcp_load_two_ranks, 2, str(path), 3)


def test_two_to_four_loads_bit_equal_shards(two_rank_ckpt: Path) -> None:
    run_ranks(dcp_load_two_ranks, 4, str(two_rank_ckpt), 0, 1.0, 0)


def test_flipped_byte_raises_corrupt_naming_file_and_item(two_rank_ckpt: Path, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(two_rank_ckpt, path)
    db = path / "rank1.0"
    raw = bytearray(db.read_bytes())
    at = raw.find(bits(full_state()["w"][4:]))
    assert at > 0
    raw[at + 5] ^= 0x10
    db.write_bytes(bytes(raw))
    sd = _plain(full_state(), zero=True)
    before = bits(sd["w"])
    with pytest.raises(CheckpointException) as ei:
        dcp.load(sd, storage_reader=EpochalStorageReader(str(path)))
    err = _failure(ei.value)
    assert isinstance(err, CheckpointCorruptError)
    assert err.path == str(db) and err.blob == "w@4,0"
    assert "rank1.0" in str(err) and "w@4,0" in str(err)
    assert bits(sd["w"][4:]) == before[len(before) // 2:]  # the damaged rows never reached w
    out = subprocess.run([*EPOCHAL, "verify", str(path)], capture_output=True, text=True)
    assert out.returncode != 0 and "rank1.0" in out.stdout + out.stderr


def test_epochal_tools_read_the_result(two_rank_ckpt: Path) -> None:
    env = {**os.environ}
    ls = subprocess.run([*EPOCHAL, "ls", str(two_rank_ckpt)], capture_output=True, text=True, env=env)
    assert ls.returncode == 0 and "committed" in ls.stdout and "rank1" in ls.stdout
    ver = subprocess.run([*EPOCHAL, "verify", str(two_rank_ckpt)], capture_output=True, text=True, env=env)
    assert ver.returncode == 0, ver.stdout + ver.stderr
    assert "all 3 db file(s) intact" in ver.stdout
    ins = subprocess.run([*EPOCHAL, "inspect", str(two_rank_ckpt / "rank1.0")], capture_output=True, text=True)
    assert ins.returncode == 0 and "w@4,0" in ins.stdout


def test_a_value_no_codec_stores_is_named_and_nothing_committed(tmp_path: Path) -> None:
    class Opaque:
        pass

    path = tmp_path / "ckpt"
    with pytest.raises(CheckpointException) as ei:
        dcp.save({"w": torch.ones(2), "opaque": Opaque()}, storage_writer=EpochalStorageWriter(str(path)))
    err = _failure(ei.value)
    assert isinstance(err, UnsupportedBlobError) and "'opaque'" in str(err), err
    assert CheckpointDirectory(str(path)).committed_epochs() == []


def test_a_committed_step_is_never_replaced(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(2)}, storage_writer=EpochalStorageWriter(path, step=1))
    with pytest.raises(CheckpointException) as ei:
        dcp.save({"w": torch.zeros(2)}, storage_writer=EpochalStorageWriter(path, step=1))
    assert "already committed" in str(_failure(ei.value))
    sd = {"w": torch.zeros(2)}
    dcp.load(sd, storage_reader=EpochalStorageReader(path))
    assert sd["w"].tolist() == [1.0, 1.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the CUDA path "
                    "(chunks copied to the host on save, into the live CUDA tensor on load) is not run")
def test_cuda_tensors_round_trip_bit_equal(tmp_path: Path) -> None:  # pragma: no cover - needs a GPU
    path = str(tmp_path / "ckpt")
    src = {k: v.cuda() for k, v in full_state().items()}
    dcp.save(src, storage_writer=EpochalStorageWriter(path))
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    dcp.load(dst, storage_reader=EpochalStorageReader(path))
    for k, v in src.items():
        assert dst[k].is_cuda and bits(dst[k].cpu()) == bits(v.cpu()), k


def test_an_incremental_save_lists_the_records_once_and_reads_one_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One process, a long history: each incremental save finds its base with one listing of
    the records and one manifest read (the newest committed step before it), not a read of
    every manifest; the location is marked incremental once per writer. Every step restores
    bit-equal, and each later db stores a fraction of the state (its base found)."""
    from epochal.checkpoint.location.view import CheckpointDirectory as View

    calls = {"files": 0, "read_manifest": 0}
    real_epochs, real_read, real_has = View.manifest_epochs, View.read_manifest, View.has_incremental

    def epochs(self: Any) -> list[int]:
        calls["files"] += 1
        return real_epochs(self)

    def read(self: Any, epoch: int) -> Any:
        calls["read_manifest"] += 1
        return real_read(self, epoch)

    def has(self: Any) -> bool:
        calls["files"] += 1
        return real_has(self)

    path = tmp_path / "ckpt"
    w = EpochalStorageWriter(path, incremental=True)
    base = torch.randn(256, 1024)
    states = []
    for step in range(8):
        if step == 7:
            monkeypatch.setattr(View, "manifest_epochs", epochs)
            monkeypatch.setattr(View, "read_manifest", read)
            monkeypatch.setattr(View, "has_incremental", has)
        state = {"base": base, "adapter": torch.full((64,), float(step)), "step": step}
        states.append({k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()})
        w.step = step
        w.reset()
        before = dict(calls)
        dcp.save(state, storage_writer=w)
        if step == 7:
            writes = {k: calls[k] - before[k] for k in calls}
    # the save of step 7 (seven committed before it): the db's base from one listing and one
    # manifest (the commit's own bookkeeping lists and reads on top: counted apart below)
    d = CheckpointDirectory(str(path))
    assert d.committed_epochs() == list(range(8))
    sizes = [sum(os.path.getsize(d.db_path(n, s)) for n in d.read_manifest(s).nodes) for s in range(8)]
    assert all(s < sizes[0] // 4 for s in sizes[1:]), sizes
    monkeypatch.undo()
    for step in (0, 3, 7):
        live = {"base": torch.zeros(256, 1024), "adapter": torch.zeros(64), "step": -1}
        dcp.load(live, storage_reader=EpochalStorageReader(path, step=step))
        assert bits(live["base"]) == bits(states[step]["base"]) and live["step"] == step
        assert bits(live["adapter"]) == bits(states[step]["adapter"])
    # (the commit itself: one listing and two manifest reads, whatever the history)
    assert writes["files"] <= 2 and writes["read_manifest"] <= 3, writes
