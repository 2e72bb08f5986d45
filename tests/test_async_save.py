"""Background saves: a snapshot taken at save time, written while training goes on."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _pipeline import EXPECTED_TOTALS, build_pipeline

from epochal import (
    CheckpointManager,
    Cluster,
    Job,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Workspace,
    get_db_type,
)


def test_snapshot_is_isolated_from_later_updates(tmp_path):
    ws = Workspace()
    ws["w"] = np.arange(1_000_000, dtype=np.float32)
    ws["step"] = 3
    s = LocalSession(ws)
    mgr = CheckpointManager(str(tmp_path), "n")
    s.run(mgr.init())
    s.run(mgr.save(1, background=True))
    ws["w"] *= -1  # in place, while the write may still be running
    ws["step"] = 4
    s.run(mgr.join_save(1))
    saved = get_db_type("native").read(str(tmp_path / "n.1"))
    np.testing.assert_array_equal(saved["w"], np.arange(1_000_000, dtype=np.float32))
    assert saved["step"] == 3
    stats: dict[str, int] = {}
    sizes: dict[str, int] = {}
    mgr.collect_checkpoint_stats(stats, sizes)
    path = str(tmp_path / "n.1")
    assert stats[path] > 0 and sizes[path] == os.path.getsize(path)


def test_background_error_surfaces_at_join(tmp_path):
    ws = Workspace()
    ws["w"] = np.zeros(3)
    s = LocalSession(ws)
    import errno

    from epochal.storage.io.seam import register_store

    class NoDirectory:  # a store whose every write fails as a missing directory would
        def create(self, path, size=None):
            raise FileNotFoundError(errno.ENOENT, "directory does not exist", path)

    register_store("nodir", NoDirectory)  # (a missing local directory is created)
    mgr = CheckpointManager("nodir://missing", "n")
    s.run(mgr.init())
    s.run(mgr.save(1, background=True))  # the snapshot succeeds...
    with pytest.raises(FileNotFoundError):
        s.run(mgr.join_save(1))  # ...the write's failure comes out here
    with pytest.raises(Exception, match="no background save is pending"):
        s.run(mgr.join_save(1))


def test_runner_with_async_saves_matches_sync(tmp_path):
    class Recorder:
        def __init__(self):
            self.writes = []

        def set_params(self, **kw):
            pass

        def last_epoch(self, user_epoch=None):
            return user_epoch

        def write(self, epoch):
            # a commit only ever happens once that epoch's db is complete on disk
            assert get_db_type("native").read(str(tmp_path / f"trainer_0.{epoch}"))
            self.writes.append(epoch)

        def report(self, action, stats):
            pass

        def cp_accessible(self, epoch=None):
            return True

    h = Recorder()
    with Cluster():
        with Job() as job:
            out = build_pipeline(0)
        ws = Workspace()
        mgr = MultiNodeCheckpointManager(str(tmp_path), metadata_handler=h)
        assert JobRunner(job, mgr, async_save=True).train(LocalSession(ws)) == 4
        assert ws[out[0]].tolist() == [EXPECTED_TOTALS[-1]]
        assert h.writes == [0, 1, 2, 3, 4]
        for epoch in range(1, 5):
            saved = get_db_type("native").read(str(tmp_path / f"trainer_0.{epoch}"))
            assert saved["trainer_0/total"].tolist() == [EXPECTED_TOTALS[epoch - 1]]


def test_async_saves_with_directory_handler_commit_every_epoch(tmp_path):
    from epochal import DirectoryMetadataHandler
    from epochal.checkpoint.location.view import CheckpointDirectory

    with Cluster():
        with Job() as job:
            out = build_pipeline(0)
        h = DirectoryMetadataHandler(keep_last=2)
        mgr = MultiNodeCheckpointManager(str(tmp_path), metadata_handler=h)
        assert JobRunner(job, mgr, async_save=True).train(LocalSession()) == 4
        d = CheckpointDirectory(str(tmp_path))
        assert d.committed_epochs() == [3, 4] and d.manifest(4)["final"] is True
        assert sorted(r["epoch"] for r in d.stats() if r["action"] == "checkpoint_save") == [0, 1, 2, 3, 4]
        assert all(r["bytes"] and r["ns"] > 0 for r in d.stats())
        assert d.verify_epoch(3) == [] and d.verify_epoch(4) == []
        # a rerun finds the finished job
        ws = Workspace()
        mgr = MultiNodeCheckpointManager(str(tmp_path), metadata_handler=DirectoryMetadataHandler())
        assert JobRunner(job, mgr, async_save=True).train(LocalSession(ws)) == 4
        assert ws[out[0]].tolist() == [EXPECTED_TOTALS[-1]]


def test_epoch_error_commits_the_pending_save_then_raises(tmp_path):
    from epochal import DirectoryMetadataHandler, Task

    class FailAt:
        def __call__(self, ws):
            if int(ws["trainer_0/cursor"]) >= 6:
                raise RuntimeError("epoch 2 blew up")

    with Cluster():
        with Job() as job:
            build_pipeline(0)
            Task(step=FailAt(), node="trainer_0")
        h = DirectoryMetadataHandler()
        mgr = MultiNodeCheckpointManager(str(tmp_path), metadata_handler=h)
        with pytest.raises(RuntimeError, match="epoch 2 blew up"):
            JobRunner(job, mgr, async_save=True).train(LocalSession())
        # epoch 1's background save was committed before the error propagated
        assert h.committed_epochs() == [0, 1]


def test_async_snapshot_of_torch_module_and_optimizer(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    ws = Workspace()
    ws["model"], ws["opt"] = model, opt
    s = LocalSession(ws)
    mgr = CheckpointManager(str(tmp_path), "n")
    s.run(mgr.init())
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    s.run(mgr.save(1, background=True))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on while the write runs
    s.run(mgr.join_save(1))
    saved = get_db_type("native").read(str(tmp_path / "n.1"))
    assert set(saved["model"]) == set(expected)
    for k, v in expected.items():
        assert torch.equal(saved["model"][k], v)
    assert saved["opt"]["state"][0]["exp_avg"].shape == (32, 64)
