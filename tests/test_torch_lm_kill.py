"""kill -9 of examples/torch_lm.py at random moments, inside saves and mid-epoch, on both APIs
(the Checkpointer loop and the Job model): every rerun ends with a final checkpoint byte for
byte the one of an uninterrupted run (model, optimizer, scheduler, RNG, data position, loss
curve, data order), and every committed checkpoint left by a kill verifies.

The runs are forked from a warmed-up zygote (tests/_lm_zygote.py) so that each costs the
training, not the seconds of importing torch; each is still its own process, killed by SIGKILL.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _lm_zygote  # noqa: E402
from _torch_bits import same_state  # noqa: E402

from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.storage.formats.base import get_db_type  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform == "win32", reason="needs fork and SIGKILL")]

STEPS, EVERY = 36, 4  # 100 samples in batches of 12: 9 steps a pass, the last one short
ARGS = ["--steps", str(STEPS), "--save-every", str(EVERY)]
TRIALS = {"loop": 8, "job": 5}  # 13 kills


@pytest.fixture(scope="module")
def zygotes() -> Iterator[list[_lm_zygote.Zygote]]:
    """Two zygotes (two cores): trials run two at a time."""
    zs = [_lm_zygote.Zygote(), _lm_zygote.Zygote()]
    yield zs
    for z in zs:
        z.close()


@pytest.fixture(scope="module")
def zygote(zygotes: list[_lm_zygote.Zygote]) -> _lm_zygote.Zygote:
    return zygotes[0]


def argv(api: str, directory: Path, *extra: str) -> list[str]:
    return ["--api", api, "--ckpt-dir", str(directory), *ARGS, *extra]


def final_of(out: str) -> tuple[str, str]:
    """(final db path, its sha256) from the example's last line."""
    lines = [ln.split() for ln in out.splitlines() if ln.startswith("final ")]
    assert lines, out[-2000:]
    return lines[-1][1], lines[-1][3]


def wait_for(out: Path, text: str, pid_alive: Any, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if text in out.read_text():
                return
        except FileNotFoundError:
            pass
        assert pid_alive(), f"the run ended before printing {text!r}:\n{out.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout}s"
        time.sleep(0.001)


def running(pid: int) -> bool:
    """Whether the zygote's child ``pid`` still runs (an exited child is a zombie until the
    zygote reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True


def temp_files(directory: Path) -> list[str]:
    return [str(p) for p in directory.rglob("*") if ".tmp." in p.name]


@pytest.fixture(scope="module")
def references(zygotes: list[_lm_zygote.Zygote], tmp_path_factory: Any) -> dict[str, tuple[str, str]]:
    base = tmp_path_factory.mktemp("lm_ref")

    def ref(z: _lm_zygote.Zygote, api: str) -> tuple[str, str]:
        rc, out = z.run(argv(api, base / api), base / f"{api}.out")
        assert rc == 0, out[-2000:]
        assert "new run" in out
        return final_of(out)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(TRIALS, pool.map(ref, zygotes, TRIALS)))


def test_both_apis_train_the_same_model(references: dict[str, tuple[str, str]]) -> None:
    """The loop and the Job model run the very same training (different blob lists only)."""
    backend = get_db_type("native")
    loop = backend.read(references["loop"][0])
    job = backend.read(references["job"][0])
    history = loop["history"]
    assert len(history["loss"]) == STEPS and len(history["batches"]) == STEPS
    assert history == job["history"] and loop["step"] == job["step"] == STEPS
    passes = [[i for b in history["batches"][k:k + 9] for i in b] for k in range(0, STEPS, 9)]
    assert all(sorted(p) == list(range(100)) for p in passes) and passes[0] != passes[1]
    for name in ("model", "opt", "sched", "sampler", "rng", "history", "epoch", "step"):
        assert same_state(loop[name], job[name]), name


def kill_once(z: _lm_zygote.Zygote, api: str, directory: Path, rng: random.Random, mode: str,
              extra: list[str], out: Path) -> dict[str, Any]:
    """Start a run and SIGKILL it: ``"temp"``, as soon as a save's temp file exists (inside
    a write); ``"save"``, at a random moment after a save step's line (the save is running:
    fsyncs are slowed); ``"mid"``, at a random moment between two saves, part way through a
    pass over the data. Returns what the kill hit."""
    if mode == "mid":
        target = rng.choice([s for s in range(3, STEPS - 2) if s % EVERY])
        delay, fsync_ms = rng.uniform(0, 0.015), 0.0
    else:
        target, delay, fsync_ms = rng.randrange(EVERY * 2, STEPS, EVERY), rng.uniform(0, 0.09), 25.0
    pid = z.start(argv(api, directory, *extra), out, fsync_ms)
    wait_for(out, f"step {target} ", lambda: running(pid))
    if mode == "temp":
        deadline = time.monotonic() + 30
        while not temp_files(directory) and f"saved step {target}\n" not in out.read_text():
            assert time.monotonic() < deadline and running(pid), out.read_text()[-2000:]
            time.sleep(0.0005)
        delay = rng.uniform(0, 0.005)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    rc = z.wait(pid)
    text = out.read_text()
    assert rc == -signal.SIGKILL, text[-2000:]
    assert "final " not in text
    return {"target": target, "mode": mode, "temp": bool(temp_files(directory)),
            "in_save": mode != "mid" and f"saved step {target}\n" not in text}


def check_directory(directory: Path) -> list[int]:
    d = CheckpointDirectory(directory)
    committed = d.committed_epochs()
    for epoch in committed:
        assert d.verify_epoch(epoch) == [], (directory, epoch)
    return committed


def test_kill_9_at_random_moments_resumes_bit_identical(
    zygotes: list[_lm_zygote.Zygote], references: dict[str, tuple[str, str]], tmp_path: Path
) -> None:
    trials = [(api, i) for api, n in TRIALS.items() for i in range(n)]

    def run_trial(k: int) -> dict[str, Any]:
        api, i = trials[k]
        z = zygotes[k % 2]
        rng = random.Random(4000 + k)
        directory = tmp_path / f"{api}{i}"
        extra = ["--async-save"] if i % 3 == 2 else []
        got = kill_once(z, api, directory, rng, ("temp", "mid", "save")[k % 3], extra=extra,
                        out=tmp_path / f"{api}{i}.kill")
        check_directory(directory)
        rc, out = z.run(argv(api, directory, *extra), tmp_path / f"{api}{i}.rerun")
        assert rc == 0, out[-2000:]
        got["resumed"] = "resumed at step" in out
        assert final_of(out)[1] == references[api][1], f"{api} trial {i} ({got}): final state differs"
        return got

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run_trial, range(len(trials))))
    stats = {"kills": len(results), "in_save": sum(r["in_save"] for r in results),
             "temp": sum(r["temp"] for r in results), "resumed": sum(r["resumed"] for r in results),
             "mid_epoch": sum(r["target"] % EVERY != 0 for r in results)}
    print(f"\n{stats}")
    assert stats["kills"] >= 10 and stats["mid_epoch"] >= 4, stats
    assert stats["in_save"] >= 6 and stats["temp"] >= 3, stats
    assert stats["resumed"] >= stats["kills"] - 2, stats


@pytest.mark.parametrize("api", list(TRIALS))
def test_sigterm_saves_exits_143_and_the_rerun_finishes_identical(
    zygotes: list[_lm_zygote.Zygote], references: dict[str, tuple[str, str]], tmp_path: Path, api: str
) -> None:
    zygote = zygotes[list(TRIALS).index(api)]
    out = tmp_path / "term.out"
    pid = zygote.start(argv(api, tmp_path / "ckpt", "--step-sleep", "0.01"), out)
    wait_for(out, "step 11 ", lambda: running(pid))
    os.kill(pid, signal.SIGTERM)
    assert zygote.wait(pid) == 143
    text = out.read_text()
    assert "preempted" in text and "final " not in text
    committed = check_directory(tmp_path / "ckpt")
    assert committed and max(committed) * (EVERY if api == "job" else 1) < STEPS
    rc, again = zygote.run(argv(api, tmp_path / "ckpt"), tmp_path / "rerun.out")
    assert rc == 0 and "resumed at step" in again, again[-2000:]
    assert final_of(again)[1] == references[api][1]
