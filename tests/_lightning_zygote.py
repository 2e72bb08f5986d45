"""Many tiny Lightning runs as real processes that can be SIGKILLed, cheaply.

Importing Lightning costs seconds per process here, far more than a tiny fit. This zygote
imports it once, runs no torch computation itself, and forks one child per run
(tests/_lightning_bits.py's :func:`run`). A child may kill itself with SIGKILL at a planned
point (a training step, or inside its N-th checkpoint write), may have pickle and
``torch.load`` made to raise (``no_pickle``), and writes the raw bytes of its final
parameters to ``result`` (.npz) when it finishes.

Protocol (JSON lines on stdin/stdout): ``{"run": {Run fields}, "out": log path, "result":
npz path, "kill_save": n, "kill_where": "commit"|"write", "no_pickle": bool}`` ->
``{"rc": code}`` (negative: killed by that signal).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _lightning_bits as bits  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def forbid_pickle() -> None:
    """Make every unpickling entry point raise in this process."""
    import pickle

    def refuse(*a: object, **kw: object) -> None:
        raise AssertionError("pickle used on the resume path")

    pickle.load = pickle.loads = refuse  # type: ignore[assignment]
    pickle.Unpickler = refuse  # type: ignore[assignment,misc]
    torch.load = refuse  # type: ignore[assignment]


def child(spec: dict) -> int:
    fd = os.open(spec["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    if spec.get("kill_save"):
        bits.kill_inside_saves(int(spec["kill_save"]), spec.get("kill_where", "commit"))
    if spec.get("no_pickle"):
        forbid_pickle()
    r = bits.Run(**spec["run"])
    trainer, model = bits.run(r)
    print(f"resumed from {trainer.ckpt_path} at step {r.started_at}", flush=True)
    if spec.get("result"):
        raw = bits.params(model)
        np.savez(spec["result"], **{k: np.frombuffer(v, dtype=np.uint8) for k, v in raw.items()})
    return 0


def main() -> None:
    for line in sys.stdin:
        spec = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = child(spec)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"rc": rc}), flush=True)


if __name__ == "__main__":
    main()
