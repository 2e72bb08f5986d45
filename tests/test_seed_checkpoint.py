"""Every scenario of the seed's checkpoint_test.py, ported, plus the spec's errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _pipeline import EXPECTED_TOTALS, build_pipeline

from epochal import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    Cluster,
    CopyUploadBuilder,
    Job,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    Task,
    UploadTaskGroupBuilder,
    Workspace,
    epoch_limiter,
    get_db_type,
)
from epochal.checkpoint import InitRequiredError, NodeListMismatchError


def _fetcher(outputs):
    t = Task(outputs=outputs)

    def fetch_total(session):
        session.run(t)
        return t.outputs()[0].fetch()

    return fetch_total


def run_with(builder, num_nodes=1):
    with Cluster():
        with Job() as job:
            outputs = []
            for node_id in range(num_nodes):
                outputs += build_pipeline(node_id)
        fetch_total = _fetcher(outputs[0])
        session, checkpoint = builder()
        job.compile(LocalSession)
        num_epochs = JobRunner(job, checkpoint).train(session)
        assert num_epochs == len(EXPECTED_TOTALS)
        assert fetch_total(session)[0] == EXPECTED_TOTALS[-1]

        for initial_epoch in range(1, num_epochs + 1):
            session, checkpoint = builder()
            last = JobRunner(job, checkpoint, resume_from_epoch=initial_epoch).train(session)
            # resuming from the finished epoch 4 runs one empty epoch 5 (the seed's rule)
            assert last == max(num_epochs, initial_epoch + 1)
            assert fetch_total(session)[0] == EXPECTED_TOTALS[-1]

        for epoch in range(1, num_epochs + 1):
            session.run(checkpoint.load(epoch))
            assert fetch_total(session)[0] == EXPECTED_TOTALS[epoch - 1]
    return job


def test_single_checkpoint(tmp_path):
    def builder():
        return LocalSession(Workspace()), CheckpointManager(str(tmp_path), "temp_node", "native")

    with Node("temp_node"):
        run_with(builder)
    assert sorted(os.listdir(tmp_path)) == [f"temp_node.{e}" for e in range(6)]


def test_multi_node(tmp_path):
    def builder():
        return LocalSession(Workspace()), MultiNodeCheckpointManager(str(tmp_path), "native")

    run_with(builder, num_nodes=3)
    files = sorted(os.listdir(tmp_path))
    assert files == sorted(f"trainer_{n}.{e}" for n in range(3) for e in range(6))
    # each node's db holds every checkpointed blob with its exact value at that epoch
    values = get_db_type("native").read(str(tmp_path / "trainer_2.3"))
    assert values["trainer_2/total"].tolist() == [EXPECTED_TOTALS[2]]
    assert values["trainer_2/total"].dtype == np.int64
    assert int(values["trainer_2/cursor"]) == 9
    assert "blob_names" in values and list(values["blob_names"]) == sorted(values)


def test_ckpt_name_and_load_model_from_ckpts(tmp_path):
    num_nodes = 3
    ws = Workspace()
    with Cluster():
        with Job() as job:
            for node_id in range(num_nodes):
                build_pipeline(node_id)
        job.compile(LocalSession)
        checkpoint = MultiNodeCheckpointManager(str(tmp_path), "native")
        with LocalSession(ws) as session:
            num_epochs = JobRunner(job, checkpoint).train(session)
        assert num_epochs == len(EXPECTED_TOTALS)
        for node_id in range(num_nodes):
            for epoch in range(5):
                assert checkpoint.get_ckpt_db_name(f"trainer_{node_id}", epoch) == str(
                    tmp_path / f"trainer_{node_id}.{epoch}"
                )
        assert checkpoint.get_ckpt_db_name("nobody", 1) is None
        user_blobs = [b for b in ws.blobs if not b.startswith("__epochal__/")]
        expected = {"blob_names"} | {
            f"trainer_{n}/{k}" for n in range(num_nodes) for k in ("data", "cursor", "total", "finished")
        }
        assert set(user_blobs) == expected

    ws = Workspace()
    session = LocalSession(ws)
    assert len(ws.blobs) == 0
    model_blob_names = ["trainer_1/total", "trainer_2/total"]
    checkpoint = MultiNodeCheckpointManager(str(tmp_path), "native")
    with Cluster():
        with Job() as job:
            for node_id in range(num_nodes):
                build_pipeline(node_id)
        job.compile(LocalSession)
        runner = JobRunner(job, checkpoint)
        for epoch in range(1, 5):
            assert runner.load_blobs_from_checkpoints(model_blob_names, epoch, session) is True
            for name in model_blob_names:
                assert ws.has_blob(name)
                assert ws.fetch_blob(name).tolist() == [EXPECTED_TOTALS[epoch - 1]]
        assert runner.load_blobs_from_checkpoints(model_blob_names, 5, session) is False


def test_load_blobs_partial_side_effect_and_missing_names_skipped(tmp_path):
    with Cluster():
        with Job() as job:
            for node_id in range(2):
                build_pipeline(node_id)
        mgr = MultiNodeCheckpointManager(str(tmp_path), "native")
        JobRunner(job, mgr).train(LocalSession())
        os.remove(tmp_path / "trainer_1.2")
        ws = Workspace()
        runner = JobRunner(job, MultiNodeCheckpointManager(str(tmp_path), "native"))
        ok = runner.load_blobs_from_checkpoints(["trainer_0/total", "not_there"], 2, LocalSession(ws))
        assert ok is False  # trainer_1's db is missing...
        assert ws["trainer_0/total"].tolist() == [EXPECTED_TOTALS[1]]  # ...trainer_0 loaded first
        assert "not_there" not in ws


def test_upload_checkpoint(tmp_path):
    upload_dir = tmp_path / "upload"

    class TestUploadBuilder(UploadTaskGroupBuilder):
        def __init__(self):
            self.calls = []
            self.inner = CopyUploadBuilder(str(upload_dir))

        def build(self, epoch, checkpoint_manager):
            self.calls.append(epoch)
            return self.inner.build(epoch, checkpoint_manager)

    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    with Cluster():
        with Job() as job:
            for node_id in range(2):
                build_pipeline(node_id)
        builder = TestUploadBuilder()
        mgr = MultiNodeCheckpointManager(str(ckpt_dir), "native")
        assert JobRunner(job, mgr, upload_task_group_builder=builder).train(LocalSession()) == 4
    assert builder.calls == [4]
    for node in ("trainer_0", "trainer_1"):
        assert (upload_dir / node).read_bytes() == (ckpt_dir / f"{node}.4").read_bytes()
    with pytest.raises(NotImplementedError):
        UploadTaskGroupBuilder().build(1, mgr)


def test_upload_failure_propagates(tmp_path):
    class Broken(UploadTaskGroupBuilder):
        def build(self, epoch, checkpoint_manager):
            raise OSError("remote storage is down")

    with Cluster():
        with Job() as job:
            build_pipeline(0)
        mgr = MultiNodeCheckpointManager(str(tmp_path), "native")
        with pytest.raises(OSError, match="remote storage is down"):
            JobRunner(job, mgr, upload_task_group_builder=Broken()).train(LocalSession())


def test_ckpt_save_failure(tmp_path, caplog):
    # the seed's missing path is now created; one under a regular file cannot be
    (tmp_path / "a_file").write_text("not a directory")
    missing = str(tmp_path / "a_file" / "path_does_not_exist")
    for node_id in range(3):
        session = LocalSession(Workspace())
        checkpoint = MultiNodeCheckpointManager(missing, "native")
        with Cluster():
            with Job() as job:
                outputs = build_pipeline(node_id)
            job.compile(LocalSession)
            with caplog.at_level("WARNING", logger="epochal"):
                # the seed's unbounded policy; epochal's default stops after 3 in a row (below)
                num_epochs = JobRunner(job, checkpoint, max_failed_saves=None).train(session)
        assert num_epochs == len(EXPECTED_TOTALS)
        assert session.ws[outputs[0]].tolist() == [EXPECTED_TOTALS[-1]]
    warnings = [r.getMessage() for r in caplog.records if "Unable to write checkpoint" in r.getMessage()]
    assert len(warnings) == 3 * 5 and "epoch 0" in warnings[0]
    assert not os.path.exists(missing)
    # by default the third failure in a row ends the run, naming the cause
    with Cluster():
        with Job() as job:
            build_pipeline(0)
        with pytest.raises(CheckpointError, match="3 checkpoint saves in a row failed.*epochs 0, 1, 2.*cannot create the checkpoint directory .*a_file/path_does_not_exist"):
            JobRunner(job, MultiNodeCheckpointManager(missing, "native")).train(LocalSession(Workspace()))


class _Fill:
    def __init__(self, name, value):
        self.name, self.value = name, value

    def __call__(self, ws):
        ws[self.name] = np.full(8, self.value, dtype=np.float32)


class _Double:
    def __call__(self, ws):
        ws["data"] = ws["data"] * 2


class _Copy:
    def __call__(self, ws):
        ws["data_cpu"] = ws["data"].copy()


def test_download_group_simple():
    with Cluster():
        with Job() as job:
            with Node("trainer:0"):
                with job.init_group:
                    Task(step=_Fill("data", 1.0))
                with job.epoch_group:
                    Task(step=_Double())
                with job.download_group:
                    # GLOBAL: the copy must outlive the task (a PRIVATE one would vanish)
                    Task(step=_Copy(), workspace_type="global")
                epoch_limiter(job, 1)
        ws = Workspace()
        assert JobRunner(job).train(LocalSession(ws)) == 1
    np.testing.assert_array_equal(ws.fetch_blob("data_cpu"), np.full(8, 2.0, dtype=np.float32))


def test_reuse_checkpoint_manager(tmp_path):
    session = LocalSession(Workspace())
    checkpoint = MultiNodeCheckpointManager(str(tmp_path), "native")
    with Cluster():
        with Job() as job:
            outputs = build_pipeline(0)
        fetch_total = _fetcher(outputs)
        job.compile(LocalSession)
        num_epochs = JobRunner(job, checkpoint).train(session)
        for initial_epoch in range(1, num_epochs + 1):
            JobRunner(job, checkpoint, resume_from_epoch=initial_epoch).train(session)
            assert fetch_total(session).tolist() == [EXPECTED_TOTALS[-1]]


# ------------------------------------------------------------------ errors of spec 7.3
def test_missing_resume_checkpoint_raises_naming_file(tmp_path):
    with Cluster():
        with Job() as job:
            build_pipeline(0)
        mgr = MultiNodeCheckpointManager(str(tmp_path), "native")
        with pytest.raises(CheckpointNotFoundError, match=r"trainer_0\.7.*epoch 7"):
            JobRunner(job, mgr, resume_from_epoch=7).train(LocalSession())


def test_resume_checkpoint_missing_a_listed_blob_raises(tmp_path):
    from epochal import MissingBlobError

    with Cluster():
        with Job() as job:
            build_pipeline(0)
        JobRunner(job, MultiNodeCheckpointManager(str(tmp_path), "native")).train(LocalSession())
    path = str(tmp_path / "trainer_0.2")
    backend = get_db_type("native")
    values = backend.read(path)
    del values["trainer_0/total"]
    backend.write(path, values)  # blob_names still lists it
    with Cluster():
        with Job() as job:
            build_pipeline(0)
        with pytest.raises(MissingBlobError, match="trainer_0/total"):
            JobRunner(job, MultiNodeCheckpointManager(str(tmp_path), "native"), resume_from_epoch=2).train(
                LocalSession()
            )


def test_without_manager():
    with Cluster():
        with Job() as job:
            outputs = build_pipeline(0)
        ws = Workspace()
        runner = JobRunner(job)
        with pytest.raises(ValueError, match="Checkpoint manager is None"):
            runner.save_checkpoints(1, LocalSession(ws))
        with pytest.raises(ValueError, match="Checkpoint manager is None"):
            runner.load_blobs_from_checkpoints(["x"], 1, LocalSession(ws))
        assert JobRunner(job).train(LocalSession(ws)) == 4
        assert ws[outputs[0]].tolist() == [145]
        # resume_from_epoch without a manager skips init and starts at k+1, nothing loaded
        ws2 = Workspace()
        ws2["trainer_0/data"] = np.arange(10)
        ws2["trainer_0/cursor"] = np.array(9)
        ws2["trainer_0/total"] = np.array([0])
        assert JobRunner(job, resume_from_epoch=6).train(LocalSession(ws2)) == 7
        assert ws2[outputs[0]].tolist() == [9]


def test_single_manager_has_no_load_blobs_locally(tmp_path):
    with Cluster():
        with Job() as job:
            build_pipeline(0)
        runner = JobRunner(job, CheckpointManager(str(tmp_path), "trainer_0"))
        with pytest.raises(AttributeError):
            runner.load_blobs_from_checkpoints(["x"], 1, LocalSession())


def test_manager_errors_before_init_and_changed_nodes(tmp_path):
    mgr = MultiNodeCheckpointManager(str(tmp_path), "native")
    with pytest.raises(InitRequiredError, match="init must be called first"):
        mgr.save(1)
    with pytest.raises(InitRequiredError):
        mgr.load(1)
    with pytest.raises(TypeError):
        mgr.get_ckpt_db_name("a", 1)
    mgr.init(["a", "b"])
    with pytest.raises(NodeListMismatchError, match=r"\['a', 'b'\].*\['a'\]"):
        mgr.init(["a"])
    with pytest.raises(NodeListMismatchError):
        mgr.load_blobs_locally(["b", "a"], ["x"], 1, LocalSession())
    single = CheckpointManager(str(tmp_path), "a")
    with pytest.raises(AssertionError, match="single node"):
        single.init(["a", "b"])
    with pytest.raises(AssertionError, match="init must be called first"):
        single.save(1)
    single.init()
    with pytest.raises(AssertionError, match="has not run"):
        single.blob_list()
    with pytest.raises(ValueError, match="cannot name a checkpoint file"):
        CheckpointManager(str(tmp_path), "a/b")
    from epochal import CheckpointError

    with pytest.raises(CheckpointError, match="unknown db_type 'leveldb'"):
        CheckpointManager(str(tmp_path), "a", db_type="leveldb")


def test_reused_manager_keeps_first_blob_list(tmp_path):
    mgr = MultiNodeCheckpointManager(str(tmp_path), "native")
    ws = Workspace()
    ws["a"] = np.arange(3)
    s = LocalSession(ws)
    s.run(mgr.init(["n"]))
    ws["later"] = 1
    assert mgr.init(["n"], retrieve_from_epoch=3).tasks() == []  # a no-op group
    s.run(mgr.save(0))
    assert sorted(get_db_type("native").read(str(tmp_path / "n.0"))) == ["a", "blob_names"]


def test_save_same_epoch_overwrites_and_unsupported_value(tmp_path):
    from epochal import UnsupportedBlobError

    mgr = CheckpointManager(str(tmp_path), "n")
    ws = Workspace()
    ws["w"] = np.zeros(3)
    s = LocalSession(ws)
    s.run(mgr.init())
    s.run(mgr.save(1))
    ws["w"] = np.ones(3)
    s.run(mgr.save(1))
    np.testing.assert_array_equal(get_db_type("native").read(str(tmp_path / "n.1"))["w"], np.ones(3))
    before = (tmp_path / "n.1").read_bytes()
    ws["w"] = object()
    with pytest.raises(UnsupportedBlobError, match="'w'"):
        s.run(mgr.save(1))
    assert (tmp_path / "n.1").read_bytes() == before  # the old file is intact
    assert sorted(os.listdir(tmp_path)) == ["n.1"]  # no temp file left behind
    del ws["w"]
    from epochal import MissingBlobError

    with pytest.raises(MissingBlobError, match=r"'w'.*node 'n'"):
        s.run(mgr.save(2))
