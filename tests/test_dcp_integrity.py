"""``dcp.save``/``dcp.load`` through epochal's storage keep the load promise and the one-writer
rule: every db is checked against its manifest (size, digest) before any byte reaches a live
tensor, and a second job saving into the same directory fails at once, naming the holder,
while the first one's committed step stays what it wrote. Loads run in fresh processes."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import _fresh  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from epochal import Checkpointer  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.integrations.dcp import EpochalStorageWriter  # noqa: E402

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore:.*assuming the intent is to")]

#: a fresh process loading step ``step`` of ``path`` into zeros: prints what happened as JSON
LOAD = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed.checkpoint as dcp
    from epochal.integrations.dcp import EpochalStorageReader
    sd = {"w": torch.zeros(64, 8), "b": torch.zeros(8), "step": 0}
    before = [sd["w"].clone(), sd["b"].clone()]
    error = None
    try:
        dcp.load(sd, storage_reader=EpochalStorageReader(sys.argv[1], step=int(sys.argv[2])))
    except BaseException as ex:  # (DCP's CheckpointException is a BaseException)
        cause = next(iter(ex.failures.values()))[0] if hasattr(ex, "failures") else ex
        error = f"{type(cause).__name__}: {cause}"
    print(json.dumps({"error": error, "untouched": torch.equal(sd["w"], before[0]) and torch.equal(sd["b"], before[1]),
                      "w0": sd["w"][0, 0].item(), "step": sd["step"]}))
""")


def state(k: float) -> dict[str, Any]:
    return {"w": torch.full((64, 8), k), "b": torch.full((8,), -k), "step": int(k)}


def load_fresh(path: str, step: int) -> dict[str, Any]:
    out = _fresh.run("-c:" + LOAD, [path, str(step)], timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture
def two_steps(tmp_path: Path) -> str:
    path = str(tmp_path / "ckpt")
    dcp.save(state(1.0), storage_writer=EpochalStorageWriter(path, step=1))
    dcp.save(state(2.0), storage_writer=EpochalStorageWriter(path, step=2))
    return path


@pytest.mark.parametrize("node", ["rank0", "dcp"])
def test_a_db_replaced_by_an_older_steps_is_refused_before_anything_is_written(two_steps: str, node: str) -> None:
    assert load_fresh(two_steps, 2) == {"error": None, "untouched": False, "w0": 2.0, "step": 2}
    d = CheckpointDirectory(two_steps)
    shutil.copyfile(d.db_path(node, 1), d.db_path(node, 2))  # same shapes, internally intact
    got = load_fresh(two_steps, 2)
    assert got["error"] is not None, got
    # (a failed metadata read DCP reports as its own AssertionError, quoting ours)
    assert got["error"].startswith("CheckpointCorruptError" if node == "rank0" else "AssertionError"), got
    assert f"{node}.2" in got["error"] and "digest" in got["error"] and "the manifest says" in got["error"]
    assert got["untouched"] and got["step"] == 0
    assert load_fresh(two_steps, 1)["w0"] == 1.0  # the older step still loads


def test_a_truncated_db_is_named_before_anything_is_written(two_steps: str) -> None:
    db = CheckpointDirectory(two_steps).db_path("rank0", 2)
    with open(db, "r+b") as f:
        f.truncate(os.path.getsize(db) - 100)
    got = load_fresh(two_steps, 2)
    assert got["error"].startswith("CheckpointCorruptError") and "rank0.2" in got["error"], got
    assert "size" in got["error"] and got["untouched"]


# ------------------------------------------------------------------ one writer
def test_a_second_job_saving_into_a_held_directory_fails_at_once(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    dcp.save(state(1.0), storage_writer=EpochalStorageWriter(path, step=1))
    with Checkpointer(path):  # another job holds the directory
        with pytest.raises(BaseException) as ei:
            dcp.save(state(9.0), storage_writer=EpochalStorageWriter(path))
        cause = next(iter(ei.value.failures.values()))[0] if hasattr(ei.value, "failures") else ei.value
        assert type(cause).__name__ == "CheckpointLockedError", cause
        assert "held" in str(cause) or "lock" in str(cause)
    names = sorted(os.listdir(path))
    assert names == [".epochal", "dcp.1", "rank0.1"], names  # nothing of the refused save was written
    assert load_fresh(path, 1)["w0"] == 1.0


WRITER = textwrap.dedent("""
    import os, sys, time, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed.checkpoint as dcp
    import epochal.integrations.dcp.storage as storage
    from epochal.integrations.dcp import EpochalStorageWriter
    path, k, gate = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    real = storage.write_native
    def paused(db, blobs):  # the first writer stops inside its save until the gate opens
        if gate != "-":
            open(gate + ".waiting", "w").close()
            while not os.path.exists(gate):
                time.sleep(0.02)
        return real(db, blobs)
    storage.write_native = paused
    try:
        w = EpochalStorageWriter(path)
        dcp.save({"w": torch.full((64, 8), k), "b": torch.full((8,), -k), "step": int(k)}, storage_writer=w)
        print("COMMITTED", w.committed, flush=True)
    except BaseException as ex:  # (DCP's CheckpointException is a BaseException)
        cause = next(iter(ex.failures.values()))[0] if hasattr(ex, "failures") else ex
        print("FAILED", type(cause).__name__, cause, flush=True)
""")


def test_two_jobs_saving_at_once_the_second_fails_and_the_first_commits_its_own(tmp_path: Path) -> None:
    path, gate = str(tmp_path / "ckpt"), str(tmp_path / "gate")
    first = _fresh.start("-c:" + WRITER, [path, "1", gate])
    deadline = time.monotonic() + 120
    while not os.path.exists(gate + ".waiting"):  # the first job is inside its save
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.05)
    second = _fresh.run("-c:" + WRITER, [path, "2", "-"], timeout=120)
    assert "FAILED CheckpointLockedError" in second.stdout, second.stdout + second.stderr[-2000:]
    open(gate, "w").close()
    out, _ = first.communicate(timeout=120)
    assert "COMMITTED 0" in out, out
    assert CheckpointDirectory(path).committed_epochs() == [0]
    assert load_fresh(path, 0) == {"error": None, "untouched": False, "w0": 1.0, "step": 1}
