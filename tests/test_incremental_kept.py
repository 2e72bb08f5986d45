"""Incremental saves compare with the bytes the last save kept, not with the base file read
back: no byte of the base is read while its file and the files it references are the ones
that save wrote; one replaced or rewritten behind the process, a failed save, or chunks past
the memory bound, and the base is read as before. Every step restores bit-exact in a fresh
process and verifies."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import epochal as ep
from epochal.storage.formats.native import incremental
from epochal.storage.io.extents import sink

pytestmark = pytest.mark.unit

ROWS, DIM = 8192, 512  # a 16 MiB float32 table, 2 KiB rows: four content chunks
TABLE = ROWS * DIM * 4


def _table(step: int, salt: int = 0) -> np.ndarray:
    """The table at ``step``: 2% of its rows (fixed by the step and ``salt``) changed per step."""
    emb = np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)
    for s in range(1, step + 1):
        rows = np.random.default_rng(s + 1000 * salt * (s == step)).choice(ROWS, ROWS // 50, replace=False)
        emb[rows] += np.float32(s)
    return emb


RESTORE = textwrap.dedent("""
    import sys, numpy as np, epochal as ep
    d, step = sys.argv[1], int(sys.argv[2])
    st = {"emb": np.zeros((ROWS, DIM), np.float32)}
    with ep.Checkpointer(d, progress=False) as ck:
        got = ck.restore(st, step=step)
    np.save(sys.argv[3], st["emb"])
    print(got)
""").replace("ROWS", str(ROWS)).replace("DIM", str(DIM))


def _restore_fresh(d: Path, step: int, tmp: Path) -> np.ndarray:
    script = tmp / "restore.py"
    script.write_text(RESTORE)
    out = tmp / f"r{step}.npy"
    p = subprocess.run([sys.executable, str(script), str(d), str(step), str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == str(step), p.stderr
    return np.load(out)


def _verify(d: Path) -> None:
    v = subprocess.run([sys.executable, "-m", "epochal", "verify", str(d)], capture_output=True, text=True,
                       timeout=120)
    assert v.returncode == 0, v.stdout + v.stderr


@pytest.fixture
def reads(monkeypatch):
    """The bytes each save reads back from its base file (a list, one total per save)."""
    got: list[int] = []
    read = incremental._Base.read

    def counted(self, loff, length):
        got[-1] += length
        return read(self, loff, length)

    monkeypatch.setattr(incremental._Base, "read", counted)
    return got


def _save(ck: ep.Checkpointer, reads: list[int], step: int, emb: np.ndarray) -> int:
    reads.append(0)
    ck.save(step, {"emb": emb})
    return reads[-1]


@pytest.mark.system
def test_saves_compare_with_the_kept_bytes_and_read_nothing_of_the_base(tmp_path, reads):
    d = tmp_path / "ck"
    with ep.Checkpointer(str(d), incremental=True, progress=False) as ck:
        got = [_save(ck, reads, s, _table(s)) for s in range(1, 5)]
    assert got == [0, 0, 0, 0]  # (step 1 has no base; steps 2-4 compare in memory)
    for s in (2, 3, 4):
        assert os.path.getsize(d / f"local.{s}") < TABLE // 20, s  # only the changed rows stored
    for s in (1, 2, 3, 4):
        assert _restore_fresh(d, s, tmp_path).tobytes() == _table(s).tobytes(), s
    _verify(d)


@pytest.mark.system
@pytest.mark.parametrize("how", ["base replaced", "referenced file rewritten", "base not the last saved"])
def test_a_base_changed_behind_the_process_is_read_not_trusted(tmp_path, reads, how):
    d, other = tmp_path / "ck", tmp_path / "other"
    with ep.Checkpointer(str(d), incremental=True, progress=False) as ck:
        assert _save(ck, reads, 1, _table(1)) == 0
        assert _save(ck, reads, 2, _table(2)) == 0
        if how == "base replaced":
            # another writer's step 2 (other rows changed) takes the place of this one's: bytes the
            # kept copy holds are not in the file any more
            with ep.Checkpointer(str(other), incremental=True, progress=False) as ck2:
                ck2.save(1, {"emb": _table(1)})
                ck2.save(2, {"emb": _table(2, salt=1)})
            assert (other / "local.1").read_bytes() == (d / "local.1").read_bytes()
            os.replace(other / "local.2", d / "local.2")
        elif how == "referenced file rewritten":
            time.sleep(0.05)  # (past the file system's clock tick)
            with open(d / "local.1", "r+b") as f:  # the same bytes written again, in place
                head = f.read(4096)
                f.seek(0)
                f.write(head)
        else:  # a newer step saved last: the base of step 3 is step 2, the kept bytes step 5's
            five = _table(2)
            five[ROWS // 2:] += np.float32(9)
            assert _save(ck, reads, 5, five) == 0
        step3 = _table(2).copy()
        step3[: ROWS // 4] += np.float32(7)  # the rows the other step 2 changed are back as before
        assert _save(ck, reads, 3, step3) == TABLE, how  # the base was read, every chunk of it
    assert _restore_fresh(d, 3, tmp_path).tobytes() == step3.tobytes()


@pytest.mark.system
def test_a_failed_save_leaves_no_kept_bytes(tmp_path, reads, monkeypatch):
    d = tmp_path / "ck"
    commit = sink.ExtentSink.commit
    with ep.Checkpointer(str(d), incremental=True, progress=False) as ck:
        assert _save(ck, reads, 1, _table(1)) == 0
        assert _save(ck, reads, 2, _table(2)) == 0

        def fail(self):
            raise OSError("disk full")

        monkeypatch.setattr(sink.ExtentSink, "commit", fail)
        with pytest.raises(OSError, match="disk full"):
            _save(ck, reads, 3, _table(3))  # (its chunks were compared, the kept copy updated)
        monkeypatch.setattr(sink.ExtentSink, "commit", commit)
        assert _save(ck, reads, 3, _table(3)) == TABLE  # read: the kept bytes were step 3's
        assert _save(ck, reads, 4, _table(4)) == 0
    for s in (3, 4):
        assert _restore_fresh(d, s, tmp_path).tobytes() == _table(s).tobytes(), s
    _verify(d)


@pytest.mark.system
def test_chunks_past_the_memory_bound_are_read(tmp_path, reads):
    from epochal import knobs

    d = tmp_path / "ck"
    with knobs.override(kept_bytes=2 * incremental.CHUNK_BYTES):
        with ep.Checkpointer(str(d), incremental=True, progress=False) as ck:
            got = [_save(ck, reads, s, _table(s)) for s in range(1, 4)]
    assert got == [0, TABLE - 2 * incremental.CHUNK_BYTES, TABLE - 2 * incremental.CHUNK_BYTES]
    assert _restore_fresh(d, 3, tmp_path).tobytes() == _table(3).tobytes()
    with knobs.override(kept_bytes=0):  # none kept: every save reads its base whole
        with ep.Checkpointer(str(tmp_path / "none"), incremental=True, progress=False) as ck:
            got = [_save(ck, reads, s, _table(s)) for s in range(1, 4)]
    assert got == [0, TABLE, TABLE]


@pytest.mark.system
def test_background_saves_compare_with_the_kept_bytes(tmp_path, reads):
    d = tmp_path / "ck"
    with ep.Checkpointer(str(d), incremental=True, async_save=True, progress=False) as ck:
        for s in range(1, 4):
            _save(ck, reads, s, _table(s))
            ck.wait()  # (each background write counted as its own save's)
    assert reads == [0, 0, 0]
    assert os.path.getsize(d / "local.3") < TABLE // 20
    assert _restore_fresh(d, 3, tmp_path).tobytes() == _table(3).tobytes()


@pytest.mark.system
def test_dcp_saves_compare_with_the_kept_bytes_of_the_writer_and_restore_bit_exact(tmp_path, reads):
    """Under ``dcp.save`` (one process, no process group; each rank does the same with its
    own db): an incremental writer keeps its chunks as the Checkpointer does, so no byte of
    the base is read after the first save; a writer made per save gets them from its saver
    (``kept=``); every step restores bit-equal."""
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    import warnings

    import torch.distributed.checkpoint as dcp

    from epochal.integrations.dcp import EpochalStorageReader, EpochalStorageWriter
    from epochal.storage.formats.native.kept import KeptBytes

    d = tmp_path / "dcp"
    kept = KeptBytes()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        for step in range(1, 5):
            reads.append(0)
            w = EpochalStorageWriter(d, step=step, incremental=True, kept=kept)  # (a new writer per save)
            dcp.save({"emb": torch.from_numpy(_table(step))}, storage_writer=w)
        assert reads == [0, 0, 0, 0]  # step 1 has no base; steps 2-4 compare with the kept chunks
        sizes = {f: os.path.getsize(d / f) for f in os.listdir(d) if f.startswith("rank0")}
        assert max(sizes.values()) > TABLE and sorted(sizes.values())[0] < TABLE // 20, sizes
        for step in (2, 4):
            live = {"emb": torch.zeros(ROWS, DIM)}
            dcp.load(live, storage_reader=EpochalStorageReader(d, step=step))
            assert live["emb"].numpy().tobytes() == _table(step).tobytes(), step
        reads.append(0)  # a writer without a saver's kept bytes: its own, empty at first
        dcp.save({"emb": torch.from_numpy(_table(5))},
                 storage_writer=EpochalStorageWriter(d, step=5, incremental=True))
        assert reads[-1] == TABLE  # the base read whole, compared as before
    _verify(d)


NODE_JOB_ROWS = 4096  # per node: an 8 MiB table of 2 KiB rows (two content chunks)


def _node_job(d: Path, epochs: int, ws: Any) -> int:
    """A JobRunner job of two nodes, each with a table of which 2% of the rows change per
    epoch, saved by a MultiNodeCheckpointManager with incremental dbs."""
    from epochal import (
        Cluster,
        DirectoryMetadataHandler,
        Job,
        JobRunner,
        LocalSession,
        MultiNodeCheckpointManager,
        Node,
        Task,
        epoch_limiter,
    )

    def init(w: Any) -> None:
        for node in ("n0", "n1"):
            w[f"{node}/emb"] = _table(0)[:NODE_JOB_ROWS].copy()
            w[f"{node}/epoch"] = np.int64(0)

    def step(node: str) -> Any:
        def run(w: Any) -> None:
            e = int(w[f"{node}/epoch"]) + 1
            emb = w[f"{node}/emb"].copy()
            emb[np.random.default_rng(e + 100 * (node == "n1")).choice(NODE_JOB_ROWS, NODE_JOB_ROWS // 50,
                                                                          replace=False)] += np.float32(e)
            w[f"{node}/emb"], w[f"{node}/epoch"] = emb, np.int64(e)
        return run

    with Cluster():
        with Job(nodes_to_checkpoint=["n0", "n1"]) as job:
            with Node("n0"):
                with job.init_group:
                    Task(step=init)
                epoch_limiter(job, epochs)
                Task(step=step("n0"))
            with Node("n1"):
                Task(step=step("n1"))
        manager = MultiNodeCheckpointManager(str(d), "native",
                                             metadata_handler=DirectoryMetadataHandler(incremental=True))
        return JobRunner(job, manager, progress=False).train(LocalSession(ws))


def test_the_job_runners_nodes_compare_with_their_kept_bytes(tmp_path, reads, monkeypatch):
    from epochal import CheckpointDirectory, Workspace
    from epochal.storage.formats.native import kept

    write = incremental.write_incremental

    def counted(*args: Any, **kwargs: Any) -> int:
        reads.append(0)  # (one total per save: the fixture adds to the last)
        return write(*args, **kwargs)

    monkeypatch.setattr(incremental, "write_incremental", counted)
    d = tmp_path / "ck"
    ws = Workspace()
    assert _node_job(d, 4, ws) == 4
    # epochs 0..4, two nodes: each save after a node's first compared with its kept bytes
    assert len(reads) == 10 and reads == [0] * 10, reads
    assert not kept._NODES  # freed as train ended
    assert CheckpointDirectory(str(d)).committed_epochs() == [0, 1, 2, 3, 4]
    # the same directory resumed by a new train(): its first save of each node reads its base
    # (nothing kept across runs), the next ones do not
    reads.clear()
    assert _node_job(d, 6, ws) == 6
    assert len(reads) == 4 and all(r > 0 for r in reads[:2]) and reads[2:] == [0, 0], reads
    # each node's db of the last epoch (the seed's nodes each save the whole blob list): the
    # tables the nodes had, read in a fresh process
    want = {f"{node}/emb": ws[f"{node}/emb"] for node in ("n0", "n1")}
    dbs = sorted(str(p) for p in d.rglob("*.6") if p.is_file())
    assert [os.path.basename(p) for p in dbs] == ["n0.6", "n1.6"], dbs
    code = ("import sys, numpy as np\nfrom epochal.storage.formats.base import get_db_type\n"
            "for i, path in enumerate(sys.argv[2:]):\n"
            "    got = get_db_type('native').read(path)\n"
            "    np.savez(f'{sys.argv[1]}/{i}.npz', **{k.replace('/', '_'): got[k] for k in ('n0/emb', 'n1/emb')})\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path), *dbs], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for i in range(2):
        got = np.load(tmp_path / f"{i}.npz")
        assert all(got[k.replace("/", "_")].tobytes() == want[k].tobytes() for k in want), dbs[i]
    _verify(d)
