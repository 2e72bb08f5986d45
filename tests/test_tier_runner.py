"""The JobRunner's local tier (``JobRunner(job, manager, local=DIR, persist_every=K)``): every
epoch's save in DIR, the multiples of K, the final epoch and a preempted one also in the
manager's directory, and the newest local epoch when the run fails with an error; a fresh
process resumes from the newest intact epoch of either place, the local copy first,
bit-identical to a run that was never stopped."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from epochal.checkpoint.location.view import CheckpointDirectory

pytestmark = pytest.mark.system

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tier_runner_job.py")
KILLED, PREEMPTED = -9, 3


def job(tmp: Path, *args: str, rc: int = 0) -> subprocess.CompletedProcess[str]:
    """Run the job on ``tmp/store`` and ``tmp/local`` in a fresh process; check its exit status."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.environ.get("PYTHONPATH", "")] + sys.path if p))
    p = subprocess.run([sys.executable, JOB, str(tmp / "store"), str(tmp / "local"), *args],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == rc, (p.returncode, p.stdout, p.stderr[-3000:])
    return p


def marks(p: subprocess.CompletedProcess[str], name: str) -> dict[int, str]:
    """``{epoch: hash}`` of the ``name`` lines the job printed."""
    out = {}
    for line in p.stdout.splitlines():
        if line.startswith(name + " "):
            _, epoch, digest = line.split()
            out[int(epoch)] = digest
    return out


def committed(d: Path) -> list[int]:
    return CheckpointDirectory(str(d)).committed_epochs()


def dbs(d: Path) -> list[str]:
    return sorted(x.name for x in d.iterdir() if x.name.startswith("trainer_"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The state after each of 7 epochs never interrupted (and DONE's as epoch -1)."""
    p = job(tmp_path_factory.mktemp("ref"), "--epochs", "7", "--persist", "3")
    return {**marks(p, "EPOCH"), -1: marks(p, "DONE")[7]}


@pytest.mark.parametrize("args", [[], ["--async", "--nodes", "2"]], ids=["sync", "async-2-nodes"])
def test_every_epoch_local_every_kth_and_the_final_in_the_store(tmp_path: Path, args: list[str]) -> None:
    job(tmp_path, "--epochs", "7", "--persist", "3", *args)
    nodes = ["trainer_0", "trainer_1"] if "--nodes" in args else ["trainer_0"]
    assert committed(tmp_path / "store") == [0, 3, 6, 7]  # epoch 0 (the init save), 3, 6, and the final 7
    assert dbs(tmp_path / "store") == sorted(f"{n}.{e}" for n in nodes for e in (0, 3, 6, 7))
    assert committed(tmp_path / "local") == [6, 7]  # local_keep=2
    assert dbs(tmp_path / "local") == sorted(f"{n}.{e}" for n in nodes for e in (6, 7))
    for n in nodes:  # the store's copy is the local db, byte for byte
        assert (tmp_path / "store" / f"{n}.7").read_bytes() == (tmp_path / "local" / f"{n}.7").read_bytes()
    assert CheckpointDirectory(str(tmp_path / "store")).read_manifest(7).final
    verify = subprocess.run([sys.executable, "-m", "epochal", "verify", str(tmp_path / "local")],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    again = job(tmp_path, "--epochs", "7", "--persist", "3", *args)  # a finished job: nothing more runs
    assert "resuming from epoch 7 in " + str(tmp_path / "local") in again.stderr, again.stderr
    assert marks(again, "EPOCH") == {} and list(marks(again, "DONE")) == [7]


@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["sync", "async"])
def test_killed_after_a_local_only_epoch_resumes_from_it(tmp_path: Path, reference: dict[int, str],
                                                         mode: list[str]) -> None:
    job(tmp_path, "--epochs", "7", "--persist", "3", "--kill-after", "4", *mode, rc=KILLED)
    assert committed(tmp_path / "store") == [0, 3] and dbs(tmp_path / "store") == ["trainer_0.0", "trainer_0.3"]
    assert committed(tmp_path / "local") == [3, 4] and dbs(tmp_path / "local") == ["trainer_0.3", "trainer_0.4"]
    p = job(tmp_path, "--epochs", "7", "--persist", "3", *mode)
    assert f"resuming from epoch 4 in {tmp_path / 'local'}" in p.stderr, p.stderr
    assert marks(p, "LOADED") == {4: reference[4]}  # bit-identical blobs
    assert marks(p, "DONE") == {7: reference[-1]}


def test_local_dir_wiped_resumes_from_the_store(tmp_path: Path, reference: dict[int, str]) -> None:
    job(tmp_path, "--epochs", "7", "--persist", "3", "--kill-after", "4", rc=KILLED)
    shutil.rmtree(tmp_path / "local")  # a replaced machine
    p = job(tmp_path, "--epochs", "7", "--persist", "3")
    assert f"resuming from epoch 3 in {tmp_path / 'store'}" in p.stderr, p.stderr
    assert marks(p, "LOADED") == {3: reference[3]}
    assert marks(p, "DONE") == {7: reference[-1]}


def flip(db: Path) -> None:
    """Flip one byte in the middle of a db (a blob's data, not its header)."""
    data = bytearray(db.read_bytes())
    data[len(data) // 2] ^= 0x40
    db.write_bytes(bytes(data))


@pytest.mark.parametrize(("first", "persist", "bad", "place", "epoch"), [
    (["--epochs", "7", "--kill-after", "4"], "3", 4, "local", 3),  # the store has 0 and 3: local 3 is nearer
    (["--epochs", "6"], "2", 6, "store", 6),  # the store holds the same epoch (a finished run of 6)
], ids=["next-older-local", "same-epoch-in-the-store"])
def test_damaged_local_db_is_named_and_skipped(tmp_path: Path, reference: dict[int, str], first: list[str],
                                               persist: str, bad: int, place: str, epoch: int) -> None:
    job(tmp_path, *first, "--persist", persist, rc=KILLED if "--kill-after" in first else 0)
    damaged = tmp_path / "local" / f"trainer_0.{bad}"
    flip(damaged)
    p = job(tmp_path, "--epochs", "7", "--persist", persist)
    assert str(damaged) in p.stderr and "damaged" in p.stderr, p.stderr
    assert f"resuming from epoch {epoch} in {tmp_path / place}" in p.stderr, p.stderr
    assert marks(p, "LOADED") == {epoch: reference[epoch]}
    assert marks(p, "DONE") == {7: reference[-1]}


def test_a_preempted_epoch_goes_to_the_store(tmp_path: Path, reference: dict[int, str]) -> None:
    p = job(tmp_path, "--epochs", "7", "--persist", "3", "--term-after", "4", rc=PREEMPTED)
    assert "PREEMPTED 4" in p.stdout
    assert committed(tmp_path / "store") == [0, 3, 4] and "trainer_0.4" in dbs(tmp_path / "store")
    shutil.rmtree(tmp_path / "local")
    p = job(tmp_path, "--epochs", "7", "--persist", "3")
    assert marks(p, "LOADED") == {4: reference[4]} and marks(p, "DONE") == {7: reference[-1]}


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    from epochal import CheckpointManager, Job, JobRunner, LocalSession, Node, Task
    from epochal.errors import CheckpointError

    with Node("trainer_0"), Job() as j:
        Task(step=lambda ws: None)
    manager = CheckpointManager(str(tmp_path / "store"), "trainer_0")
    with pytest.raises(ValueError, match="persist_every"):
        JobRunner(j, manager, local=str(tmp_path / "l"), persist_every=0)
    with pytest.raises(ValueError, match="local_keep"):
        JobRunner(j, manager, local=str(tmp_path / "l"), local_keep=0)
    with pytest.raises(ValueError, match="not a URL"):
        JobRunner(j, manager, local="s3://bucket/x")
    with pytest.raises(ValueError, match="max_failures"):
        JobRunner(j, manager, local=str(tmp_path / "l"), max_failures=1)
    with pytest.raises(CheckpointError, match="DirectoryMetadataHandler"):  # no handler: no committed epochs
        JobRunner(j, manager, local=str(tmp_path / "l")).train(LocalSession())


FAILED = 4  # the job's exit status when train() raised its RuntimeError


@pytest.mark.parametrize("args", [[], ["--async", "--nodes", "2"]], ids=["sync", "async-2-nodes"])
def test_a_run_failing_with_an_error_copies_its_newest_local_epoch_to_the_store(
        tmp_path: Path, reference: dict[int, str], args: list[str]) -> None:
    p = job(tmp_path, "--epochs", "7", "--persist", "100", "--fail-at", "5", *args, rc=FAILED)
    assert "FAILED RuntimeError: boom at epoch 5" in p.stdout and "NOTE" not in p.stdout, p.stdout
    nodes = ["trainer_0", "trainer_1"] if "--nodes" in args else ["trainer_0"]
    assert committed(tmp_path / "store") == [0, 4]  # the init save, then the newest local epoch
    assert dbs(tmp_path / "store") == sorted(f"{n}.{e}" for n in nodes for e in (0, 4))
    for n in nodes:  # the local db, byte for byte
        assert (tmp_path / "store" / f"{n}.4").read_bytes() == (tmp_path / "local" / f"{n}.4").read_bytes()
    shutil.rmtree(tmp_path / "local")  # the machine replaced
    p = job(tmp_path, "--epochs", "7", "--persist", "100", *args)
    assert f"resuming from epoch 4 in {tmp_path / 'store'}" in p.stderr, p.stderr
    assert marks(p, "LOADED") == {4: reference[4]}  # bit-identical blobs
    assert marks(p, "DONE") == {7: reference[-1]}


def test_a_damaged_local_epoch_is_not_copied_on_an_error(tmp_path: Path, reference: dict[int, str]) -> None:
    p = job(tmp_path, "--epochs", "7", "--persist", "100", "--fail-at", "5", "--damage-local", "4", rc=FAILED)
    assert "FAILED RuntimeError: boom at epoch 5" in p.stdout, p.stdout
    damaged = tmp_path / "local" / "trainer_0.4"
    assert f"Epoch 4 of {tmp_path / 'local'} is damaged and was not copied" in p.stderr, p.stderr
    assert str(damaged) in p.stderr, p.stderr
    assert committed(tmp_path / "store") == [0, 3]  # the next older local epoch, intact
    assert dbs(tmp_path / "store") == ["trainer_0.0", "trainer_0.3"]
    shutil.rmtree(tmp_path / "local")
    p = job(tmp_path, "--epochs", "7", "--persist", "100")
    assert f"resuming from epoch 3 in {tmp_path / 'store'}" in p.stderr, p.stderr
    assert marks(p, "LOADED") == {3: reference[3]} and marks(p, "DONE") == {7: reference[-1]}


def test_a_failed_copy_on_an_error_leaves_the_error_and_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "store" / "trainer_0.4").mkdir(parents=True)  # the copy cannot take this name
    (tmp_path / "store" / "trainer_0.4" / "in-the-way").write_text("x")
    p = job(tmp_path, "--epochs", "7", "--persist", "100", "--fail-at", "5", rc=FAILED)
    assert "FAILED RuntimeError: boom at epoch 5" in p.stdout, p.stdout  # the run's own error
    local_db = tmp_path / "local" / "trainer_0.4"
    if sys.version_info >= (3, 11):  # (a note on the error: Python 3.11's add_note)
        note = [line for line in p.stdout.splitlines() if line.startswith("NOTE ")]
        assert len(note) == 1 and f"epoch 4 ({local_db}) was not copied to {tmp_path / 'store'}" in note[0], p.stdout
    assert f"Epoch 4 ({local_db}) was not copied" in p.stderr, p.stderr
    assert committed(tmp_path / "store") == [0] and committed(tmp_path / "local") == [3, 4]
