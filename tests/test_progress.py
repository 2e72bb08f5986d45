"""TerminalProgress: epoch lines, I/O bars, and silence when not wanted (not a TTY, CI, quiet)."""

from __future__ import annotations

import io
import logging
import os
from typing import Any

import numpy as np
import pytest

from epochal import (
    CheckpointEvent,
    CheckpointManager,
    Job,
    JobRunner,
    LocalSession,
    Node,
    Task,
    epoch_limiter,
)
from epochal.progress import TerminalProgress, display_wanted
from epochal.storage.formats.base import IO_PROGRESS, report_progress


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Init:
    def __call__(self, ws: Any) -> None:
        ws["w"] = np.zeros(1000, dtype=np.float64)


class _Train:
    def __call__(self, ws: Any) -> None:
        ws["w"] = ws["w"] + 1


def _job(epochs: int) -> Job:
    with Node("trainer"):
        with Job() as job:
            with job.init_group:
                Task(step=_Init())
            Task(step=_Train())
            epoch_limiter(job, epochs)
    return job


def _train(tmp_path: Any, display: TerminalProgress, epochs: int = 3, job: Job | None = None,
           resume_from_epoch: int | None = None) -> int:
    manager = CheckpointManager(str(tmp_path), "trainer")
    runner = JobRunner(job or _job(epochs), manager, resume_from_epoch=resume_from_epoch,
                       listeners=[display], progress=False)
    return runner.train(LocalSession())


@pytest.mark.parametrize("use_rich", [True, False])
def test_epoch_lines_of_a_real_run(tmp_path: Any, use_rich: bool) -> None:
    buf = io.StringIO()
    assert _train(tmp_path, TerminalProgress(force=True, stream=buf, use_rich=use_rich)) == 3
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("training from scratch on 1 node(s): trainer")
    assert any(line.startswith("checkpoint 0: saved") for line in lines)
    for epoch in (1, 2, 3):
        [line] = [x for x in lines if x.startswith(f"epoch {epoch:>4}")]
        assert "| saved" in line and "KiB in" in line and (" s " in line or " ms " in line)
    assert lines[-1].startswith("finished at epoch 3")


def test_load_failure_and_preemption_lines() -> None:
    buf = io.StringIO()
    p = TerminalProgress(force=True, stream=buf, use_rich=False)
    p.on_train_start(4, ["a", "b"])
    p.on_checkpoint_start("checkpoint_load", 4)
    p.on_checkpoint(CheckpointEvent("checkpoint_load", 4, 0.5, 3 << 20, True))
    p.on_epoch_start(5)
    p.on_epoch_end(5, 2.0)
    p.on_checkpoint_start("checkpoint_save", 5)
    p.on_checkpoint(CheckpointEvent("checkpoint_save", 5, 0.1, 0, False, "disk full"))
    p.on_epoch_start(6)
    p.on_epoch_end(6, 75.0)
    p.on_train_end(6, True)
    p.close()
    lines = buf.getvalue().splitlines()
    assert lines[0] == "training resuming from epoch 4 on 2 node(s): a, b"
    assert lines[1].startswith("checkpoint 4: loaded 3.0 MiB in 500.0 ms")
    assert lines[2].startswith("epoch    5") and "save FAILED: disk full" in lines[2]
    assert lines[3].startswith("epoch    6") and "1m15s" in lines[3]
    assert lines[4].startswith("preempted: stopped after epoch 6")


def test_silent_when_not_wanted(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    monkeypatch.delenv("EPOCHAL_QUIET", raising=False)
    monkeypatch.delenv("CI", raising=False)
    assert display_wanted(FakeTTY())
    assert not display_wanted(io.StringIO())  # not a terminal
    monkeypatch.setenv("CI", "true")
    assert not display_wanted(FakeTTY())
    monkeypatch.delenv("CI")
    monkeypatch.setenv("EPOCHAL_QUIET", "1")  # what a user may set
    assert not display_wanted(FakeTTY())
    quiet_tty = FakeTTY()
    display = TerminalProgress(stream=quiet_tty)
    assert not display.enabled
    with caplog.at_level(logging.INFO, logger="epochal.progress"):
        _train(tmp_path, display, epochs=2)
    assert quiet_tty.getvalue() == ""
    # ... but every line still goes to the epochal logger
    msgs = [r.getMessage() for r in caplog.records if r.name == "epochal.progress"]
    assert any(m.startswith("epoch    2") for m in msgs) and msgs[-1].startswith("finished at epoch 2")


def test_auto_display_stays_quiet_off_a_terminal(tmp_path: Any, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EPOCHAL_QUIET", raising=False)
    monkeypatch.delenv("CI", raising=False)
    JobRunner(_job(1), CheckpointManager(str(tmp_path), "trainer")).train(LocalSession())
    captured = capsys.readouterr()
    # no display: only the one line every start prints (also without a terminal)
    assert captured.out == "" and captured.err == f"epochal: starting a new job in {tmp_path}\n"


def test_io_progress_bar_over_threshold() -> None:
    buf = FakeTTY()
    p = TerminalProgress(force=True, stream=buf, threshold=1000)
    assert IO_PROGRESS.get() is None
    # no size known yet: the bar appears once the threshold has moved
    p.on_checkpoint_start("checkpoint_save", 1)
    assert IO_PROGRESS.get() is not None and p._bar is None
    report_progress(600)
    assert p._bar is None
    report_progress(600)
    assert p._bar is not None
    p.on_checkpoint(CheckpointEvent("checkpoint_save", 1, 0.01, 1200, True))
    assert IO_PROGRESS.get() is None and p._bar is None
    # the next save is expected to be as big: the bar is there from the start
    p.on_checkpoint_start("checkpoint_save", 2)
    assert p._bar is not None
    report_progress(1200)
    p.on_checkpoint(CheckpointEvent("checkpoint_save", 2, 0.01, 1200, True))
    assert p._bar is None and IO_PROGRESS.get() is None
    # small checkpoints never get a bar
    small = TerminalProgress(force=True, stream=FakeTTY(), threshold=1 << 30)
    small.on_checkpoint_start("checkpoint_load", 3)
    report_progress(1 << 20)
    assert small._bar is None
    small.close()
    assert IO_PROGRESS.get() is None
    p.close()
    assert "checkpoint 2: saved" in buf.getvalue()


def test_imports_without_rich(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins
    import importlib
    import sys

    real_import = builtins.__import__

    def no_rich(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "rich" or name.startswith("rich."):
            raise ImportError("no rich here")
        return real_import(name, *args, **kwargs)

    saved = sys.modules.pop("epochal.progress")
    monkeypatch.setattr(builtins, "__import__", no_rich)
    try:
        mod = importlib.import_module("epochal.progress")
        assert mod.HAVE_RICH is False
        buf = io.StringIO()
        p = mod.TerminalProgress(force=True, stream=buf)
        p.on_epoch_end(1, 0.5)
        p.on_checkpoint(CheckpointEvent("checkpoint_save", 1, 0.01, 2048, True))
        assert buf.getvalue().startswith("epoch    1") and "saved 2.0 KiB" in buf.getvalue()
    finally:
        monkeypatch.setattr(builtins, "__import__", real_import)
        sys.modules["epochal.progress"] = saved


def test_backend_reports_bytes_during_real_saves_and_loads(tmp_path: Any) -> None:
    """The native backend feeds IO_PROGRESS as data moves: each save/load's bytes arrive."""
    seen: list[tuple[str, int, int]] = []

    class Recorder(TerminalProgress):
        def on_checkpoint(self, event: CheckpointEvent) -> None:
            seen.append((event.action, self._io_done, event.nbytes))
            super().on_checkpoint(event)

    job = _job(3)
    _train(tmp_path, Recorder(force=True, stream=FakeTTY(), threshold=4096), job=job)
    assert [a for a, _, _ in seen] == ["checkpoint_save"] * 4
    for _, moved, nbytes in seen:
        assert moved >= 8000 and nbytes >= 8000  # 1000 float64 plus the file's framing
    assert IO_PROGRESS.get() is None
    # a resumed run loads through the same callback
    seen.clear()
    _train(tmp_path, Recorder(force=True, stream=FakeTTY()), job=job, resume_from_epoch=2)
    assert seen[0][0] == "checkpoint_load" and seen[0][1] >= 8000
    assert IO_PROGRESS.get() is None


# ------------------------------------------------------------------ the Checkpointer's display
_BIG = """
import sys, numpy as np, epochal
with epochal.Checkpointer(sys.argv[1]) as ck:
    state = {"w": np.ones(80 << 18, dtype=np.float32), "small": np.zeros(4)}
    ck.save(1, state)                        # 80 MiB: a bar and a line
    ck.save(2, {"small": np.zeros(4)})       # small: nothing
    ck.restore(state, step=1)                # 80 MiB back: a line
print("DONE", flush=True)
"""


def _run_checkpointer_script(tmp_path: Any, tty: bool) -> str:
    import pty
    import subprocess
    import sys

    script = tmp_path / "big.py"
    script.write_text(_BIG)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "EPOCHAL_QUIET")}
    if not tty:
        out = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], capture_output=True, text=True,
                             env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ck")], stdout=subprocess.DEVNULL,
                            stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=120) == 0
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.system
def test_checkpointer_shows_its_long_saves_and_loads_on_a_terminal_only(tmp_path: Any) -> None:
    shown = _run_checkpointer_script(tmp_path, tty=True)
    assert "step 1: saved 80.0 MiB" in shown, shown
    assert "step 1: loaded 80.0 MiB" in shown, shown
    assert "step 2:" not in shown  # a small save passes silently
    (tmp_path / "again").mkdir()
    quiet = _run_checkpointer_script(tmp_path / "again", tty=False)
    assert "step 1:" not in quiet and "saved" not in quiet
