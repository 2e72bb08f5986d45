"""Nothing a user puts in a job is silently lost (issue: loud failures, every blob kept, the new
epoch limit honoured, one writer per directory): unsavable values, blobs outside the blob
list, a changed epoch limit, a rerun without a handler, what a start says."""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import pytest

from epochal import (
    CheckpointManager,
    DirectoryMetadataHandler,
    Job,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    Task,
    UnsupportedBlobError,
    Workspace,
    epoch_limiter,
)
from epochal.checkpoint.location.view import CheckpointDirectory


@dataclasses.dataclass
class Config:
    lr: float = 0.1


class Init:
    def __init__(self, extra=None):
        self.extra = extra

    def __call__(self, ws):
        ws["w"] = np.zeros(4, np.float32)
        if self.extra is not None:
            ws["extra"] = self.extra


class Step:
    def __call__(self, ws):
        ws["w"] = ws["w"] + 1


class MakeGlobal:
    """An epoch step that creates a new blob in the global workspace (a GLOBAL task)."""

    def __call__(self, ws):
        ws["late"] = np.int64(7)


def build(epochs=3, extra=None, late=False, node="n", step=None):
    with Node(node):
        with Job() as job:
            with job.init_group:
                Task(step=Init(extra))
            Task(step=step or Step())
            if late:
                from epochal import TaskGroup, WorkspaceType

                g = TaskGroup(WorkspaceType.GLOBAL)
                with g:
                    Task(step=MakeGlobal())
            epoch_limiter(job, epochs)
    if late:
        job.epoch_group = [job.epoch_group, g]
    return job


def runner(job, d, handler=True, **kw):
    h = DirectoryMetadataHandler() if handler else None
    return JobRunner(job, CheckpointManager(str(d), "n", metadata_handler=h), progress=False, **kw)


# ----------------------------------------------------------------- 1. unsavable values
@pytest.mark.parametrize("value", [Config(), np.array([1, "a"], dtype=object)], ids=["dataclass", "object-array"])
@pytest.mark.parametrize("async_save", [False, True])
def test_an_unsavable_value_raises_at_the_first_save_naming_node_and_blob(tmp_path, value, async_save):
    job = build(extra=value)
    with pytest.raises(UnsupportedBlobError) as info:
        runner(job, tmp_path, async_save=async_save).train(LocalSession(Workspace()))
    msg = str(info.value)
    assert "node 'n'" in msg and "'extra'" in msg and "epoch 0" in msg, msg
    assert CheckpointDirectory(str(tmp_path)).committed_epochs() == []


def test_an_unsavable_torch_value_raises(tmp_path):
    torch = pytest.importorskip("torch")
    job = build(extra=torch.zeros(3).to_sparse())
    with pytest.raises(UnsupportedBlobError, match="'extra'.*sparse"):
        runner(job, tmp_path).train(LocalSession(Workspace()))


def test_unsavable_value_put_in_the_workspace_mid_run_raises_at_that_save(tmp_path):
    class Poison:
        def __call__(self, ws):
            if ws["w"][0] == 2:
                ws["w"] = np.array([Config()], dtype=object)  # a blob of the list turns unsavable

    with Node("n"):
        with Job() as job:
            with job.init_group:
                Task(step=Init())
            Task(step=Step())
            Task(step=Poison())
            epoch_limiter(job, 5)
    with pytest.raises(UnsupportedBlobError, match="epoch 2"):
        runner(job, tmp_path).train(LocalSession(Workspace()))
    assert CheckpointDirectory(str(tmp_path)).committed_epochs() == [0, 1]


def test_storage_failures_warn_until_max_failed_saves(tmp_path, monkeypatch, caplog):
    from epochal import CheckpointError, get_db_type

    backend = get_db_type("native")
    real = type(backend).write
    failing = {"on": True}

    def flaky(self, path, blobs):
        if failing["on"] and not path.endswith(".0"):  # the init save works, later ones fail
            raise OSError(5, "Input/output error")
        return real(self, path, blobs)

    monkeypatch.setattr(type(backend), "write", flaky)
    with caplog.at_level(logging.WARNING, logger="epochal"), pytest.raises(CheckpointError) as info:
        runner(build(epochs=10), tmp_path, max_failed_saves=2).train(LocalSession(Workspace()))
    msg = str(info.value)
    assert "2 checkpoint saves in a row failed" in msg and "epochs 1, 2" in msg, msg
    assert "Input/output error" in msg and "newest committed checkpoint is epoch 0" in msg, msg
    assert isinstance(info.value.__cause__, OSError)
    assert CheckpointDirectory(str(tmp_path)).committed_epochs() == [0]
    warned = [r.getMessage() for r in caplog.records if "Unable to write" in r.getMessage()]
    assert len(warned) == 1 and "epoch 1" in warned[0]

    # failures that are not in a row never add up: every other save fails, training goes on
    def every_other(self, path, blobs):
        if int(path.rsplit(".", 1)[1]) % 2:
            raise OSError(28, "No space left on device")
        return real(self, path, blobs)

    monkeypatch.setattr(type(backend), "write", every_other)
    ws = Workspace()
    assert runner(build(epochs=6), tmp_path / "b", max_failed_saves=2).train(LocalSession(ws)) == 6
    assert CheckpointDirectory(str(tmp_path / "b")).committed_epochs() == [0, 2, 4, 6]
    assert float(ws["w"][0]) == 6.0


# ----------------------------------------------------------------- 3. blobs outside the checkpoint
def test_a_blob_added_before_resume_joins_the_checkpoint_with_one_warning(tmp_path, caplog):
    runner(build(epochs=2), tmp_path).train(LocalSession(Workspace()))
    ws = Workspace()
    ws["ema"] = np.full(3, 5.0)  # the code now puts it there before train()
    with caplog.at_level(logging.WARNING, logger="epochal"):
        assert runner(build(epochs=4), tmp_path).train(LocalSession(ws)) == 4
    warned = [r.getMessage() for r in caplog.records if "lacks" in r.getMessage()]
    assert len(warned) == 1 and "'ema'" not in warned[0] and "ema" in warned[0] and "epoch 2" in warned[0]
    d = CheckpointDirectory(str(tmp_path))
    from epochal import get_db_type

    saved = get_db_type("native").read(d.db_path("n", 4))
    assert np.array_equal(saved["ema"], np.full(3, 5.0)) and "ema" in saved["blob_names"].tolist()
    assert float(saved["w"][0]) == 4.0
    # and the next resume restores it like any other blob
    ws2 = Workspace()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="epochal"):
        runner(build(epochs=5), tmp_path).train(LocalSession(ws2))
    assert np.array_equal(ws2["ema"], np.full(3, 5.0))
    assert not [r for r in caplog.records if "lacks" in r.getMessage()]


def test_a_global_blob_created_after_init_is_named_once_per_run(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="epochal"):
        runner(build(epochs=3, late=True), tmp_path).train(LocalSession(Workspace()))
    warned = [r.getMessage() for r in caplog.records if "not checkpointed" in r.getMessage()]
    assert len(warned) == 1 and "late" in warned[0] and "'n'" in warned[0], warned
    assert "stop" not in warned[0]  # task outputs (the limiter's flag) are not state


# ----------------------------------------------------------------- 4. the epoch limit in force
def test_a_higher_limit_trains_on_and_a_lower_one_runs_nothing(tmp_path):
    ws = Workspace()
    assert runner(build(epochs=3), tmp_path).train(LocalSession(ws)) == 3
    assert CheckpointDirectory(str(tmp_path)).manifest(3)["final"] is True
    ws = Workspace()
    assert runner(build(epochs=6), tmp_path).train(LocalSession(ws)) == 6
    assert float(ws["w"][0]) == 6.0
    assert CheckpointDirectory(str(tmp_path)).committed_epochs() == list(range(7))
    # a lower limit, already reached: load, no epoch, return the epoch loaded
    ws = Workspace()
    epochs_seen = []

    class Spy(Step):
        def __call__(self, ws):
            epochs_seen.append(1)

    job = build(epochs=2, step=Spy())  # would count any epoch run
    assert runner(job, tmp_path).train(LocalSession(ws)) == 6
    assert epochs_seen == [] and float(ws["w"][0]) == 6.0
    assert CheckpointDirectory(str(tmp_path)).committed_epochs() == list(range(7))


def test_the_same_limit_keeps_the_seed_behaviour(tmp_path):
    ws = Workspace()
    assert runner(build(epochs=3), tmp_path).train(LocalSession(ws)) == 3
    ws = Workspace()
    assert runner(build(epochs=3), tmp_path).train(LocalSession(ws)) == 3
    assert float(ws["w"][0]) == 3.0


def test_a_counter_saved_by_an_older_epochal_still_counts(tmp_path):
    """Old checkpoints hold a 0-d countdown; read as if the limit had not changed."""
    from epochal import get_db_type

    job = build(epochs=4)
    r = runner(job, tmp_path, resume_from_epoch=None)
    r.train(LocalSession(Workspace()))  # epochs 1..4
    d = CheckpointDirectory(str(tmp_path))
    backend = get_db_type("native")
    blobs = backend.read(d.db_path("n", 2))
    counter = [n for n in blobs if n.endswith("/counter")][0]
    assert blobs[counter].tolist() == [2]
    blobs[counter] = np.array(4 - 1 - 2, dtype=np.int64)  # what the seed's countdown held
    backend.write(d.db_path("n", 2), blobs)
    ws = Workspace()
    assert JobRunner(build(epochs=4), CheckpointManager(str(tmp_path), "n"), resume_from_epoch=2,
                     progress=False).train(LocalSession(ws)) == 4
    assert float(ws["w"][0]) == 4.0


# ----------------------------------------------------------------- 5. rerun without a handler
def test_rerun_without_a_handler_warns_naming_the_directory_and_epoch(tmp_path, caplog):
    runner(build(epochs=2), tmp_path, handler=False).train(LocalSession(Workspace()))
    with caplog.at_level(logging.WARNING, logger="epochal"):
        runner(build(epochs=2), tmp_path, handler=False).train(LocalSession(Workspace()))
    warned = [r.getMessage() for r in caplog.records if "already holds" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path) in warned[0] and "epoch 2" in warned[0]
    assert "resume_from_epoch=2" in warned[0]
    # a fresh directory, or a user-chosen resume epoch: no warning
    caplog.clear()
    (tmp_path / "new").mkdir()
    with caplog.at_level(logging.WARNING, logger="epochal"):
        runner(build(epochs=2), tmp_path / "new", handler=False).train(LocalSession(Workspace()))
        runner(build(epochs=3), tmp_path, handler=False, resume_from_epoch=2).train(LocalSession(Workspace()))
    assert not [r for r in caplog.records if "already holds" in r.getMessage()]


def test_a_readme_beside_the_dbs_is_not_taken_for_a_checkpoint(tmp_path, caplog):
    (tmp_path / "README.1").write_text("notes")
    (tmp_path / "n.01").write_text("not a db name: padded")
    with caplog.at_level(logging.WARNING, logger="epochal"):
        runner(build(epochs=1), tmp_path, handler=False).train(LocalSession(Workspace()))
    assert not [r for r in caplog.records if "already holds" in r.getMessage()]


# ----------------------------------------------------------------- 9. say what happens
def test_every_start_says_whether_it_resumes_and_where(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("EPOCHAL_QUIET", raising=False)
    r = JobRunner(build(epochs=2), CheckpointManager(str(tmp_path), "n", metadata_handler=DirectoryMetadataHandler()))
    r.train(LocalSession(Workspace()))
    err = capfd.readouterr().err
    assert f"epochal: starting a new job in {tmp_path}" in err, err
    r = JobRunner(build(epochs=3), CheckpointManager(str(tmp_path), "n", metadata_handler=DirectoryMetadataHandler()))
    r.train(LocalSession(Workspace()))
    err = capfd.readouterr().err
    assert f"epochal: resuming from epoch 2 in {tmp_path}" in err, err
    monkeypatch.setenv("EPOCHAL_QUIET", "1")
    r = JobRunner(build(epochs=3), CheckpointManager(str(tmp_path), "n", metadata_handler=DirectoryMetadataHandler()))
    r.train(LocalSession(Workspace()))
    assert "epochal:" not in capfd.readouterr().err


def test_the_start_line_is_logged_at_info(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="epochal"):
        runner(build(epochs=1), tmp_path).train(LocalSession(Workspace()))
    assert f"starting a new job in {tmp_path}" in [r.getMessage() for r in caplog.records]


def test_multinode_start_line_names_the_directory(tmp_path, caplog):
    with Node("a"):
        with Job() as job:
            with job.init_group:
                Task(step=Init())
            Task(step=Step())
            epoch_limiter(job, 1)
    m = MultiNodeCheckpointManager(str(tmp_path), metadata_handler=DirectoryMetadataHandler())
    with caplog.at_level(logging.INFO, logger="epochal"):
        JobRunner(job, m, progress=False).train(LocalSession(Workspace()))
    assert f"starting a new job in {tmp_path}" in [r.getMessage() for r in caplog.records]
    assert os.path.exists(tmp_path / "a.1")


# ----------------------------------------------------------------- 7. one writer per directory
def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path):
    import socket

    from epochal.errors import CheckpointLockedError

    seen = {}

    class Second(Step):
        def __call__(self, ws):
            super().__call__(ws)
            if float(ws["w"][0]) == 2 and "err" not in seen:
                with pytest.raises(CheckpointLockedError) as info:
                    runner(build(epochs=5), tmp_path).train(LocalSession(Workspace()))
                seen["err"] = info.value

    ws = Workspace()
    assert runner(build(epochs=3, step=Second()), tmp_path).train(LocalSession(ws)) == 3
    err = seen["err"]
    assert err.holder["pid"] == os.getpid() and err.holder["host"] == socket.gethostname()
    msg = str(err)
    assert f"pid {os.getpid()}" in msg and "since" in msg and str(tmp_path / ".epochal" / "lock") in msg
    # the first run was not disturbed, and the lock is free again once it returned
    assert CheckpointDirectory(str(tmp_path)).committed_epochs() == [0, 1, 2, 3]
    assert runner(build(epochs=4), tmp_path).train(LocalSession(Workspace())) == 4


def test_a_dead_holders_lock_is_taken_over(tmp_path):
    import subprocess
    import sys

    code = (
        "import os, sys; sys.path.insert(0, sys.argv[2]);"
        "from epochal.checkpoint.location.lock import WriterLock;"
        "os.makedirs(sys.argv[1], exist_ok=True);"
        "WriterLock(os.path.join(sys.argv[1], 'lock')).acquire(); os.kill(os.getpid(), 9)"
    )
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / ".epochal"), src], timeout=60)
    assert r.returncode == -9
    assert (tmp_path / ".epochal" / "lock").read_text()  # the dead holder's record is still there
    assert runner(build(epochs=2), tmp_path).train(LocalSession(Workspace())) == 2


def test_read_only_tools_need_no_lock(tmp_path):
    from epochal.checkpoint.location.lock import WriterLock

    runner(build(epochs=2), tmp_path).train(LocalSession(Workspace()))
    lock = WriterLock(str(tmp_path / ".epochal" / "lock"))
    lock.acquire()
    try:
        d = CheckpointDirectory(str(tmp_path))
        assert d.committed_epochs() == [0, 1, 2] and d.verify_epoch(2) == []
    finally:
        lock.release()


def test_the_lock_without_flock_falls_back_to_the_holder_record(tmp_path, monkeypatch):
    import errno

    from epochal.checkpoint.location import lock as lockmod
    from epochal.errors import CheckpointLockedError

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lockmod.fcntl, "flock", no_flock)
    path = str(tmp_path / "lock")
    import json

    (tmp_path / "lock").write_text(json.dumps({"host": lockmod.atomic.hostname(), "pid": 999999999, "since": "x"}))
    a = lockmod.WriterLock(path)
    a.acquire()  # a dead pid of this host: taken over
    a.release()  # (a second lock in this same process is refused as such)
    (tmp_path / "lock").write_text('{"host": "other-host", "pid": 1, "since": "2026-01-01"}')
    b = lockmod.WriterLock(path)
    with pytest.raises(CheckpointLockedError, match="host other-host, pid 1, since 2026-01-01"):
        b.acquire()


# ----------------------------------------------------------------- 8. manifests are checked
def _committed(tmp_path, epochs=3, keep_last=None):
    h = DirectoryMetadataHandler(keep_last=keep_last)
    JobRunner(build(epochs=epochs), CheckpointManager(str(tmp_path), "n", metadata_handler=h),
              progress=False).train(LocalSession(Workspace()))


def test_a_manifest_with_one_flipped_bit_is_refused(tmp_path):
    from epochal.errors import CheckpointCorruptError

    _committed(tmp_path)
    d = CheckpointDirectory(str(tmp_path))
    path = d.manifest_path(3)
    raw = bytearray(open(path, "rb").read())
    good = bytes(raw)
    refused = 0
    positions = range(0, len(raw))
    for pos in positions:
        for bit in (0, 3, 6):
            raw[pos] ^= 1 << bit
            open(path, "wb").write(raw)
            try:
                d.manifest(3)
            except CheckpointCorruptError:
                refused += 1
            else:  # accepted: only whitespace-like changes may pass
                assert json_equal(bytes(raw), good), (pos, bit)
            raw[pos] ^= 1 << bit
    open(path, "wb").write(good)
    assert refused > 0.9 * 3 * len(raw)
    assert d.manifest(3)["epoch"] == 3


def json_equal(a: bytes, b: bytes) -> bool:
    import json

    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def test_retention_never_deletes_a_file_a_manifest_names_that_is_not_its_db(tmp_path):
    import json

    from epochal.checkpoint.location.manifest import encode_manifest

    _committed(tmp_path, epochs=2)
    (tmp_path / "README.txt").write_text("keep me")
    (tmp_path / "README.1").write_text("keep me too")
    (tmp_path / "other.1").write_text("another job's node")
    d = CheckpointDirectory(str(tmp_path))
    # a manifest (with a valid checksum: forged on purpose) naming the README
    m = d.manifest(1)
    m["nodes"]["n"]["file"] = "README.txt"
    (tmp_path / ".epochal" / "manifest.1.json").write_bytes(encode_manifest(m))
    assert 1 not in d.committed_epochs()  # refused: that is not the db of node n at epoch 1
    _ = json
    _committed(tmp_path, epochs=5, keep_last=1)
    assert (tmp_path / "README.txt").read_text() == "keep me"
    assert (tmp_path / "README.1").read_text() == "keep me too"
    assert (tmp_path / "other.1").read_text() == "another job's node"
    assert d.committed_epochs() == [5] and (tmp_path / "n.5").exists()
    # epoch 1's manifest exists but is refused: its epoch is kept, never a leftover
    assert (tmp_path / "n.1").exists() and (tmp_path / ".epochal" / "manifest.1.json").exists()
    assert not (tmp_path / "n.4").exists()


def test_manifests_of_an_older_epochal_still_read(tmp_path):
    import json

    _committed(tmp_path, epochs=1)
    d = CheckpointDirectory(str(tmp_path))
    m = d.manifest(1)
    del m["checksum"]
    m["version"] = 1
    (tmp_path / ".epochal" / "manifest.1.json").write_text(json.dumps(m))
    assert d.committed_epochs() == [0, 1] and d.verify_epoch(1) == []


def test_duplicate_keys_in_a_manifest_are_refused(tmp_path):
    from epochal.errors import CheckpointCorruptError

    _committed(tmp_path, epochs=1)
    d = CheckpointDirectory(str(tmp_path))
    raw = open(d.manifest_path(1), "rb").read().replace(b'"final"', b'"final": true, "final"', 1)
    open(d.manifest_path(1), "wb").write(raw)
    with pytest.raises(CheckpointCorruptError, match="duplicate key 'final'"):
        d.manifest(1)


# ----------------------------------------------------------------- cadence
def test_save_every_k_epochs_and_always_the_last(tmp_path):
    ws = Workspace()
    assert runner(build(epochs=7), tmp_path, save_every=3).train(LocalSession(ws)) == 7
    assert CheckpointDirectory(str(tmp_path)).committed_epochs() == [0, 3, 6, 7]
    assert float(ws["w"][0]) == 7.0
    # a rerun with a higher limit resumes from the last one, and trains on
    ws = Workspace()
    assert runner(build(epochs=9), tmp_path, save_every=3).train(LocalSession(ws)) == 9
    assert CheckpointDirectory(str(tmp_path)).committed_epochs() == [0, 3, 6, 7, 9]
    assert float(ws["w"][0]) == 9.0


def test_save_interval_saves_once_the_time_has_passed(tmp_path, monkeypatch):
    from epochal.jobs import cadence

    clock = {"t": 1000.0}
    monkeypatch.setattr(cadence.time, "monotonic", lambda: clock["t"])

    class Tick(Step):
        def __call__(self, ws):
            super().__call__(ws)
            clock["t"] += 25.0  # each epoch takes 25 s

    assert runner(build(epochs=8, step=Tick()), tmp_path, save_interval="1m").train(LocalSession(Workspace())) == 8
    # saved at 0, then once 60 s have passed since the last save (epochs 3 and 6), and the last
    assert CheckpointDirectory(str(tmp_path)).committed_epochs() == [0, 3, 6, 8]


def test_a_preempted_epoch_is_saved_whatever_the_cadence(tmp_path):
    import signal

    from epochal import Preempted

    class Stop(Step):
        def __call__(self, ws):
            super().__call__(ws)
            if float(ws["w"][0]) == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Preempted) as info:
        runner(build(epochs=9, step=Stop()), tmp_path, save_every=3).train(LocalSession(Workspace()))
    assert info.value.committed == 4
    assert CheckpointDirectory(str(tmp_path)).committed_epochs() == [0, 3, 4]


def test_bad_cadence_values_are_refused():
    with pytest.raises(ValueError, match="save_every"):
        JobRunner(build(), save_every=0)
    with pytest.raises(ValueError, match="not a duration"):
        JobRunner(build(), save_interval="soon")
