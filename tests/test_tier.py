"""The local tier of one process (``Checkpointer(path, local=DIR, persist_every=K)``): every save
in DIR, every K-th (and the last, at close) in ``path``; a fresh process resumes from the
newest intact step of either place, the local copy first, bit-identical to a run that was never
stopped; a SIGKILL inside a local write or inside a copy to the store loses nothing committed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")

import _fresh  # noqa: E402

from epochal import Checkpointer  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")]

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tier_job.py")


def job(tmp: Path, out: str, *args: str, rc: int = 0) -> subprocess.CompletedProcess[str]:
    """Run the training job on ``tmp/store`` and ``tmp/local``; check its exit status."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.environ.get("PYTHONPATH", "")] + sys.path if p))
    p = _fresh.run(JOB, [str(tmp / "store"), str(tmp / "local"), str(tmp / out), *args], env=env, timeout=120)
    assert p.returncode == rc, (p.returncode, p.stdout, p.stderr[-3000:])
    return p


def resumed(p: subprocess.CompletedProcess[str]) -> tuple[int, str]:
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESUMED"))
    _, step, source = line.split()
    return int(step), source


def fingerprint(tmp: Path, out: str) -> dict[str, str]:
    return dict(json.loads((tmp / out).read_text()))


def listed(d: Path) -> list[int]:
    return CheckpointDirectory(str(d)).committed_epochs()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The final state of 6 steps never interrupted."""
    tmp = tmp_path_factory.mktemp("ref")
    job(tmp, "ref.json", "--steps", "6", "--persist", "3")
    return fingerprint(tmp, "ref.json")


KILLED = -9


@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["sync", "async"])
def test_killed_run_resumes_from_local_bit_identical(tmp_path: Path, reference: dict[str, str],
                                                     mode: list[str]) -> None:
    job(tmp_path, "a.json", "--steps", "6", "--persist", "3", "--kill-after", "4", *mode, rc=KILLED)
    assert listed(tmp_path / "store") == [3]      # the 3rd save only: killed before close
    assert listed(tmp_path / "local") == [3, 4]   # local_keep=2
    p = job(tmp_path, "b.json", "--steps", "6", "--persist", "3", *mode)
    assert resumed(p) == (4, "local")
    assert fingerprint(tmp_path, "b.json") == reference


def test_local_wiped_resumes_from_the_store(tmp_path: Path, reference: dict[str, str]) -> None:
    job(tmp_path, "a.json", "--steps", "6", "--persist", "3", "--kill-after", "4", rc=KILLED)
    shutil.rmtree(tmp_path / "local")  # a replaced machine
    p = job(tmp_path, "b.json", "--steps", "6", "--persist", "3")
    assert resumed(p) == (3, "durable")
    assert fingerprint(tmp_path, "b.json") == reference


def flip(db: Path) -> None:
    """Flip one byte in the middle of a db (a blob's data, not its header)."""
    data = bytearray(db.read_bytes())
    data[len(data) // 2] ^= 0x40
    db.write_bytes(bytes(data))


def test_damaged_local_newest_is_named_and_the_stores_copy_used(tmp_path: Path, reference: dict[str, str]) -> None:
    job(tmp_path, "a.json", "--steps", "6", "--persist", "2", "--kill-after", "4", rc=KILLED)
    assert listed(tmp_path / "store") == [2, 4] and listed(tmp_path / "local") == [3, 4]
    bad = tmp_path / "local" / "local.4"
    flip(bad)
    p = job(tmp_path, "b.json", "--steps", "6", "--persist", "2")
    assert resumed(p) == (4, "durable")
    assert str(bad) in p.stderr and "damaged" in p.stderr, p.stderr[-2000:]
    assert fingerprint(tmp_path, "b.json") == reference


def test_damaged_local_newest_falls_back_to_the_next_newest_step(tmp_path: Path, reference: dict[str, str]) -> None:
    job(tmp_path, "a.json", "--steps", "6", "--persist", "3", "--kill-after", "4", rc=KILLED)
    flip(tmp_path / "local" / "local.4")  # the store holds step 3 only: local step 3 is the nearest intact
    p = job(tmp_path, "b.json", "--steps", "6", "--persist", "3")
    assert resumed(p) == (3, "local")
    assert str(tmp_path / "local" / "local.4") in p.stderr
    assert fingerprint(tmp_path, "b.json") == reference


@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["sync", "async"])
def test_persist_every_cadence(tmp_path: Path, mode: list[str]) -> None:
    job(tmp_path, "a.json", "--steps", "7", "--persist", "3", *mode)
    assert listed(tmp_path / "store") == [3, 6, 7]  # every 3rd save, and the last at close
    assert listed(tmp_path / "local") == [6, 7]
    store = sorted(x.name for x in (tmp_path / "store").iterdir() if x.name.startswith("local."))
    assert store == ["local.3", "local.6", "local.7"]
    # the copies are the local bytes: the same db, byte for byte
    assert (tmp_path / "store" / "local.7").read_bytes() == (tmp_path / "local" / "local.7").read_bytes()
    ls = subprocess.run([sys.executable, "-m", "epochal", "verify", str(tmp_path / "local")],
                        capture_output=True, text=True)
    assert ls.returncode == 0 and "local.7" in ls.stdout, ls.stdout + ls.stderr


@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["sync", "async"])
def test_kill_inside_a_local_write(tmp_path: Path, reference: dict[str, str], mode: list[str]) -> None:
    job(tmp_path, "a.json", "--steps", "6", "--persist", "3", "--kill-in", "local", "--kill-step", "5", *mode,
        rc=KILLED)
    assert 5 not in listed(tmp_path / "local")
    assert listed(tmp_path / "store") == [3]
    p = job(tmp_path, "b.json", "--steps", "6", "--persist", "3", *mode)
    assert resumed(p) == (4, "local")  # (async: step 4 was committed as step 5's save began)
    assert fingerprint(tmp_path, "b.json") == reference


@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["sync", "async"])
def test_kill_inside_the_copy_to_the_store(tmp_path: Path, reference: dict[str, str], mode: list[str]) -> None:
    job(tmp_path, "a.json", "--steps", "6", "--persist", "3", "--kill-in", "durable", "--kill-step", "6", *mode,
        rc=KILLED)
    assert listed(tmp_path / "store") == [3]  # the interrupted copy is not committed
    assert not (tmp_path / "store" / "local.6").exists()
    p = job(tmp_path, "b.json", "--steps", "6", "--persist", "3", *mode)
    # sync: the local step 6 was committed before its copy began; async: 5 is the newest committed
    assert resumed(p) == ((6, "local") if not mode else (5, "local"))
    assert fingerprint(tmp_path, "b.json") == reference


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="local_keep"):
        Checkpointer(tmp_path / "a", local=tmp_path / "l", local_keep=0)
    with pytest.raises(ValueError, match="persist_every"):
        Checkpointer(tmp_path / "b", local=tmp_path / "l", persist_every=0)
    with pytest.raises(ValueError, match="not a URL"):
        Checkpointer(tmp_path / "c", local="s3://bucket/x")


def du(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm (tmpfs) here")
def test_ls_states_the_host_memory_a_local_tier_holds(tmp_path: Path) -> None:
    """``epochal ls`` on a RAM-backed local directory: the bytes it holds (every file), within
    the docs' ``local_keep x S``; on an ordinary directory no such line."""
    import torch

    local = Path("/dev/shm") / f"epochal-ls-{os.getpid()}-{tmp_path.name}"
    try:
        state = {"w": torch.arange(1 << 18, dtype=torch.float32)}  # S: 1 MiB of tensor bytes
        with Checkpointer(tmp_path / "store", local=local, persist_every=None, local_keep=2) as ck:
            for step in (1, 2, 3):
                ck.save(step, state)
        assert listed(local) == [2, 3]
        run = [sys.executable, "-m", "epochal", "ls"]
        got = json.loads(subprocess.run([*run, str(local), "--json"], capture_output=True, text=True,
                                        check=True).stdout)["held"]
        assert got["ram"] is True and got["total"] == got["own"] == du(local) and got["peers"] == 0
        assert 2 << 20 <= got["total"] <= (2 << 20) + (256 << 10)  # local_keep x S, and little else
        text = subprocess.run([*run, str(local)], capture_output=True, text=True, check=True).stdout
        assert f"{local} holds " in text and "of host memory" in text, text
    finally:
        shutil.rmtree(local, ignore_errors=True)
    plain = subprocess.run([*run, str(tmp_path / "store")], capture_output=True, text=True, check=True).stdout
    assert " holds " not in plain, plain
