"""epochal.Checkpointer under torch.distributed (gloo, CPU): one commit per step over every
rank's db, SIGKILL at random moments then resume bit-identical (DDP), FSDP2 resharding 2 -> 1
and 1 -> 2 bit-equal to the gathered full state, a rank's data missing never resumed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import _fresh  # noqa: E402
from _dist_workers import (  # noqa: E402
    free_port,
    fsdp_restore,
    fsdp_save,
    missing_rank_data,
    run_ranks,
    tiny_model,
    train_one,
)
from _torch_bits import bits  # noqa: E402

import epochal  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.integrations.distributed import DistributedCheckpointer  # noqa: E402

pytestmark = pytest.mark.slow  # spawns gloo ranks
TRAIN = str(Path(__file__).parent / "_dist_train.py")
STEPS = 24


def _launch(ckpt: Path, out: Path) -> list[Any]:
    """Two ranks of tests/_dist_train.py, as torchrun would start them."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "EPOCHAL_QUIET": "1"}
        procs.append(_fresh.start(TRAIN, [str(ckpt), str(out), str(STEPS)], env=env))
    return procs


def _finish(procs: list[Any]) -> None:
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out


def _final(out: Path) -> list[dict[str, Any]]:
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The final state of each rank of an uninterrupted run."""
    base = tmp_path_factory.mktemp("base")
    _finish(_launch(base / "ckpt", base / "out"))
    want = _final(base / "out")
    assert want[0]["rng"] != want[1]["rng"]  # per-rank RNG streams really differ
    assert want[0]["sampler"] != want[1]["sampler"]  # each rank its own share
    return want


def _wait_commit(ckpt: Path) -> None:
    deadline = time.monotonic() + 60
    while not list((ckpt / ".epochal").glob("manifest.*.json")) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_ddp_killed_at_random_moments_resumes_bit_identical(
    tmp_path: Path, uninterrupted: list[dict[str, Any]]
) -> None:
    want = uninterrupted

    run = tmp_path / "run"
    rnd = random.Random(os.getpid())
    procs = _launch(run / "ckpt", run / "out")
    first = procs[0].stdout.readline()  # type: ignore[union-attr]
    assert "resumed None" in first, first
    _wait_commit(run / "ckpt")
    time.sleep(rnd.uniform(0.0, 0.5))  # SIGKILL both ranks at a random moment after a commit
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.communicate(timeout=60)
    assert procs[0].returncode == -signal.SIGKILL  # killed, not finished
    killed_at = CheckpointDirectory(str(run / "ckpt")).committed_epochs()
    assert killed_at and killed_at[-1] < STEPS
    procs = _launch(run / "ckpt", run / "out")
    first = procs[0].stdout.readline()  # type: ignore[union-attr]
    assert f"resumed {killed_at[-1]} " in first, (first, killed_at)
    _finish(procs)
    assert _final(run / "out") == want
    d = CheckpointDirectory(str(run / "ckpt"))
    assert d.committed_epochs()[-1] == STEPS
    assert sorted(d.read_manifest(STEPS).nodes) == ["dcp", "rank0", "rank1"]
    assert not d.check_epoch(STEPS, "full")


def test_a_rank_whose_data_is_missing_is_never_committed_or_resumed(tmp_path: Path) -> None:
    run_ranks(missing_rank_data, 2, str(tmp_path / "ckpt"))


def test_fsdp2_two_to_one_and_one_to_two_bit_equal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, full = tmp_path / "ckpt", tmp_path / "full.json"
    run_ranks(fsdp_save, 2, str(path), str(full))
    want = json.loads(full.read_text())
    # 2 -> 1: one process, no process group, plain modules
    model = tiny_model(5)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train_one(model, opt, 3)  # (the optimizer has state of its own before the restore)
    state = {"model": model, "opt": opt, "note": "", "rng": epochal.RNGState()}
    rng = torch.get_rng_state()
    with epochal.Checkpointer(path) as ck:  # the directory was written by ranks
        assert type(ck) is epochal.Checkpointer and isinstance(ck.distributed, DistributedCheckpointer)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for one_process_only in ({"step": 4}, {"strict": False}):  # refused, nothing written
            with pytest.raises(ValueError, match="for one process"):
                ck.restore(state, **one_process_only)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        with pytest.raises(ValueError, match="a db per rank"):
            ck.db_path(4)
        assert ck.restore(state) == 4
    assert state["note"] == "fsdp"
    assert torch.equal(torch.get_rng_state(), rng)  # per-rank values of 2 ranks are not 1 rank's
    got = {f"model.{k}": bits(v).hex() for k, v in model.state_dict().items()}
    names = dict(zip(range(len(list(model.parameters()))), [n for n, _ in model.named_parameters()]))
    got.update({f"opt.{names[p]}.{k}": bits(v).hex() for p, s in opt.state_dict()["state"].items()
                for k, v in s.items()})
    assert got == want
    # 1 -> 2: this process saves plain modules, two FSDP2 ranks restore them
    train_one(model, opt, 4)
    with DistributedCheckpointer(path) as ck:
        ck.save(5, {"model": model, "opt": opt, "note": "plain"})
    saved = {f"model.{k}": bits(v).hex() for k, v in model.state_dict().items()}
    saved.update({f"opt.{names[p]}.{k}": bits(v).hex() for p, s in opt.state_dict()["state"].items()
                  for k, v in s.items()})
    full.write_text(json.dumps(saved))
    run_ranks(fsdp_restore, 2, str(path), str(full))


def test_sigterm_to_torchrun_and_a_rank_saves_one_step_exits_nonzero_and_resumes(
    tmp_path: Path, uninterrupted: list[dict[str, Any]]
) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    env = {**os.environ, "EPOCHAL_QUIET": "1"}
    tr = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
         f"--master_port={free_port()}", TRAIN, str(ckpt), str(out), str(STEPS)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    while len([ln for ln in lines if "resumed" in ln]) < 2:
        line = tr.stdout.readline()  # type: ignore[union-attr]
        assert line, "".join(lines)
        lines.append(line)
    pid1 = int(next(ln for ln in lines if "rank 1 resumed" in ln).rsplit(" ", 1)[1])
    _wait_commit(ckpt)
    os.kill(pid1, signal.SIGTERM)  # the scheduler signals the worker itself...
    tr.send_signal(signal.SIGTERM)  # ... and torchrun, which forwards another one to it
    rest, _ = tr.communicate(timeout=120)
    text = "".join(lines) + rest
    assert tr.returncode != 0, text
    stops = {int(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if " preempted at " in ln}
    assert len(stops) == 1 and len([ln for ln in text.splitlines() if " preempted at " in ln]) == 2, text
    (stop,) = stops
    assert stop < STEPS and CheckpointDirectory(str(ckpt)).committed_epochs()[-1] == stop
    procs = _launch(ckpt, out)
    first = procs[0].stdout.readline()  # type: ignore[union-attr]
    assert f"resumed {stop} " in first, first
    _finish(procs)
    assert _final(out) == uninterrupted


def test_one_process_keeps_last_and_best_and_records_metrics(tmp_path: Path) -> None:
    """Rank 0's retention and best-k (here the only rank, no process group)."""
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.7, 5: 0.8}
    with DistributedCheckpointer(tmp_path, keep_last=1, keep_best=1, metric="loss") as ck:
        for step, loss in losses.items():
            train_one(model, opt, step)
            ck.save(step, {"model": model, "opt": opt, "step": step}, metrics={"loss": loss})
        assert ck.steps() == [2, 5] and ck.best_steps() == [2]
    d = CheckpointDirectory(str(tmp_path))
    assert d.read_manifest(2).metrics == {"loss": 0.1}
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "dcp.2", "dcp.5", "rank0.2", "rank0.5"]
    fresh = tiny_model(3)
    state = {"model": fresh, "opt": torch.optim.SGD(fresh.parameters(), lr=0.1), "step": 0}
    with epochal.Checkpointer(tmp_path) as ck:
        assert ck.restore(state) == 5 and state["step"] == 5
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
