"""The Checkpointer's steps: ``restore(state, step=N)`` restores a
chosen committed step and refuses an uncommitted or damaged one by name; the first save of a
step below the newest committed one without a restore warns; errors and the SIGTERM message
say "step"."""

from __future__ import annotations

import logging
import os
import re
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal import Checkpointer, get_db_type
from epochal.errors import CheckpointCorruptError, CheckpointNotFoundError, UnsupportedBlobError


def w_at(step: int) -> np.ndarray:
    return np.arange(4, dtype=np.float64) + 10 * step


def fill(d: Path, steps: list[int]) -> None:
    with Checkpointer(d) as ck:
        for s in steps:
            ck.save(s, {"w": w_at(s), "n": s})


def test_restore_a_chosen_committed_step(tmp_path: Path) -> None:
    fill(tmp_path, [1, 2, 3])
    state: dict[str, Any] = {"w": np.zeros(4), "n": -1}
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(state, step=2) == 2
        assert ck.last_step == 2
    assert state["w"].tobytes() == w_at(2).tobytes() and state["n"] == 2
    with Checkpointer(tmp_path) as ck:  # and without step=: the newest
        assert ck.restore(state) == 3
    assert state["w"].tobytes() == w_at(3).tobytes()


def test_restore_of_an_uncommitted_step_names_it(tmp_path: Path) -> None:
    fill(tmp_path, [1, 2])
    get_db_type("native").write(str(tmp_path / "local.5"), {"w": w_at(5), "n": 5})  # killed before its commit
    state: dict[str, Any] = {"w": np.zeros(4), "n": -1}
    with Checkpointer(tmp_path) as ck:
        for step in (5, 7):
            with pytest.raises(CheckpointNotFoundError, match=rf"step {step} of .* is not committed") as info:
                ck.restore(state, step=step)
            assert "committed steps: 1, 2" in str(info.value) and not re.search(r"\bepochs?\b", str(info.value))
        with pytest.raises(ValueError, match="step must be"):
            ck.restore(state, step=-1)
    assert state["w"].tobytes() == np.zeros(4).tobytes() and state["n"] == -1


@pytest.mark.parametrize("where", ["data", "manifest"])
def test_restore_of_a_damaged_step_names_step_and_file_and_does_not_fall_back(tmp_path: Path, where: str) -> None:
    fill(tmp_path, [1, 2, 3])
    path = tmp_path / "local.2" if where == "data" else tmp_path / ".epochal" / "manifest.2.json"
    data = bytearray(path.read_bytes())
    data[-20 if where == "data" else 30] ^= 0x01
    path.write_bytes(bytes(data))
    state: dict[str, Any] = {"w": np.zeros(4), "n": -1}
    with Checkpointer(tmp_path) as ck:
        with pytest.raises((CheckpointCorruptError, CheckpointNotFoundError)) as info:
            ck.restore(state, step=2)
    msg = str(info.value)
    assert "step 2" in msg and path.name in msg and "epoch 2" not in msg, msg
    assert state["w"].tobytes() == np.zeros(4).tobytes() and state["n"] == -1  # no fallback to 1


def test_first_save_below_the_newest_committed_step_warns(tmp_path: Path, caplog: Any) -> None:
    fill(tmp_path, [100, 200, 300])
    with caplog.at_level(logging.WARNING, logger="epochal"):
        with Checkpointer(tmp_path) as ck:
            ck.save(10, {"w": w_at(10)})
            ck.save(20, {"w": w_at(20)})
    warned = [r.getMessage() for r in caplog.records if "earlier run" in r.getMessage()]
    assert len(warned) == 1 and "step 10" in warned[0] and "up to 300" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="epochal"):
        with Checkpointer(tmp_path) as ck:  # restore() first: the user chose to continue
            state = {"w": np.zeros(4)}
            assert ck.restore(state) == 300
            ck.save(10, state)
        with Checkpointer(tmp_path / "new") as ck:  # an empty directory
            ck.save(1, {"w": w_at(1)})
        with Checkpointer(tmp_path) as ck:  # above the newest
            ck.save(400, {"w": w_at(400)})
    assert not [r for r in caplog.records if "earlier run" in r.getMessage()]


def test_errors_say_step(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(UnsupportedBlobError) as info:
            ck.save(3, {"w": np.array([1, "a"], dtype=object)})
    assert "step 3" in str(info.value) and not re.search(r"\bepochs?\b", str(info.value)), str(info.value)


def test_failed_saves_in_a_row_say_step(tmp_path: Path, monkeypatch: Any) -> None:
    backend = get_db_type("native")
    real = type(backend).write

    def failing(self: Any, path: str, blobs: Any, *a: Any, **kw: Any) -> Any:
        if not path.endswith(".0"):
            raise OSError(28, "No space left on device (test)", path)
        return real(self, path, blobs, *a, **kw)

    monkeypatch.setattr(type(backend), "write", failing)
    with Checkpointer(tmp_path, max_failed_saves=2) as ck:
        ck.save(0, {"w": w_at(0)})
        ck.save(1, {"w": w_at(1)})  # a warning: one failure
        with pytest.raises(Exception, match=r"2 checkpoint saves in a row failed .*\(steps 1, 2; the newest "
                                            r"committed checkpoint is step 0\)") as info:
            ck.save(2, {"w": w_at(2)})
        assert not re.search(r"\bepochs?\b", str(info.value))
        assert ck.steps() == [0]
    with Checkpointer(tmp_path / "b") as ck:  # the default (1): each failure raises its own error
        with pytest.raises(OSError, match="No space left"):
            ck.save(1, {"w": w_at(1)})


def test_sigterm_message_says_step(tmp_path: Path, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="epochal"):
        with Checkpointer(tmp_path) as ck:
            os.kill(os.getpid(), signal.SIGTERM)
            assert ck.preempted
    msgs = [r.getMessage() for r in caplog.records if "SIGTERM" in r.getMessage()]
    assert msgs and "finishing this step" in msgs[0], msgs
