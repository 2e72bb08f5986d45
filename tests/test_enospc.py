"""Full disk: a save that hits ENOSPC (or any OSError) loses nothing committed and training
goes on. On a real, tiny tmpfs where the machine lets the test mount one, and by injecting
errors at the write layer (``epochal.storage.io.atomic.write_all`` / ``fsync``) everywhere."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _crash_job as cj  # noqa: E402
from _faults import FaultyStore  # noqa: E402

from epochal import JobRunner, LocalSession, MultiNodeCheckpointManager, Workspace, get_db_type  # noqa: E402
from epochal.checkpoint.handler.directory import DirectoryMetadataHandler  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory
from epochal.storage.io import atomic  # noqa: E402
from epochal.storage.io.seam import local_store  # noqa: E402

SIZE = 20000  # ~400 KB per db: a 2 MiB filesystem holds four
EPOCHS = 8


def run(directory, nodes=("trainer_0",), handler="default", hook=None, epochs=EPOCHS, size=SIZE,
        max_failed_saves=None):
    """Train; by default with the seed's policy (every storage failure only a warning, however
    many in a row), which these tests exercise; ``max_failed_saves`` bounds it."""
    if handler == "default":
        handler = DirectoryMetadataHandler()
    job, counts = cj.build_job(epochs, nodes=nodes, hook=hook, size=size)
    manager = MultiNodeCheckpointManager(str(directory), "native", metadata_handler=handler)
    ws = Workspace()
    last = JobRunner(job, manager, progress=False, max_failed_saves=max_failed_saves).train(LocalSession(ws))
    return last, cj.model_blobs(ws), counts


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return {
        n: run(tmp_path_factory.mktemp("ref"), nodes=nodes, handler=None)[1]
        for n, nodes in (("one", ("trainer_0",)), ("two", ("trainer_0", "trainer_1")))
    }


def assert_sound(directory):
    """No temp file, every db under a checkpoint name is complete, every committed epoch
    verifies; returns the committed epochs."""
    d = CheckpointDirectory(str(directory))
    for folder in (str(directory), d.records_dir):
        if os.path.isdir(folder):
            leftovers = [n for n in os.listdir(folder) if atomic.parse_temp_path(n)]
            assert not leftovers, leftovers
    backend = get_db_type("native")
    for dbs in d.scan().values():
        for path in dbs.values():
            backend.verify(path)  # raises on a partial file
    for e in d.committed_epochs():
        assert d.verify_epoch(e) == [], e
    return d.committed_epochs()


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ----------------------------------------------------------------------------- a real small filesystem

@pytest.fixture
def small_fs(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("mounting a tmpfs needs Linux")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as ex:
        pytest.skip(f"cannot run mount to create a 2 MiB tmpfs: {ex}")
    if r.returncode != 0:
        pytest.skip(f"this machine refuses to mount a 2 MiB tmpfs at {mnt} (needs root / "
                    f"CAP_SYS_ADMIN): {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_tmpfs_full_disk_skips_saves_and_keeps_every_earlier_checkpoint(small_fs, reference, caplog):
    with caplog.at_level(logging.WARNING, logger="epochal"):
        last, blobs, counts = run(small_fs)
    assert last == EPOCHS and counts.epochs == list(range(1, EPOCHS + 1)) and counts.exits == 1
    cj.assert_same_blobs(blobs, reference["one"])  # training went on, unharmed
    committed = assert_sound(small_fs)
    assert committed == list(range(len(committed))) and 2 <= len(committed) < EPOCHS
    assert any("free space" in w for w in warnings_of(caplog)), warnings_of(caplog)
    # the rerun resumes from the newest checkpoint that made it and ends the same
    last, blobs, counts = run(small_fs)
    assert counts.epochs == list(range(committed[-1] + 1, EPOCHS + 1))
    cj.assert_same_blobs(blobs, reference["one"])
    assert assert_sound(small_fs) == committed


def test_tmpfs_full_disk_raises_after_max_failed_saves_in_a_row(small_fs, caplog):
    """The default bound: three failed saves in a row end train() with CheckpointError naming
    the directory, the epochs and the newest committed one; every committed epoch survives."""
    from epochal import CheckpointError

    with caplog.at_level(logging.WARNING, logger="epochal"), pytest.raises(CheckpointError) as info:
        run(small_fs, max_failed_saves=3)
    committed = assert_sound(small_fs)
    assert committed and committed == list(range(len(committed)))
    msg = str(info.value)
    assert "3 checkpoint saves in a row failed" in msg and str(small_fs) in msg, msg
    first = committed[-1] + 1
    assert f"epochs {first}, {first + 1}, {first + 2}" in msg, msg
    assert f"newest committed checkpoint is epoch {committed[-1]}" in msg, msg
    failed = [w for w in warnings_of(caplog) if "Unable to write checkpoint" in w]
    assert len(failed) == 2, failed  # the third raises instead of warning


def test_tmpfs_real_enospc_in_the_middle_of_a_write(small_fs, reference, caplog, monkeypatch):
    """With every free-space check disabled, the kernel's own ENOSPC hits a write halfway."""
    monkeypatch.setattr(atomic, "check_free_space", lambda path, nbytes: None)
    monkeypatch.setattr(DirectoryMetadataHandler, "_space_needed", lambda self: (0, -1))
    with caplog.at_level(logging.WARNING, logger="epochal"):
        last, blobs, _ = run(small_fs, nodes=("trainer_0", "trainer_1"))
    assert last == EPOCHS
    cj.assert_same_blobs(blobs, reference["two"])
    committed = assert_sound(small_fs)
    assert 1 <= len(committed) < EPOCHS
    failed = [w for w in warnings_of(caplog) if "Unable to write checkpoint" in w]
    assert failed and all(os.strerror(errno.ENOSPC) in w for w in failed), failed
    print(failed[0])


def test_tmpfs_free_space_is_checked_before_writing(small_fs, caplog, monkeypatch):
    """Without a handler nothing estimates; the backend knows the size and refuses up front."""
    writes = []
    real = atomic.write_all
    monkeypatch.setattr(atomic, "write_all", lambda fd, buf: writes.append(fd) or real(fd, buf))
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (1800 * 1024))  # leaves less than one checkpoint free
    with caplog.at_level(logging.WARNING, logger="epochal"):
        last, _, _ = run(small_fs, handler=None, epochs=2)
    assert last == 2 and writes == []  # not one byte written, so no temp file either
    assert sorted(CheckpointDirectory(str(small_fs)).scan()) == []
    assert any("not enough free space" in w for w in warnings_of(caplog)), warnings_of(caplog)


def test_tmpfs_with_retention_never_fills_up(small_fs, reference):
    last, blobs, _ = run(small_fs, handler=DirectoryMetadataHandler(keep_last=2))
    assert last == EPOCHS
    cj.assert_same_blobs(blobs, reference["one"])
    assert assert_sound(small_fs) == [EPOCHS - 1, EPOCHS]


# ----------------------------------------------------------------------------- injected errors

def _fd_path(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def inject(monkeypatch, fail_when, err=errno.ENOSPC, target="write_all"):
    """Make ``atomic.<target>`` raise OSError(err) when ``fail_when(path)`` is true for the file
    being written (after writing part of the data, as a filling disk does)."""
    real = getattr(atomic, target)
    hits = []

    def write_all(fd, buf):
        path = _fd_path(fd)
        if fail_when(path):
            hits.append(path)
            views = buf if isinstance(buf, (list, tuple)) else [buf]
            first = memoryview(views[0]).cast("B")
            os.write(fd, first[: max(1, first.nbytes // 2)])  # a partial write first
            raise OSError(err, os.strerror(err))
        return real(fd, buf)

    def fsync(fd):
        path = _fd_path(fd)
        if fail_when(path):
            hits.append(path)
            raise OSError(err, os.strerror(err))
        return real(fd)

    monkeypatch.setattr(atomic, target, write_all if target == "write_all" else fsync)
    return hits


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO, errno.EDQUOT])
@pytest.mark.parametrize("op", ["write", "commit"])
def test_injected_error_in_one_nodes_db(tmp_path, reference, caplog, err, op):
    """A disk error in one node's db (injected at the byte-store seam: a write that fails half
    way, or a commit whose fsync fails): that epoch is not committed, training goes on."""
    faults = FaultyStore().fail(op, when=lambda p: p.endswith("/trainer_1.3"), err=err)
    with caplog.at_level(logging.WARNING, logger="epochal"), local_store(faults):
        last, blobs, counts = run(tmp_path, nodes=("trainer_0", "trainer_1"))
    assert faults.hits and last == EPOCHS and counts.exits == 1
    cj.assert_same_blobs(blobs, reference["two"])
    committed = assert_sound(tmp_path)
    assert committed == [e for e in range(EPOCHS + 1) if e != 3]
    assert not (tmp_path / "trainer_1.3").exists()  # no file under the failed checkpoint's name
    assert not [n for n in os.listdir(tmp_path) if atomic.parse_temp_path(n)]  # no temp file left
    assert [w for w in warnings_of(caplog) if "epoch 3" in w and os.strerror(err) in w and "trainer_1.3" in w], warnings_of(caplog)


def test_injected_error_keeps_an_older_file_of_the_same_name(tmp_path):
    """Overwriting a checkpoint (the seed's resume-from-k rewrites k+1...) and failing keeps the
    old file intact under its name."""
    run(tmp_path, epochs=3, handler=None)
    before = (tmp_path / "trainer_0.2").read_bytes()
    faults = FaultyStore().fail("write", when=lambda p: p.endswith("/trainer_0.2"), err=errno.ENOSPC)
    job, _ = cj.build_job(3)
    with local_store(faults):
        JobRunner(job, MultiNodeCheckpointManager(str(tmp_path), "native"), resume_from_epoch=1,
                  progress=False).train(LocalSession(Workspace()))
    assert faults.hits
    assert (tmp_path / "trainer_0.2").read_bytes() == before
    assert not [n for n in os.listdir(tmp_path) if atomic.parse_temp_path(n)]


def test_injected_error_writing_the_manifest_leaves_the_epoch_uncommitted(tmp_path, reference, caplog, monkeypatch):
    hits = inject(monkeypatch, lambda p: "manifest.5.json.tmp." in p)
    with caplog.at_level(logging.WARNING, logger="epochal"):
        last, blobs, _ = run(tmp_path)
    assert hits and last == EPOCHS
    assert assert_sound(tmp_path) == [e for e in range(EPOCHS + 1) if e != 5]
    assert (tmp_path / "trainer_0.5").exists()  # complete, but not an epoch without its manifest
    assert any("epoch 5" in w and os.strerror(errno.ENOSPC) in w and "manifest.5.json" in w
               for w in warnings_of(caplog)), warnings_of(caplog)
    # a crash right now would resume from the newest committed epoch, 8 (5 is just skipped)
    h = DirectoryMetadataHandler()
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=["trainer_0"], path_prefix=None, path_type=None)
    assert h.last_epoch() == EPOCHS


def test_a_full_disk_for_the_stats_log_never_fails_a_commit(tmp_path, caplog, monkeypatch):
    inject(monkeypatch, lambda p: p.endswith("stats.jsonl"))
    with caplog.at_level(logging.WARNING, logger="epochal"):
        last, _, _ = run(tmp_path, epochs=2)
    assert last == 2 and assert_sound(tmp_path) == [0, 1, 2]
    assert any("stats" in w for w in warnings_of(caplog))
    assert not [w for w in warnings_of(caplog) if "Unable to write checkpoint" in w]


def test_persistent_failure_then_recovery(tmp_path, reference, monkeypatch):
    """The disk is full for epochs 2-5, then space comes back: training never stopped and the
    next commits resume the series; a crash-resume in between picks epoch 1."""
    state = {"full": False}

    def hook(e, ws):
        state["full"] = 2 <= e <= 5

    inject(monkeypatch, lambda p: state["full"] and ".tmp." in p)
    last, blobs, _ = run(tmp_path, hook=hook)
    assert last == EPOCHS
    cj.assert_same_blobs(blobs, reference["one"])
    assert assert_sound(tmp_path) == [0, 1, 6, 7, 8]
    shutil.rmtree(tmp_path / ".epochal")
    assert CheckpointDirectory(str(tmp_path)).committed_epochs() == []
