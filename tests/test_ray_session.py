"""RaySession: a real multi-process run on a local Ray cluster, one actor per node."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from _pipeline import EXPECTED_TOTALS, build_pipeline  # noqa: E402

from epochal import Cluster, Job, JobRunner, MultiNodeCheckpointManager, Task, get_db_type  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ["PYTHONPATH"] = os.pathsep.join([TESTS, *sys.path])  # workers import _pipeline
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


class WhoAmI:
    def __call__(self, ws):
        ws["pid"] = np.int64(os.getpid())


def test_multinode_job_on_ray_resumes_from_every_epoch(ray_cluster, tmp_path):
    from epochal.sessions.ray import RaySession

    with Cluster():
        with Job() as job:
            for n in range(3):
                build_pipeline(n)
        session = RaySession()
        mgr = MultiNodeCheckpointManager(str(tmp_path), "native")
        assert JobRunner(job, mgr).train(session) == 4
        # every node's state lives in its own process, and only there
        pids = {session.node_info(f"trainer_{n}")["pid"] for n in range(3)}
        assert len(pids) == 3 and os.getpid() not in pids
        for n in range(3):
            assert session.fetch_blob(f"trainer_{n}", f"trainer_{n}/total").tolist() == [145]
            assert f"trainer_{(n + 1) % 3}/total" not in session.blobs(f"trainer_{n}")
            # each node's db holds exactly that node's blobs
            saved = get_db_type("native").read(str(tmp_path / f"trainer_{n}.4"))
            assert sorted(saved) == sorted(["blob_names", *(f"trainer_{n}/{k}" for k in ("cursor", "data", "total"))])
        session.close()

        for epoch in range(1, 5):
            s = RaySession()
            JobRunner(job, MultiNodeCheckpointManager(str(tmp_path)), resume_from_epoch=epoch).train(s)
            assert s.fetch_blob("trainer_1", "trainer_1/total").tolist() == [EXPECTED_TOTALS[-1]]
            s.close()

        s = RaySession()
        runner = JobRunner(job, MultiNodeCheckpointManager(str(tmp_path)))
        assert runner.load_blobs_from_checkpoints(["trainer_0/total", "trainer_2/total"], 2, s)
        assert s.fetch_blob("trainer_2", "trainer_2/total").tolist() == [EXPECTED_TOTALS[1]]
        assert s.fetch_blob("trainer_0", "trainer_0/total").tolist() == [EXPECTED_TOTALS[1]]
        s.close()


def test_step_errors_propagate_from_the_node(ray_cluster):
    from epochal.sessions.ray import RaySession

    class Boom:
        def __call__(self, ws):
            raise ValueError("bad step on the node")

    s = RaySession()
    with pytest.raises(ValueError, match="bad step on the node"):
        s.run(Task(step=Boom(), node="n0"))
    t = Task(step=WhoAmI(), outputs="pid", node="n0")
    s.run(t)
    assert int(t.outputs()[0].fetch()) == s.node_info("n0")["pid"]
    s.close()


def test_ray_job_with_directory_handler_resumes_after_a_crash(ray_cluster, tmp_path):
    """Each node saves in its own process; the driver commits; a rerun resumes by itself."""
    from epochal import DirectoryMetadataHandler
    from epochal.sessions.ray import RaySession

    class CrashAt:
        def __init__(self, node, epoch):
            self.node, self.epoch = node, epoch

        def __call__(self, ws):
            if int(ws[f"{self.node}/cursor"]) >= 3 * self.epoch:
                raise RuntimeError(f"node {self.node} crashed")

    def job_with(crash):
        with Job() as job:
            for n in range(2):
                build_pipeline(n)
            if crash:
                Task(step=CrashAt("trainer_1", 2), node="trainer_1", name="crash")
        return job

    with Cluster():
        s = RaySession()
        mgr = MultiNodeCheckpointManager(str(tmp_path), metadata_handler=DirectoryMetadataHandler())
        with pytest.raises(RuntimeError, match="node trainer_1 crashed"):
            JobRunner(job_with(crash=True), mgr).train(s)
        s.close()
        handler = DirectoryMetadataHandler()
        s = RaySession()
        mgr = MultiNodeCheckpointManager(str(tmp_path), metadata_handler=handler)
        assert JobRunner(job_with(crash=False), mgr).train(s) == 4
        assert handler.committed_epochs() == [0, 1, 2, 3, 4]
        from epochal.checkpoint.location.view import CheckpointDirectory

        loads = [(r["epoch"], r["node"]) for r in CheckpointDirectory(str(tmp_path)).stats()
                 if r["action"] == "checkpoint_load"]
        assert loads == [(1, "trainer_0"), (1, "trainer_1")]  # resumed after the last commit
        for n in range(2):
            assert s.fetch_blob(f"trainer_{n}", f"trainer_{n}/total").tolist() == [EXPECTED_TOTALS[-1]]
        s.close()


def test_a_killed_node_process_is_a_lost_node_and_can_be_replaced(ray_cluster):
    """The actor's process dies (the machine stays): NodeLostError names the node; a fresh
    actor replaces it, with an empty workspace. (Machines lost: tests/test_cluster.py.)"""
    from epochal import NodeLostError
    from epochal.sessions.ray import RaySession

    s = RaySession()
    try:
        s.feed_blob("n0", "x", np.arange(4))
        s.feed_blob("n1", "x", np.arange(5))
        old = s.node_info("n0")["pid"]
        ray.kill(s.actor("n0"))
        with pytest.raises(NodeLostError) as lost:
            s.run(Task(step=WhoAmI(), outputs="pid", node="n0"))
        assert lost.value.node == "n0" and "node 'n0' was lost" in str(lost.value)
        assert s.lost_nodes() == ["n0"]
        assert s.fetch_blob("n1", "x").tolist() == list(range(5))  # the other node is untouched
        info = s.replace_node("n0", timeout=60)
        assert info["pid"] != old and s.blobs("n0") == []
        t = Task(step=WhoAmI(), outputs="pid", node="n0")
        s.run(t)
        assert int(t.outputs()[0].fetch()) == info["pid"]
        assert s.lost_nodes() == []
    finally:
        s.close()
