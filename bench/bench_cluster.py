"""How long the loopback cluster of tests/_cluster.py takes to start (a head
and N machines that share no directory), and how long from a machine's loss, mid-run, to its
node re-placed on a replacement machine and running a task again.

    PYTHONPATH=src python bench/bench_cluster.py --rounds 3 --machines 3 [--ray-health-checks] [--freeze]

Each round starts a fresh cluster, creates one RaySession actor per node (pinned by resource),
runs a step that blocks on trainer_1, kills trainer_1's machine (SIGKILL of every process of
its namespace), and times: the kill to NodeLostError in the driver (detection); starting the
replacement machine until it has joined (the harness's cost; an operator or autoscaler's in
real life); replace_node (the resource is offered -> the fresh actor answers); and a task run
on it. Absolute seconds, medians over the rounds (a latency, so no baseline ratio); the machine
is shared, so the load average is printed too. ``--ray-health-checks``: Ray's default GCS
health-check settings instead of the harness's fast ones. ``--freeze``: the machine stops
answering (SIGSTOP of its processes, as after a power cut) instead of dying, so only the GCS's
health checks can find it; it is killed once the loss is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported

from _cluster import Listener, LoopbackCluster, WhoAmI  # noqa: E402

from epochal import NodeLostError, Task, TaskGroup  # noqa: E402
from epochal.sessions.ray import RaySession, node_resource  # noqa: E402


def one_round(machines: int, gcs_env: dict[str, str] | None, freeze: bool) -> dict[str, float]:
    t: dict[str, float] = {}
    t0 = time.monotonic()
    c = LoopbackCluster(gcs_env=gcs_env)
    try:
        specs = {f"m{n}": {node_resource(f"trainer_{n}"): 1} for n in range(machines)}
        c.start(specs)
        t["cluster up (head + machines)"] = time.monotonic() - t0
        s = RaySession(place_by_resource=True)
        nodes = [f"trainer_{n}" for n in range(machines)]
        t1 = time.monotonic()
        for n in nodes:
            s.node_info(n)
        t["actors placed"] = time.monotonic() - t1

        listener = Listener()
        with ThreadPoolExecutor(1) as pool:
            with TaskGroup() as group:
                for n in nodes:
                    Task(step=listener.step() if n == "trainer_1" else WhoAmI(), node=n)
            running = pool.submit(s.run, group)
            listener.wait(running)
            listener.close()
            t_kill = time.monotonic()
            c.freeze("m1") if freeze else c.kill("m1")
            try:
                running.result(timeout=300)
                raise AssertionError("the run survived the loss of its machine")
            except NodeLostError as e:
                assert e.node == "trainer_1", e
        t_lost = time.monotonic()
        t["loss -> NodeLostError"] = t_lost - t_kill
        if freeze:
            c.kill("m1")
        c.add_machine("m1", specs["m1"], timeout=120)
        t_up = time.monotonic()
        t["replacement machine joined"] = t_up - t_lost
        s.replace_node("trainer_1", timeout=120)
        t_placed = time.monotonic()
        t["replace_node"] = t_placed - t_up
        task = Task(step=WhoAmI(), outputs="pid", node="trainer_1")
        s.run(task)
        task.outputs()[0].fetch()
        t["first task on it"] = time.monotonic() - t_placed
        t["loss -> running again"] = time.monotonic() - t_kill
        s.close()
    finally:
        t2 = time.monotonic()
        c.shutdown()
        t["shutdown"] = time.monotonic() - t2
        t["machine starts retried (count)"] = c.restarts
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--machines", type=int, default=3)
    ap.add_argument("--ray-health-checks", action="store_true")
    ap.add_argument("--freeze", action="store_true")
    args = ap.parse_args()
    rounds = []
    for i in range(args.rounds):
        rounds.append(one_round(args.machines, {} if args.ray_health_checks else None, args.freeze))
        print(f"round {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in rounds[-1].items()), flush=True)
    print(f"\nmachines={args.machines} rounds={args.rounds} "
          f"health checks={'Ray defaults' if args.ray_health_checks else 'harness (0.5 s x 4)'} "
          f"loss={'freeze (SIGSTOP)' if args.freeze else 'kill (SIGKILL)'} "
          f"load average={os.getloadavg()[0]:.1f} (2 cores)")
    print("| phase | median s | min s | max s |\n| --- | ---: | ---: | ---: |")
    for key in rounds[0]:
        vals = [r[key] for r in rounds]
        print(f"| {key} | {statistics.median(vals):.2f} | {min(vals):.2f} | {max(vals):.2f} |")


if __name__ == "__main__":
    main()
