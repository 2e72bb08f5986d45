"""The time from a machine's loss, mid-run, to training again through
``JobRunner(max_failures=1)`` on the loopback cluster of tests/_cluster.py (machines that share
no directory; checkpoints in a directory every machine sees).

    PYTHONPATH=src python bench/bench_recovery.py --rounds 3

Each round starts a cluster (head + 2 machines), runs the two-node job of
tests/_recovery_job.py (8 epochs of 0.4 s) once uninterrupted and once with trainer_1's
machine killed right after epoch 2 is committed (a replacement machine is started at once, as
an autoscaler would), and times: the kill to the runner's recovered line (replacement machine
up, actor placed, every node reloaded), the kill to the next epoch finished, and the whole
run against the uninterrupted one (a ratio, same cluster, same round). Medians over rounds.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported

import _recovery_job as rj  # noqa: E402
from _cluster import LoopbackCluster  # noqa: E402

from epochal import DirectoryMetadataHandler, JobRunner, MultiNodeCheckpointManager, RunListener  # noqa: E402
from epochal.sessions.ray import RaySession, node_resource  # noqa: E402

EPOCHS, SECONDS = 8, 0.4


class Clock(RunListener):
    def __init__(self) -> None:
        self.epoch_ends: list[tuple[int, float]] = []

    def on_epoch_end(self, epoch: int, seconds: float) -> None:
        self.epoch_ends.append((epoch, time.monotonic()))


class Recovered(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if "Recovered from the loss" in record.getMessage():
            self.at = time.monotonic()


def run(c: LoopbackCluster, d: Path, kill: bool) -> dict[str, float]:
    s = RaySession(place_by_resource=True)
    clock, rec = Clock(), Recovered()
    logging.getLogger("epochal").addHandler(rec)
    out: dict[str, float] = {}
    try:
        killed: dict[str, float] = {}

        def killer() -> None:
            while not (d / ".epochal" / "manifest.2.json").exists():
                time.sleep(0.02)
            killed["at"] = time.monotonic()
            c.kill("m1")
            c.add_machine("m1", {node_resource("trainer_1"): 1})

        t = threading.Thread(target=killer) if kill else None
        if t:
            t.start()
        manager = MultiNodeCheckpointManager(str(d), metadata_handler=DirectoryMetadataHandler())
        start = time.monotonic()
        JobRunner(rj.build(EPOCHS, SECONDS), manager, progress=False, listeners=[clock],
                  max_failures=1 if kill else 0, recovery_timeout=180).train(s)
        out["run"] = time.monotonic() - start
        if t:
            t.join()
            k = killed["at"]
            out["kill -> recovered (every node reloaded)"] = (rec.at or float("nan")) - k
            after = [at for _, at in clock.epoch_ends if at > (rec.at or k)]
            out["kill -> next epoch finished"] = after[0] - k if after else float("nan")
    finally:
        logging.getLogger("epochal").removeHandler(rec)
        s.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rows: dict[str, list[float]] = {}
    for r in range(args.rounds):
        shared = ROOT / "tests" / f".cluster-ckpt-bench-{secrets.token_hex(4)}"
        c = LoopbackCluster()
        try:
            c.start({f"m{n}": {node_resource(n_): 1} for n, n_ in enumerate(rj.NODES)})
            base = run(c, shared / "plain", kill=False)
            lost = run(c, shared / "lost", kill=True)
        finally:
            c.shutdown()
            shutil.rmtree(shared, ignore_errors=True)
        got = {**{k: v for k, v in lost.items() if k != "run"},
               "run with a loss / uninterrupted run": lost["run"] / base["run"],
               "uninterrupted run (s)": base["run"]}
        for k, v in got.items():
            rows.setdefault(k, []).append(v)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    print(f"\nmedians over {args.rounds} rounds (load average {os.getloadavg()[0]:.1f}):")
    for k, vs in rows.items():
        print(f"  {k}: {statistics.median(vs):.2f}  (all: {', '.join(f'{v:.2f}' for v in vs)})")


if __name__ == "__main__":
    main()
