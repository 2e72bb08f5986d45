"""Preemption: SIGTERM/SIGINT during training commits the current epoch and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _crash_job as cj  # noqa: E402
from _faults import FaultyStore  # noqa: E402

from epochal import JobRunner, LocalSession, MultiNodeCheckpointManager, Preempted, Workspace  # noqa: E402
from epochal.checkpoint.handler.directory import DirectoryMetadataHandler  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory
from epochal.storage.io import atomic  # noqa: E402
from epochal.storage.io.seam import local_store  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
NODES = ("trainer_0", "trainer_1")


def signal_at(epoch, signum=signal.SIGTERM):
    def hook(e, ws):
        if e == epoch:
            os.kill(os.getpid(), signum)  # delivered now, in the middle of the epoch
    return hook


def make(directory, epochs=5, hook=None, **runner_kw):
    job, counts = cj.build_job(epochs, nodes=NODES, hook=hook)
    manager = MultiNodeCheckpointManager(str(directory), "native", metadata_handler=DirectoryMetadataHandler())
    return JobRunner(job, manager, progress=False, **runner_kw), counts


def assert_intact(directory):
    d = CheckpointDirectory(str(directory))
    for e in d.committed_epochs():
        assert d.verify_epoch(e) == [], e
    for folder in (str(directory), d.records_dir):
        leftovers = [n for n in os.listdir(folder) if atomic.parse_temp_path(n)]
        assert not leftovers, leftovers  # an interrupted write removes its temp file
    return d.committed_epochs()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job, _ = cj.build_job(5, nodes=NODES)
    ws = Workspace()
    JobRunner(job, MultiNodeCheckpointManager(str(tmp_path_factory.mktemp("ref")), "native"),
              progress=False).train(LocalSession(ws))
    return cj.model_blobs(ws)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_finishes_and_commits_the_epoch_then_returns(tmp_path, reference, signum):
    """With raise_on_preempt=False, train() returns the preempted epoch."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    runner, counts = make(tmp_path, hook=signal_at(3, signum), raise_on_preempt=False)
    assert runner.train(LocalSession(Workspace())) == 3
    assert counts.epochs == [1, 2, 3] and counts.downloads == 0 and counts.exits == 0
    assert runner.preempted_by == signum
    assert assert_intact(tmp_path) == [0, 1, 2, 3]
    assert not CheckpointDirectory(str(tmp_path)).manifest(3)["final"]
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored
    # the rerun resumes after the preempted epoch and ends exactly like an uninterrupted run
    runner, counts = make(tmp_path)
    ws = Workspace()
    assert runner.train(LocalSession(ws)) == 5
    assert counts.epochs == [4, 5] and counts.exits == 1
    cj.assert_same_blobs(cj.model_blobs(ws), reference)


def test_preemption_raises_by_default_saying_what_is_committed(tmp_path):
    runner, counts = make(tmp_path, hook=signal_at(2))
    with pytest.raises(Preempted) as info:
        runner.train(LocalSession(Workspace()))
    assert info.value.epoch == 2 and info.value.signum == signal.SIGTERM
    assert info.value.committed == 2 and info.value.exit_code == 128 + signal.SIGTERM
    msg = str(info.value)
    assert "SIGTERM after epoch 2" in msg and f"epoch 2 is committed in {tmp_path}" in msg, msg
    assert "run the same script again to resume" in msg, msg
    assert assert_intact(tmp_path)[-1] == 2
    assert counts.downloads == 0 and counts.exits == 0


def test_preemption_when_the_save_failed_names_the_last_committed_epoch(tmp_path):
    """The preempted epoch's save fails (a disk error at the byte-store seam): Preempted says
    which epoch is committed."""
    state = {}

    def hook(e, ws):
        if e == 3:
            state["fail"] = True
            os.kill(os.getpid(), signal.SIGTERM)

    faults = FaultyStore().fail("write", when=lambda p: bool(state.get("fail")), err=5)
    runner, _ = make(tmp_path, hook=hook)
    with pytest.raises(Preempted) as info, local_store(faults):
        runner.train(LocalSession(Workspace()))
    assert faults.hits and all(p.endswith(".3") for p, _ in faults.hits)
    assert info.value.epoch == 3 and info.value.committed == 2
    assert "epoch 2 is committed" in str(info.value)
    assert assert_intact(tmp_path) == [0, 1, 2]


def test_signal_in_the_final_epoch_still_finishes_the_job(tmp_path):
    runner, counts = make(tmp_path, epochs=3, hook=signal_at(3))
    assert runner.train(LocalSession(Workspace())) == 3
    assert counts.exits == 1  # the stop condition came first: the job is done, not preempted
    assert CheckpointDirectory(str(tmp_path)).manifest(3)["final"] is True


def test_a_second_signal_mid_save_stops_at_once_without_damage(tmp_path):
    state = {"writes": 0}

    def hook(e, ws):
        if e == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            state["armed"] = True

    def second_signal(path):
        state["writes"] += 1
        if state["writes"] == 2:  # inside the save of epoch 3
            os.kill(os.getpid(), signal.SIGINT)

    faults = FaultyStore().on("write", second_signal, when=lambda p: bool(state.get("armed")), times=None)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    runner, counts = make(tmp_path, hook=hook)
    with pytest.raises(KeyboardInterrupt), local_store(faults):
        runner.train(LocalSession(Workspace()))
    assert {s: signal.getsignal(s) for s in before} == before
    assert assert_intact(tmp_path) == [0, 1, 2]  # epoch 3 never committed, nothing damaged
    assert counts.epochs == [1, 2, 3]


def test_sigterm_from_outside_mid_epoch_commits_that_epoch(tmp_path):
    """A real SIGTERM to a training subprocess, sent while it trains an epoch."""
    args = ["--epochs", "6", "--mb", "0.5", "--epoch-ms", "150"]
    ref = cj.reference_run(str(tmp_path / "ref"), args)
    env = {**os.environ, "EPOCHAL_QUIET": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "_crash_job.py"), str(tmp_path / "d"), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line.split())
        if lines[-1][:2] == ["SAVED", "1"]:
            time.sleep(0.05)  # now inside epoch 2's 150 ms of training
            proc.send_signal(signal.SIGTERM)
    # a script that does nothing special exits non-zero, so a scheduler restarts it
    assert proc.wait(timeout=60) == 1
    assert not [ln for ln in lines if ln[0] == "DONE"]
    assert [ln for ln in lines if ln[0] == "SAVED"][-1] == ["SAVED", "2"]
    assert ["EPOCH", "2", ref.epochs[2]] in lines
    d = CheckpointDirectory(str(tmp_path / "d"))
    assert d.committed_epochs() == [0, 1, 2] and all(not d.verify_epoch(e) for e in (0, 1, 2))
    err = proc.stderr.read()
    assert "epochal.errors.Preempted: training preempted by SIGTERM after epoch 2" in err, err
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0
    assert out.stdout.split("\n")[-2].split() == ["DONE", str(ref.done[0]), ref.done[1]]
