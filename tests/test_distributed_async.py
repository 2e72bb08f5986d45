"""async_save=True under torch.distributed (2 gloo ranks, CPU): saves return once each rank's
part is snapshotted, the step is committed by rank 0 only once every rank's background write
is durable, a restore is bit-equal to the state at the save, and ranks killed while one
rank's write was still going leave that step uncommitted (the previous one resumes)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import _fresh  # noqa: E402
from _dist_workers import free_port, run_ranks  # noqa: E402
from _dist_workers_more import async_saves  # noqa: E402

from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.integrations.distributed import DistributedCheckpointer  # noqa: E402

pytestmark = pytest.mark.slow  # spawns gloo ranks and kills them
SCRIPT = str(Path(__file__).parent / "_dist_async.py")


def test_async_saves_commit_after_every_write_and_restore_bit_equal(tmp_path: Path) -> None:
    run_ranks(async_saves, 2, str(tmp_path / "ckpt"))
    d = CheckpointDirectory(str(tmp_path / "ckpt"))
    assert d.committed_epochs() == [1, 2, 3]
    assert sorted(d.read_manifest(3).nodes) == ["dcp", "rank0", "rank1"]
    assert not d.check_epoch(3, "full")


def test_ranks_killed_before_a_background_write_finished_never_commit_that_step(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "step1.json"
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "EPOCHAL_QUIET": "1"}
        procs.append(_fresh.start(SCRIPT, [str(ckpt), str(out)], env=env))
    seen = []
    while not (any("stalling" in ln for ln in seen) and any("save 2 returned" in ln for ln in seen)):
        line = procs[1].stdout.readline()  # type: ignore[union-attr]
        assert line, "".join(seen)
        seen.append(line)
    # (save() returned while the write went on: it did not block on it)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.communicate(timeout=60)
        assert p.returncode == -signal.SIGKILL
    d = CheckpointDirectory(str(ckpt))
    assert d.committed_epochs() == [1]  # step 2: rank 0's db may be there, but no manifest
    assert not (ckpt / "rank1.2").exists()
    model = torch.nn.Linear(4, 3)
    state = {"model": model, "step": 0}
    with DistributedCheckpointer(ckpt) as ck:  # one process, no process group
        assert ck.restore(state) == 1 and state["step"] == 1
    want = json.loads(out.read_text())
    for k, v in model.state_dict().items():
        assert torch.equal(v, torch.tensor(want[k])), k


@pytest.mark.parametrize("max_host_bytes", [None, 1])
def test_async_snapshots_reuse_one_host_buffer_within_the_bound(tmp_path: Path, max_host_bytes: int | None) -> None:
    """One process, no process group: three async saves of one state take one host buffer,
    reused (None: one state's worth kept); over the bound, each save its own memory. Every
    step restores bit-equal to the state at its save, though the live tensors moved on."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 5)
    extra = torch.randn(7, 3, dtype=torch.float64)
    at = {}
    with DistributedCheckpointer(tmp_path, async_save=True, max_host_bytes=max_host_bytes) as ck:
        for step in (1, 2, 3):
            at[step] = [t.clone() for t in (*model.state_dict().values(), extra)]
            ck.save(step, {"model": model, "extra": extra, "step": step})
            with torch.no_grad():
                model.weight.add_(1.0)
                extra.mul_(2.0)
        staging = ck._staging
    assert (staging.allocated, staging.reused) == ((1, 2) if max_host_bytes is None else (3, 0))
    assert CheckpointDirectory(str(tmp_path)).committed_epochs() == [1, 2, 3]
    for step in (1, 2, 3):
        fresh, into = torch.nn.Linear(8, 5), torch.zeros(7, 3, dtype=torch.float64)
        state = {"model": fresh, "extra": into, "step": 0}
        with DistributedCheckpointer(tmp_path) as ck:
            ck._load(step, state)
        assert state["step"] == step
        got = [*fresh.state_dict().values(), into]
        assert all(torch.equal(a, b) for a, b in zip(got, at[step])), step


def test_leaving_on_an_error_does_not_commit_the_background_save(tmp_path: Path) -> None:
    """An exception out of the ``with`` block: the pending write is joined, not committed (on
    ranks, the others may never reach the commit's collective); the step before stays."""
    model = torch.nn.Linear(3, 2)
    with pytest.raises(RuntimeError, match="boom"):
        with DistributedCheckpointer(tmp_path, async_save=True) as ck:
            ck.save(1, {"model": model})
            ck.wait()
            ck.save(2, {"model": model})
            raise RuntimeError("boom")
    assert CheckpointDirectory(str(tmp_path)).committed_epochs() == [1]
    assert (tmp_path / "rank0.2").exists()  # written, never committed
    with DistributedCheckpointer(tmp_path) as ck:  # and the lock was let go
        assert ck.restore({"model": torch.nn.Linear(3, 2)}) == 1
