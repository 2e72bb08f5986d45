"""The metadata handler call sequence, stats, naming, epoch_limiter and stop conditions."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _pipeline import EXPECTED_TOTALS, build_pipeline

from epochal import (
    CheckpointError,
    CheckpointManager,
    Cluster,
    Job,
    JobRunner,
    LocalSession,
    MetadataHandler,
    MultiNodeCheckpointManager,
    Node,
    Task,
    Workspace,
    db_name,
    epoch_limiter,
    get_ckpt_filename,
)


class RecordingHandler:
    """A handler with only the seed's five methods, recording every call."""

    def __init__(self, last=None, accessible=True):
        self.calls = []
        self._last, self._accessible = last, accessible

    def set_params(self, db_prefix, db_type, node_names, path_prefix, path_type):
        self.calls.append(("set_params", db_prefix, db_type, tuple(node_names), path_prefix, path_type))

    def last_epoch(self, user_epoch=None):
        self.calls.append(("last_epoch", user_epoch))
        return self._last if user_epoch is None else user_epoch

    def write(self, epoch):
        self.calls.append(("write", epoch))

    def report(self, action_name, stats):
        self.calls.append(("report", action_name, dict(stats)))

    def cp_accessible(self, epoch=None):
        self.calls.append(("cp_accessible", epoch))
        return self._accessible


def _names(calls):
    return [c[0] for c in calls]


def test_handler_satisfies_protocol():
    assert isinstance(RecordingHandler(), MetadataHandler)


def test_fresh_multinode_call_sequence(tmp_path):
    h = RecordingHandler()
    with Cluster():
        with Job() as job:
            for n in range(2):
                build_pipeline(n)
        mgr = MultiNodeCheckpointManager(str(tmp_path), "native", metadata_handler=h)
        assert JobRunner(job, mgr).train(LocalSession()) == 4
    assert h.calls[0] == ("set_params", str(tmp_path), "native", ("trainer_0", "trainer_1"), None, None)
    assert h.calls[1] == ("last_epoch", None)
    rest = h.calls[2:]
    assert _names(rest) == ["cp_accessible", "write", "report"] * 5
    for epoch in range(5):
        acc, write, report = rest[3 * epoch: 3 * epoch + 3]
        assert acc == ("cp_accessible", None) and write == ("write", epoch)
        assert report[1] == "checkpoint_save"
        stats = report[2]
        assert sorted(stats) == [str(tmp_path / f"trainer_{n}.{epoch}") for n in range(2)]
        assert all(isinstance(v, int) and v >= 0 for v in stats.values())


def test_resume_call_sequence_single_node(tmp_path):
    with Node("solo"), Cluster():
        with Job() as job:
            build_pipeline(0)
        JobRunner(job, CheckpointManager(str(tmp_path), "trainer_0")).train(LocalSession())
        h = RecordingHandler(last=2)
        mgr = CheckpointManager(str(tmp_path), "trainer_0", metadata_handler=h)
        ws = Workspace()
        assert JobRunner(job, mgr).train(LocalSession(ws)) == 4
    assert ws["trainer_0/total"].tolist() == [EXPECTED_TOTALS[-1]]
    assert h.calls[0][0:4] == ("set_params", str(tmp_path), "native", ("trainer_0",))
    assert h.calls[1] == ("last_epoch", None)
    assert h.calls[2][0:2] == ("report", "checkpoint_load")
    assert list(h.calls[2][2]) == [str(tmp_path / "trainer_0.2")]
    assert _names(h.calls[3:]) == ["cp_accessible", "write", "report"] * 2
    assert [c[1] for c in h.calls[3:] if c[0] == "write"] == [3, 4]


def test_handler_answer_replaces_user_epoch_and_partial_load_report(tmp_path):
    with Cluster():
        with Job() as job:
            build_pipeline(0)
        JobRunner(job, MultiNodeCheckpointManager(str(tmp_path))).train(LocalSession())

        class Fresh(RecordingHandler):
            def last_epoch(self, user_epoch=None):
                super().last_epoch(user_epoch)
                return None  # "start from scratch" wins over the user's 3

        h = Fresh()
        mgr = MultiNodeCheckpointManager(str(tmp_path), metadata_handler=h)
        runner = JobRunner(job, mgr, resume_from_epoch=3)
        assert runner.train(LocalSession()) == 4
        assert ("last_epoch", 3) in h.calls
        assert [c[1] for c in h.calls if c[0] == "write"] == [0, 1, 2, 3, 4]
        h.calls.clear()
        assert runner.load_blobs_from_checkpoints(["trainer_0/total"], 9, LocalSession()) is False
        assert h.calls == [("report", "checkpoint_partial_load", {})]


def test_inaccessible_checkpoints_skip_save_with_warning(tmp_path, caplog):
    h = RecordingHandler(accessible=False)
    with Cluster():
        with Job() as job:
            build_pipeline(0)
        with caplog.at_level("WARNING", logger="epochal"):  # the seed's unbounded policy
            assert JobRunner(job, MultiNodeCheckpointManager(str(tmp_path), metadata_handler=h),
                             max_failed_saves=None).train(LocalSession()) == 4
    assert "write" not in _names(h.calls) and "report" not in _names(h.calls)
    assert _names(h.calls).count("cp_accessible") == 5
    assert os.listdir(tmp_path) == []
    assert sum("cannot be accessed" in r.getMessage() for r in caplog.records) == 5
    # epochal's default: the third refusal in a row ends the run
    h2 = RecordingHandler(accessible=False)
    with Cluster():
        with Job() as job:
            build_pipeline(0)
        with pytest.raises(CheckpointError, match="3 checkpoint saves in a row failed"):
            JobRunner(job, MultiNodeCheckpointManager(str(tmp_path), metadata_handler=h2)).train(LocalSession())
    assert _names(h2.calls).count("cp_accessible") == 3 and "write" not in _names(h2.calls)


def test_failed_save_skips_write_and_report(tmp_path):
    h = RecordingHandler()
    with Cluster():
        with Job() as job:
            build_pipeline(0)
        (tmp_path / "a_file").write_text("x")  # a missing directory is created: this one cannot be
        mgr = MultiNodeCheckpointManager(str(tmp_path / "a_file" / "missing"), metadata_handler=h)
        assert JobRunner(job, mgr, max_failed_saves=None).train(LocalSession()) == 4  # the seed's policy
    assert _names(h.calls)[2:] == ["cp_accessible"] * 5


def test_falsy_handler_quirk(tmp_path):
    class Falsy(RecordingHandler):
        def __bool__(self):
            return False

    h = Falsy()
    with Cluster():
        with Job() as job:
            build_pipeline(0)
        JobRunner(job, MultiNodeCheckpointManager(str(tmp_path), metadata_handler=h)).train(LocalSession())
    names = _names(h.calls)
    assert "set_params" not in names and "report" not in names
    assert names.count("write") == 5 and names.count("last_epoch") == 1


def test_naming():
    assert get_ckpt_filename("trainer_0", 5) == "trainer_0.5"
    assert get_ckpt_filename("temp_node", 0) == "temp_node.0"
    assert db_name(3, "n", "/ignored", "/x/y_") == "/x/y_n.3"
    assert db_name(5, "trainer_1", "/tmp/d") == "/tmp/d/trainer_1.5"
    assert db_name(0, "trainer_0", "/tmp/p/") == "/tmp/p/trainer_0.0"
    assert db_name(1, "n", "") == "n.1"


def test_epoch_limiter_counts_and_resumes(tmp_path):
    count = {"n": 0}

    class Tick:
        def __call__(self, ws):
            count["n"] += 1
            ws["ticks"] = ws["ticks"] + 1

    class Zero:
        def __call__(self, ws):
            ws["ticks"] = np.array(0)

    with Node("n"), Cluster():
        with Job() as job:
            with job.init_group:
                Task(step=Zero())
            Task(step=Tick())
            epoch_limiter(job, 3)
        ws = Workspace()
        assert JobRunner(job, CheckpointManager(str(tmp_path), "n")).train(LocalSession(ws)) == 3
        assert count["n"] == 3 and int(ws["ticks"]) == 3
        # resume from 1: the saved counter carries over, so 2 more epochs make 3 in all
        ws2 = Workspace()
        assert JobRunner(job, CheckpointManager(str(tmp_path), "n"), resume_from_epoch=1).train(
            LocalSession(ws2)
        ) == 3
        assert int(ws2["ticks"]) == 3

    def rebuilt():
        with Job() as j:
            with j.init_group:
                Task(step=Zero())
            Task(step=Tick())
            epoch_limiter(j, 3)
        return j

    # a job rebuilt in this process (as a restarted script would) finds its counter again
    with Node("n"), Cluster():
        ws3 = Workspace()
        assert JobRunner(rebuilt(), CheckpointManager(str(tmp_path), "n"), resume_from_epoch=2).train(
            LocalSession(ws3)
        ) == 3
        assert int(ws3["ticks"]) == 3
    with pytest.raises(ValueError):
        epoch_limiter(Job(), 0)


def test_stop_condition_from_blob_name_and_one_epoch():
    class SetStop:
        def __call__(self, ws):
            ws["stop_now"] = np.bool_(True)

    with Cluster():
        with Job() as job:
            Task(step=SetStop())
        out = job.add_stop_condition("stop_now")
        assert job.stop_conditions == [out]
        assert JobRunner(job).train(LocalSession()) == 1


def test_nodes_to_checkpoint_and_compile():
    with Cluster():
        with Job(nodes_to_checkpoint=["x"]) as job:
            build_pipeline(0)
        assert job.nodes_to_checkpoint() == ["x"]
        with Job() as job2:
            build_pipeline(1)
            build_pipeline(0)
        assert job2.nodes_to_checkpoint() == ["trainer_1", "trainer_0"]
        assert job2.compile(LocalSession) is None
        assert job2.nodes_to_checkpoint() == ["trainer_1", "trainer_0"]
        assert Job.current(required=False) is None


def test_stats_include_bytes_for_handlers_that_want_them(tmp_path):
    class BytesHandler(RecordingHandler):
        def report_bytes(self, action_name, sizes):
            self.calls.append(("report_bytes", action_name, dict(sizes)))

    h = BytesHandler()
    with Cluster():
        with Job() as job:
            build_pipeline(0)
        JobRunner(job, MultiNodeCheckpointManager(str(tmp_path), metadata_handler=h)).train(LocalSession())
    rb = [c for c in h.calls if c[0] == "report_bytes"]
    assert len(rb) == 5
    path = str(tmp_path / "trainer_0.4")
    assert rb[-1][2] == {path: os.path.getsize(path)}
