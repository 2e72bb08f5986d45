"""The writer lock dies with its holder, not with the children it forked
(DataLoader workers), and a second lock in the same process says so plainly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import epochal  # noqa: E402
from epochal import Checkpointer
from epochal.checkpoint.location.lock import WriterLock
from epochal.errors import CheckpointLockedError

SRC = os.path.dirname(os.path.dirname(os.path.abspath(epochal.__file__)))  # the epochal under test

# the holder takes the lock, forks a child that lives on (os.fork, as multiprocessing's
# DataLoader workers; or libc's fork, which runs no Python fork hooks), prints the child's
# pid, then dies by SIGKILL
HOLDER = """
import ctypes, os, sys, time
sys.path.insert(0, sys.argv[3])
from epochal import Checkpointer
ckpt = Checkpointer(sys.argv[1])
ckpt.save(1, {"w": __import__("numpy").ones(3)})
pid = os.fork() if sys.argv[2] == "os" else ctypes.PyDLL(None).fork()
if pid == 0:
    os.close(1)  # (the test reads the parent's output to its end)
    os.close(2)
    time.sleep(60)
    os._exit(0)
print(pid, flush=True)
os.kill(os.getpid(), 9)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("how", ["os", "libc"])
def test_a_child_that_outlives_its_killed_parent_does_not_block_a_rerun(tmp_path, how):
    proc = subprocess.run([sys.executable, "-c", HOLDER, str(tmp_path), how, SRC],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    child = int(proc.stdout.split()[0])
    try:
        assert _alive(child)  # the worker lives on, its parent is dead
        state = {"w": np.zeros(3)}
        with Checkpointer(tmp_path) as ckpt:  # not CheckpointLockedError naming a dead pid
            assert ckpt.restore(state) == 1
            ckpt.save(2, {"w": np.full(3, 2.0)})
            assert ckpt.steps() == [1, 2]
        assert state["w"].tolist() == [1.0, 1.0, 1.0]
        assert _alive(child)
        # and the lock still excludes a second writer while held
        with Checkpointer(tmp_path):
            code = f"import sys; sys.path.insert(0, {SRC!r}); from epochal import Checkpointer; Checkpointer({str(tmp_path)!r})"
            other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            assert other.returncode != 0 and "another job" in other.stderr and f"pid {os.getpid()}" in other.stderr
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_second_lock_in_this_process_says_so_naming_the_holder(tmp_path):
    with Checkpointer(tmp_path) as first:
        with pytest.raises(CheckpointLockedError) as info:
            Checkpointer(tmp_path)
        text = str(info.value)
        assert "already held by this process" in text and "another job" not in text
        assert "DirectoryMetadataHandler" in text and f"{os.path.basename(__file__)}:" in text
        first.save(1, {"w": np.ones(2)})  # the first one's lock still works
    lock = WriterLock(str(tmp_path / ".epochal" / "lock"))
    lock.acquire()  # released on close
    lock.release()


def test_a_forked_child_holds_no_lock_while_its_parent_lives(tmp_path):
    path = str(tmp_path / "lock")
    lock = WriterLock(path)
    lock.acquire()
    pid = os.fork()
    if pid == 0:  # the child: its copy of the lock fd is closed; it may not take the lock either
        code = 0
        try:
            other = WriterLock(path)
            try:
                other.acquire()
                code = 3  # it must not get it: the parent still holds it
            except CheckpointLockedError as ex:
                code = 0 if "another job" in str(ex) else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert lock.held
    lock.release()
    time.sleep(0)
