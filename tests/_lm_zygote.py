"""Run examples/torch_lm.py many times, cheaply, as real processes that can be SIGKILLed.

Importing torch and building a first optimizer (which imports torch._dynamo) costs seconds per
process on this machine, far more than the training itself. So a *zygote* process does that
once, without running any torch computation (no thread pools are started), and then forks one
child per run: each child is a separate process running the example's ``main(argv)`` from a
clean, identical state, with its stdout and stderr going to a file, and is killed with a real
SIGKILL by the test. A run may ask for slow fsyncs (``fsync_ms``) so that kills land inside
saves.

Protocol (JSON lines on the zygote's stdin/stdout): ``{"run": argv, "out": path,
"fsync_ms": x}`` -> ``{"pid": n}``; ``{"wait": pid}`` -> ``{"rc": code}`` (negative: killed
by that signal).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torch_lm.py"


def _child(argv: list[str], out: str, fsync_ms: float) -> None:
    """In the forked child: redirect output, optionally slow fsync down, run the example."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    code = 1
    try:
        if fsync_ms:
            from epochal.storage.io import atomic

            real = atomic.fsync

            def slow_fsync(f: int) -> None:
                time.sleep(fsync_ms / 1000)
                real(f)

            atomic.fsync = slow_fsync
        import torch_lm  # type: ignore[import-not-found]

        code = int(torch_lm.main(argv) or 0)
    except SystemExit as ex:
        code = ex.code if isinstance(ex.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """The zygote: warm up, then fork on request."""
    sys.path.insert(0, str(EXAMPLE.parent))
    import torch

    torch.set_num_threads(1)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # imports torch._dynamo once
    import torch_lm  # noqa: F401

    import epochal.checkpointer  # noqa: F401
    import epochal.integrations.torch  # noqa: F401

    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if "run" in req:
            pid = os.fork()
            if pid == 0:
                _child(req["run"], req["out"], float(req.get("fsync_ms", 0)))
            print(json.dumps({"pid": pid}), flush=True)
        elif "wait" in req:
            _, status = os.waitpid(int(req["wait"]), 0)
            print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


class Zygote:
    """The test side: start the zygote, run the example in forked children, kill them."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), EPOCHAL_QUIET="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.lock = threading.Lock()
        self._ready = False  # the first request waits for the warm-up (zygotes start in parallel)

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote died (rc {self.proc.poll()})")
        return json.loads(line)  # type: ignore[no-any-return]

    def _ask(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        with self.lock:
            if not self._ready:
                ready = self._read()
                assert "ready" in ready, ready
                self._ready = True
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            return self._read()

    def start(self, argv: list[str], out: Path, fsync_ms: float = 0.0) -> int:
        return int(self._ask({"run": argv, "out": str(out), "fsync_ms": fsync_ms})["pid"])

    def wait(self, pid: int) -> int:
        return int(self._ask({"wait": pid})["rc"])

    def run(self, argv: list[str], out: Path) -> tuple[int, str]:
        """Run to the end: (exit code, output)."""
        rc = self.wait(self.start(argv, out))
        return rc, out.read_text()

    def close(self) -> None:
        """Stop the zygote (every child was waited for; its own shutdown, with torch loaded,
        would take seconds for nothing)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


if __name__ == "__main__":
    serve()
