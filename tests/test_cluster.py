"""Machines that share no directory (tests/_cluster.py): the harness's isolation, and RaySession
reporting a lost machine and re-placing its node on a replacement.

One loopback cluster (a head and two machines, m<n> hosting trainer_<n>) serves the module;
a test that kills a machine leaves it to the ``machines`` fixture to start a new one.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
pytest.importorskip("s3fs", reason="the s3 extra is not installed")
if os.geteuid() != 0 or shutil.which("unshare") is None:
    pytest.skip("the loopback cluster needs root and unshare", allow_module_level=True)

from _cluster import Listener, LoopbackCluster, WhoAmI, mount_ns, pids_in_namespace  # noqa: E402

from epochal import NodeLostError, Task, TaskGroup  # noqa: E402
from epochal.sessions.ray import RaySession, node_resource  # noqa: E402

MACHINES = {f"m{n}": f"trainer_{n}" for n in range(2)}
NODES = list(MACHINES.values())


@pytest.fixture(scope="module")
def cluster(s3: dict[str, Any]):
    c = LoopbackCluster()
    try:
        c.start({m: {node_resource(n): 1} for m, n in MACHINES.items()})
        yield c
    finally:
        c.shutdown()


@pytest.fixture
def machines(cluster: LoopbackCluster) -> LoopbackCluster:
    """The cluster with every machine up (a new one for each lost in an earlier test)."""
    gone = {m: {node_resource(n): 1} for m, n in MACHINES.items()
            if cluster.machines[m].dead or cluster.machines[m].proc.poll() is not None}
    for m in gone:
        cluster.kill(m)  # whatever is left of it
    if gone:
        cluster.add_machines(gone)
    return cluster


@ray.remote(num_cpus=0)
def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)


def on(node: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a task on the machine that hosts ``node`` (a sliver of its resource, so
    it runs beside the node's actor)."""
    return ray.get(_call.options(resources={node_resource(node): 0.001}).remote(fn, *args), timeout=120)


def _look(path: str) -> dict[str, Any]:
    return {"exists": os.path.exists(path), "ns": mount_ns(os.getpid()), "cwd": os.getcwd(),
            "node_id": ray.get_runtime_context().get_node_id()}


def _write(path: str, text: str) -> dict[str, Any]:
    Path(path).write_text(text)
    return _look(path)


def test_machines_share_no_directory(machines: LoopbackCluster, tmp_path: Path) -> None:
    probe = f"/tmp/epochal-probe-{secrets.token_hex(4)}"
    a = on("trainer_0", _write, probe, "written on m0")
    assert a["exists"] and a["node_id"] == machines.machines["m0"].node_id
    assert a["ns"] == machines.machines["m0"].ns != mount_ns(os.getpid())
    assert a["cwd"] == "/tmp/work"  # the working directory is private too
    assert not os.path.exists(probe)  # not on the driver's /tmp
    b = on("trainer_1", _look, probe)
    assert not b["exists"] and b["ns"] not in (a["ns"], mount_ns(os.getpid()))
    # it is on m0's disk (seen from its namespace), and stays there
    assert machines.run_on("m0", ["cat", probe]).stdout == b"written on m0"
    assert on("trainer_0", _look, probe)["exists"]
    # and the driver's files are not on any machine
    mine = tmp_path / "driver-only"
    mine.write_text("x")
    assert [on(n, _look, str(mine))["exists"] for n in NODES] == [False, False]


def _s3_round(opts: dict[str, Any], name: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    fs.pipe_file(f"ckpts/probe/{name}", name.encode())
    return sorted(k.rsplit("/", 1)[-1] for k in fs.ls("ckpts/probe", refresh=True))


def test_every_machine_and_the_driver_reach_the_bucket(machines: LoopbackCluster, s3: dict[str, Any]) -> None:
    for n in NODES:
        on(n, _s3_round, s3, n)
    seen = _s3_round(s3, "driver")
    assert seen == sorted([*NODES, "driver"])
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3)
    assert [fs.cat_file(f"ckpts/probe/{n}") for n in NODES] == [n.encode() for n in NODES]
    assert on("trainer_1", _s3_round, s3, "trainer_1") == seen  # each machine sees the others' keys


def test_a_machine_that_stops_answering_is_lost_and_replaced(machines: LoopbackCluster) -> None:
    """A frozen machine (as after a power cut: no connection is closed) is found dead by the
    GCS's health checks; its node is a NodeLostError; a new machine with the same resource
    takes over, with a new, empty disk."""
    probe = f"/tmp/epochal-probe-{secrets.token_hex(4)}"
    old = machines.machines["m1"]
    assert on("trainer_1", _write, probe, "x")["exists"]
    s = RaySession(place_by_resource=True)
    try:
        assert s.node_info("trainer_1")["ray_node_id"] == old.node_id
        machines.freeze("m1")
        with pytest.raises(NodeLostError, match="node 'trainer_1' was lost"):
            s.node_info("trainer_1")
        assert not machines.node_alive(old.node_id)
    finally:
        s.close()
    machines.kill("m1")
    assert not pids_in_namespace(old.ns) and old.proc.poll() is not None  # nothing of it runs
    # nothing hosts trainer_1 now: a task for it waits
    ref = _call.options(resources={node_resource("trainer_1"): 0.001}).remote(_look, probe)
    ready, _ = ray.wait([ref], timeout=1.0)
    assert not ready
    new = machines.add_machine("m1", {node_resource("trainer_1"): 1})
    assert new.node_id != old.node_id
    got = ray.get(ref, timeout=120)  # runs on the replacement, whose disk is new
    assert got["node_id"] == new.node_id and not got["exists"]


def test_ray_session_reports_a_lost_machine_and_replaces_the_node(machines: LoopbackCluster) -> None:
    s = RaySession(place_by_resource=True)
    try:
        before = {n: s.node_info(n) for n in NODES}
        assert [before[n]["ray_node_id"] for n in NODES] == [machines.machines[m].node_id for m in MACHINES]
        s.feed_blob("trainer_1", "kept", np.arange(3))
        listener = Listener()
        with ThreadPoolExecutor(1) as pool:
            with TaskGroup() as group:
                done = [Task(step=WhoAmI(), outputs="pid", node="trainer_0")]
                Task(step=listener.step(), node="trainer_1")
            running = pool.submit(s.run, group)
            listener.wait(running)  # trainer_1's step is running, on m1
            listener.close()
            machines.kill("m1")
            with pytest.raises(NodeLostError) as lost:
                running.result(timeout=120)
        assert lost.value.node == "trainer_1" and lost.value.nodes == ["trainer_1"]
        assert "node 'trainer_1' was lost" in str(lost.value)
        # the other node ran its step; only trainer_1 is gone
        assert int(done[0].outputs()[0].fetch()) == before["trainer_0"]["pid"]
        with pytest.raises(NodeLostError, match="trainer_1"):
            s.fetch_blob("trainer_1", "kept")
        assert s.lost_nodes() == ["trainer_1"]

        machines.add_machine("m1", {node_resource("trainer_1"): 1})
        info = s.replace_node("trainer_1", timeout=120)
        assert info["ray_node_id"] == machines.machines["m1"].node_id != before["trainer_1"]["ray_node_id"]
        assert s.blobs("trainer_1") == []  # a fresh workspace: to be reloaded from a checkpoint
        t = Task(step=WhoAmI(), outputs="pid", node="trainer_1")
        s.run(t)
        assert int(t.outputs()[0].fetch()) == info["pid"]
        assert s.lost_nodes() == []
    finally:
        s.close()


def test_replace_node_gives_up_naming_the_node(machines: LoopbackCluster) -> None:
    s = RaySession(place_by_resource=True)
    try:
        with pytest.raises(NodeLostError, match=r"node 'trainer_9' was lost: no machine .*epochal_node:trainer_9") as e:
            s.replace_node("trainer_9", timeout=0.5)
        assert e.value.node == "trainer_9"
        assert s.node_names() == []
    finally:
        s.close()


def _s3_exists(opts: dict[str, Any], key: str) -> bool:
    import s3fs

    return bool(s3fs.S3FileSystem(skip_instance_cache=True, **opts).exists(key))


def _url_manager(url: str, opts: dict[str, Any]) -> Any:
    from epochal import DirectoryMetadataHandler, MultiNodeCheckpointManager

    return MultiNodeCheckpointManager(url, metadata_handler=DirectoryMetadataHandler(storage_options=opts),
                                      storage_options=opts)


def _reference(epochs: int, tmp: Path) -> dict[str, bytes]:
    import _recovery_job as rj

    from epochal import JobRunner, LocalSession, MultiNodeCheckpointManager

    (tmp / "ref").mkdir(parents=True, exist_ok=True)
    ref = LocalSession()
    JobRunner(rj.build(epochs), MultiNodeCheckpointManager(str(tmp / "ref")), progress=False).train(ref)
    return rj.state(lambda n, k: ref.ws[k])


def test_a_machine_lost_mid_run_is_recovered_in_the_same_train(
    machines: LoopbackCluster, s3: dict[str, Any], tmp_path: Path
) -> None:
    """JobRunner(max_failures=1) with the checkpoints on S3 (the only storage the machines
    share): m1 dies mid-run; the runner waits for its replacement, every node reloads the last
    committed epoch from the bucket, and the same train() finishes with every node's state
    bit-identical to an uninterrupted run."""
    import threading

    import _recovery_job as rj

    from epochal import JobRunner

    expected = _reference(6, tmp_path)
    run = f"recovery-{secrets.token_hex(4)}"
    s = RaySession(place_by_resource=True)
    try:
        def kill_and_replace() -> None:
            deadline = time.monotonic() + 120
            while not _s3_exists(s3, f"ckpts/{run}/.epochal/manifest.2.json") and time.monotonic() < deadline:
                time.sleep(0.05)
            machines.kill("m1")  # mid-epoch 3 (each epoch sleeps 0.4 s)
            machines.add_machine("m1", {node_resource("trainer_1"): 1})

        killer = threading.Thread(target=kill_and_replace)
        killer.start()
        last = JobRunner(rj.build(6, seconds=0.4), _url_manager(f"s3://ckpts/{run}", s3), progress=False,
                         max_failures=1, recovery_timeout=120).train(s)
        killer.join(timeout=180)
        assert last == 6
        assert rj.state(s.fetch_blob) == expected
        assert np.asarray(s.fetch_blob("trainer_1", "log1")).tolist() == [1, 2, 3, 4, 5, 6]
        assert _s3_exists(s3, f"ckpts/{run}/.epochal/manifest.6.json")
        from epochal import CheckpointDirectory

        db = CheckpointDirectory(f"s3://ckpts/{run}", storage_options=s3).db_path("trainer_1", 6)
        assert db.split("/")[-1].startswith("trainer_1.6.") and _s3_exists(s3, db.replace("s3://", ""))  # its token
    finally:
        s.close()


def test_every_disk_lost_a_new_cluster_resumes_from_the_bucket(
    machines: LoopbackCluster, s3: dict[str, Any], tmp_path: Path
) -> None:
    """Train to epoch 3 with the checkpoints on S3; every machine is then lost with its disk
    and new ones take their places; a rerun (limit 6) resumes from the bucket: epochs 1-3 are
    not trained again, and the end state is bit-identical to an uninterrupted 6-epoch run."""
    import _recovery_job as rj

    from epochal import JobRunner, RunListener

    expected = _reference(6, tmp_path)
    url = f"s3://ckpts/newcluster-{secrets.token_hex(4)}"
    s = RaySession(place_by_resource=True)
    try:
        assert JobRunner(rj.build(3), _url_manager(url, s3), progress=False).train(s) == 3
    finally:
        s.close()
    for m in list(MACHINES):
        machines.kill(m)  # every machine and its disk
    for m in list(MACHINES):  # as a real cluster would have by then: else a new actor may be
        machines.wait_dead(machines.machines[m])  # placed on a killed node not yet found dead
    machines.add_machines({m: {node_resource(n): 1} for m, n in MACHINES.items()})

    class Epochs(RunListener):
        def __init__(self) -> None:
            self.run: list[int] = []
            self.resume: int | None = None

        def on_train_start(self, resume_epoch: int | None, nodes: list[str]) -> None:
            self.resume = resume_epoch

        def on_epoch_start(self, epoch: int) -> None:
            self.run.append(epoch)

    seen = Epochs()
    s = RaySession(place_by_resource=True)
    try:
        assert JobRunner(rj.build(6), _url_manager(url, s3), progress=False, listeners=[seen]).train(s) == 6
        assert seen.resume == 3 and seen.run == [4, 5, 6]
        assert rj.state(s.fetch_blob) == expected
    finally:
        s.close()
