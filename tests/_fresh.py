"""Fresh processes for the tests, started in milliseconds: multiprocessing's fork server.

A new interpreter spends seconds importing torch, DCP and epochal on this machine, more than
most tests' own work. The fork server (one per test process) imports them once, runs nothing
else, and forks each process the tests ask for: a fresh process with no state of the test's
own process (it never wrote the checkpoint it loads), able to be SIGKILLed, with the
environment, working directory and argv it is given.

:func:`start` runs a script as ``python SCRIPT ARGS...`` would (``__main__``, argv, the
script's folder first on ``sys.path``, atexit handlers run at its end; ``"-c:" + code`` and
``"-m:" + module`` as ``python -c`` and ``python -m`` would) and returns a
:class:`Fresh`: the part of ``subprocess.Popen`` the tests use (``pid``, ``stdout.readline``,
``poll``, ``wait``, ``communicate``, ``send_signal``, ``returncode``: negative for a signal).
Its stdout and stderr go, together, to a file that ``stdout`` reads as it grows.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

#: what the fork server imports before it forks anything (the cost of a new interpreter)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor",
           "torch.distributed.fsdp", "epochal", "epochal.integrations.distributed.checkpointer"]


def context() -> Any:
    """The fork-server context (the server starts, with :data:`PRELOAD`, on first use)."""
    multiprocessing.set_forkserver_preload(PRELOAD + ["_fresh"])
    return multiprocessing.get_context("forkserver")


def _run(script: str, argv: list[str], env: dict[str, str], cwd: str | None, out: str, err: str) -> None:
    """In the forked process: stdout to ``out``, stderr to ``err`` (may be the same file), then
    the script as ``__main__``."""
    for path, target in ((out, 1), (err, 2)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    if env.get("PYTHONUNBUFFERED"):  # read by the interpreter at its start: done here
        for f in (sys.stdout, sys.stderr):
            f.reconfigure(write_through=True)  # type: ignore[attr-defined]
    code = 0
    try:
        import runpy

        if script.startswith("-c:"):  # python -c CODE ARGS
            sys.argv = ["-c", *argv]
            sys.path.insert(0, "")
            exec(compile(script[3:], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif script.startswith("-m:"):  # python -m MODULE ARGS
            sys.argv = [script[3:], *argv]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(script[3:], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *argv]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as ex:
        if ex.code is None or isinstance(ex.code, int):
            code = int(ex.code or 0)
        else:
            print(ex.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # (a multiprocessing child skips them; a script's process runs them)
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        os._exit(code)


class _Output:
    """``readline`` of a file another process appends to: blocks until a whole line, or the
    process's end (then what is left, '' at the end)."""

    def __init__(self, path: str, proc: Fresh) -> None:
        self._f = open(path, encoding="utf-8", errors="replace")
        self._proc = proc
        self._part = ""

    def readline(self) -> str:
        while True:
            ended = self._proc.poll() is not None  # (then all its output is in the file)
            self._part += self._f.readline()
            if self._part.endswith("\n") or ended:
                line, self._part = self._part, ""
                return line
            time.sleep(0.005)

    def __iter__(self) -> Iterator[str]:
        while line := self.readline():
            yield line

    def read(self) -> str:
        rest, self._part = self._part + self._f.read(), ""
        return rest

    def close(self) -> None:
        self._f.close()


class Fresh:
    """A script running in a process forked by the fork server (see :func:`start`)."""

    def __init__(self, script: str, argv: list[str], env: dict[str, str] | None, cwd: str | None,
                 apart: bool = False) -> None:
        fd, self.out_path = tempfile.mkstemp(prefix="fresh-", suffix=".out")
        os.close(fd)
        self.err_path = self.out_path
        if apart:  # stderr to a file of its own
            fd, self.err_path = tempfile.mkstemp(prefix="fresh-", suffix=".err")
            os.close(fd)
        self.args = [script, *argv]
        self._p = context().Process(target=_run, args=(script, list(argv), dict(os.environ if env is None else env),
                                                        cwd, self.out_path, self.err_path), daemon=False)
        self._p.start()
        self.pid = int(self._p.pid or 0)
        self.stdout = _Output(self.out_path, self)

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._p.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        self.wait(timeout)
        out = self.stdout.read()
        self.stdout.close()
        err = None
        if self.err_path != self.out_path:
            with open(self.err_path, encoding="utf-8", errors="replace") as f:
                err = f.read()
        for path in {self.out_path, self.err_path}:
            try:
                os.unlink(path)
            except OSError:
                pass
        return out, err

    def send_signal(self, sig: int) -> None:
        if self._p.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


def start(script: str, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> Fresh:
    """Run ``python script *argv`` in a fresh process from the fork server (see the module doc);
    ``env`` replaces the environment (default: this process's, as it is now)."""
    return Fresh(script, argv, env, cwd)


def run(script: str, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """:func:`start` and wait: ``subprocess.run(..., capture_output=True, text=True)``'s result."""
    p = Fresh(script, argv, env, cwd, apart=True)
    out, err = p.communicate(timeout)
    return subprocess.CompletedProcess(p.args, int(p.returncode or 0), out, err or "")


def restore_script(script: str, tmp: Any, d: Any, step: int) -> tuple[int, dict[str, Any], Any]:
    """Run ``script`` (its text) in a new interpreter as ``python restore.py D STEP OUT.npy``:
    its return code, the JSON of its last stdout line, and the array it saved to ``OUT.npy``
    (None when it saved none). The tests' fresh-process restores that report in JSON."""
    import json

    import numpy as np

    path = os.path.join(str(tmp), "restore.py")
    with open(path, "w") as f:
        f.write(script)
    out = os.path.join(str(tmp), f"r{step}.npy")
    p = subprocess.run([sys.executable, path, str(d), str(step), out], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip(), p.stderr
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1]), (np.load(out) if os.path.exists(out) else None)
