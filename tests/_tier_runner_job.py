"""A small numpy job run by a JobRunner with a local tier, as its own process (test_tier_runner.py).

    python _tier_runner_job.py DIR LOCAL --epochs 7 --persist 3 [--async] [--nodes 2]
        [--kill-after 4] [--term-after 4] [--fail-at 5 [--damage-local 4]]

Resumes (the runner says from where on stderr: ``epochal: resuming from epoch N in PLACE``),
trains to ``--epochs`` and prints markers on stdout::

    LOADED <epoch> <hash>   the state just loaded
    EPOCH <epoch> <hash>    the state after training <epoch>
    DONE <epoch> <hash>     train() returned

``<hash>``: SHA-256 over every checkpointed blob (tests/_crash_job.py's), so equal hashes mean
bit-identical blobs. ``--kill-after E``: SIGKILL once epoch E is committed in the local
directory; ``--term-after E``: SIGTERM at the end of epoch E (a preemption); ``--fail-at E``:
the training task raises ``RuntimeError("boom at epoch E")`` in epoch E (the job prints
``FAILED <type>: <message>`` and each note on the error as ``NOTE <note>``, and exits 4), after
flipping a byte of the local db of epoch ``--damage-local`` when given.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.pop("EPOCHAL_QUIET", None)  # the runner's "resuming from ..." line is part of what is tested

from _crash_job import _say, state_hash  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("local")
    p.add_argument("--epochs", type=int, default=7)
    p.add_argument("--persist", type=int, default=3)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--kill-after", type=int, default=-1)
    p.add_argument("--term-after", type=int, default=-1)
    p.add_argument("--fail-at", type=int, default=-1)
    p.add_argument("--damage-local", type=int, default=-1)
    a = p.parse_args()

    from epochal import (
        CheckpointManager,
        Cluster,
        DirectoryMetadataHandler,
        Job,
        JobRunner,
        LocalSession,
        MultiNodeCheckpointManager,
        Node,
        Preempted,
        RunListener,
        Task,
        Workspace,
        epoch_limiter,
    )

    nodes = [f"trainer_{i}" for i in range(a.nodes)]
    n = 50_000

    def init(ws: Any) -> None:
        rng = np.random.default_rng(1234)
        ws["w"] = rng.standard_normal(n)
        ws["v"] = rng.standard_normal(n).astype(np.float32)
        ws["step"] = np.int64(0)

    def train(ws: Any) -> None:
        e = int(ws["step"]) + 1
        if e == a.fail_at:
            if a.damage_local >= 0:
                db = os.path.join(a.local, f"{nodes[0]}.{a.damage_local}")
                with open(db, "r+b") as f:  # a byte in the middle: a blob's data
                    f.seek(os.path.getsize(db) // 2)
                    byte = f.read(1)[0]
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte ^ 0x40]))
            raise RuntimeError(f"boom at epoch {e}")
        ws["step"] = np.int64(e)
        ws["w"] = np.roll(ws["w"], e) * 1.0001 - e * 1e-3
        ws["v"] = (ws["v"] * np.float32(0.999) + np.float32(e) / 7).astype(np.float32)

    ws = Workspace()

    def report(_: Any) -> None:
        _say("EPOCH", int(ws["step"]), state_hash(ws))
        if int(ws["step"]) == a.term_after:
            os.kill(os.getpid(), signal.SIGTERM)

    class Markers(RunListener):
        def on_checkpoint(self, event: Any) -> None:
            if event.action == "checkpoint_load":
                _say("LOADED", event.epoch, state_hash(ws))
            elif event.action == "checkpoint_save" and event.ok and event.epoch == a.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)  # (its first commit: the local one)

    with Cluster():
        with Job(nodes_to_checkpoint=nodes) as job:
            with Node(nodes[0]):
                with job.init_group:
                    Task(step=init)
                epoch_limiter(job, a.epochs)
                Task(step=[train, report])
        handler = DirectoryMetadataHandler()
        manager: Any = (CheckpointManager(a.dir, nodes[0], metadata_handler=handler) if a.nodes == 1 else
                        MultiNodeCheckpointManager(a.dir, metadata_handler=handler))
        runner = JobRunner(job, manager, listeners=[Markers()], local=a.local, persist_every=a.persist,
                           async_save=a.async_save)
        try:
            last = runner.train(LocalSession(ws))
        except Preempted as ex:
            _say("PREEMPTED", ex.epoch)
            return 3
        except RuntimeError as ex:
            print(f"FAILED {type(ex).__name__}: {ex}", flush=True)
            for note in getattr(ex, "__notes__", []):
                print(f"NOTE {note}", flush=True)
            return 4
    _say("DONE", last, state_hash(ws))
    return 0


if __name__ == "__main__":
    sys.exit(main())
