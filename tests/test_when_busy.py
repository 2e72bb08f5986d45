"""``Checkpointer(async_save=True, when_busy="skip")`` in one process: a save that would wait for
the previous one's background write is skipped (nothing written, nothing blocked, its step
in ``skipped``), except a save due for the store and the save after a SIGTERM; the next save
that finds the way clear writes the state as it is then, which a fresh process restores.
(Across ranks: tests/test_tier_dist.py.)"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _fresh  # noqa: E402

from epochal import Checkpointer  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.checkpoint.tasks.background import BackgroundSaver  # noqa: E402

pytestmark = pytest.mark.system

READ = """
import sys
import numpy as np
from epochal import Checkpointer
state = {"w": None}
with Checkpointer(sys.argv[1]) as ck:
    step = ck.restore(state, int(sys.argv[2]))
print("STEP", step, "SUM", float(state["w"].sum()))
"""


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Background writes wait for this event (a write stays in flight until it is set)."""
    event = threading.Event()
    write = BackgroundSaver._write

    def gated(self, *args, **kw):  # type: ignore[no-untyped-def]
        assert event.wait(60)
        return write(self, *args, **kw)

    monkeypatch.setattr(BackgroundSaver, "_write", gated)
    return event


def restored_sum(tmp_path: Path, directory: Path, step: int) -> float:
    script = tmp_path / "read.py"
    script.write_text(READ)
    p = _fresh.run(str(script), [str(directory), str(step)], timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    line = next(x for x in p.stdout.splitlines() if x.startswith("STEP"))
    assert int(line.split()[1]) == step
    return float(line.split()[3])


def test_saves_while_the_write_runs_are_skipped(tmp_path: Path, gate: threading.Event) -> None:
    w = np.arange(1000.0)
    with Checkpointer(tmp_path / "ck", async_save=True, when_busy="skip") as ck:
        ck.save(1, {"w": w})  # held in flight at the gate
        sums = {1: float(w.sum())}
        for step in (2, 3):
            w += 1.0
            t0 = time.perf_counter()
            ck.save(step, {"w": w})
            assert time.perf_counter() - t0 < 5  # (did not wait for the gate)
        assert ck.skipped == [2, 3]
        gate.set()
        ck.wait()
        w += 1.0
        ck.save(4, {"w": w})  # the way is clear: the state as it is now
        sums[4] = float(w.sum())
        ck.wait()
        assert ck.skipped == [2, 3] and ck.steps() == [1, 4]
    assert CheckpointDirectory(str(tmp_path / "ck")).committed_epochs() == [1, 4]
    assert restored_sum(tmp_path, tmp_path / "ck", 4) == sums[4]
    assert restored_sum(tmp_path, tmp_path / "ck", 1) == sums[1]


def test_the_save_after_a_sigterm_is_never_skipped(tmp_path: Path, gate: threading.Event) -> None:
    w = np.zeros(100)
    with Checkpointer(tmp_path / "ck", async_save=True, when_busy="skip") as ck:
        ck.save(1, {"w": w})
        w += 1.0
        ck.save(2, {"w": w})
        assert ck.skipped == [2]
        os.kill(os.getpid(), signal.SIGTERM)
        assert ck.preempted
        threading.Timer(0.5, gate.set).start()
        w += 1.0
        ck.save(3, {"w": w})  # waits for step 1's write, then is written
        ck.wait()
        assert ck.skipped == [2] and ck.steps() == [1, 3]
    assert restored_sum(tmp_path, tmp_path / "ck", 3) == 200.0


def test_with_a_local_tier_a_save_due_for_the_store_is_never_skipped(tmp_path: Path,
                                                                     gate: threading.Event) -> None:
    w = np.zeros(100)
    with Checkpointer(tmp_path / "store", local=tmp_path / "local", persist_every=3, async_save=True,
                      when_busy="skip") as ck:
        ck.save(1, {"w": w})  # local only, in flight
        w += 1.0
        ck.save(2, {"w": w})  # skipped
        threading.Timer(0.5, gate.set).start()
        w += 1.0
        ck.save(3, {"w": w})  # due for the store: waits, then is written
        ck.wait()
        assert ck.skipped == [2]
    assert CheckpointDirectory(str(tmp_path / "local")).committed_epochs() == [1, 3]
    assert CheckpointDirectory(str(tmp_path / "store")).committed_epochs() == [3]
    assert restored_sum(tmp_path, tmp_path / "store", 3) == 200.0


def test_when_busy_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="when_busy must be 'wait' or 'skip'"):
        Checkpointer(tmp_path / "a", async_save=True, when_busy="queue")
    with pytest.raises(ValueError, match="needs async_save=True"):
        Checkpointer(tmp_path / "b", when_busy="skip")


def test_across_ranks_without_a_tier_the_same_saves_are_skipped(tmp_path: Path) -> None:
    """Two ranks (FSDP2), the store only: one rank's slow write makes both skip the same
    saves; the next save after the way is clear is written, and fresh ranks restore it."""
    pytest.importorskip("torch", reason="the torch extra is not installed")
    from _dist_workers import run_ranks
    from _dist_workers_more import restore_gathered, skipped_saves

    out = str(tmp_path / "at6.json")
    run_ranks(skipped_saves, 2, str(tmp_path / "ck"), out)
    assert CheckpointDirectory(str(tmp_path / "ck")).committed_epochs() == [1, 6]
    run_ranks(restore_gathered, 2, str(tmp_path / "ck"), out)
