"""A metric no float holds is refused at save naming it, a stored one
shows as unreadable (never OverflowError or "internal error"); keep_best with a metric that is
never reported raises at the first save that lacks it, naming the metric and the keys given."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from epochal import Checkpointer, JobRunner, LocalSession, MultiNodeCheckpointManager, Workspace  # noqa: E402
from epochal.checkpoint.handler.directory import DirectoryMetadataHandler  # noqa: E402
from epochal.checkpoint.location.manifest import encode_manifest  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory, best_of_directory
from epochal.cli.main import run as cli_run  # noqa: E402
from epochal.errors import MissingBlobError, MissingMetricError, UnsupportedBlobError  # noqa: E402
from epochal.storage.formats.base import get_db_type  # noqa: E402


@pytest.mark.parametrize("bad", [10**400, -(10**400), "0.5", b"1", True, object()],
                         ids=["1e400", "-1e400", "str", "bytes", "bool", "object"])
def test_checkpointer_refuses_a_metric_no_float_holds_naming_it(tmp_path, bad):
    with Checkpointer(tmp_path, keep_best=1, metric="val_loss") as ckpt:
        with pytest.raises(UnsupportedBlobError, match="metric 'val_loss'"):
            ckpt.save(1, {"w": np.zeros(2)}, metrics={"val_loss": bad})
        assert ckpt.steps() == []
        ckpt.save(2, {"w": np.ones(2)}, metrics={"val_loss": 0.5})  # the next good save commits
        assert ckpt.steps() == [2]
    d = CheckpointDirectory(str(tmp_path))
    assert d.committed_epochs() == [2] and sorted(d.scan()) == [2]  # nothing of step 1 was written


def test_handler_write_refuses_a_huge_metric_before_the_manifest(tmp_path):
    h = DirectoryMetadataHandler()
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=["n"], path_prefix=None, path_type=None)
    get_db_type("native").write(str(tmp_path / "n.1"), {"w": np.zeros(2)})
    with pytest.raises(UnsupportedBlobError, match="metric 'acc'.*no float holds it"):
        h.write(1, metrics={"acc": 10**400})
    assert not (tmp_path / ".epochal" / "manifest.1.json").exists()
    h.write(1, metrics={"acc": float("nan"), "n": 10**300})  # NaN: recorded as null; a big int a float holds: kept
    assert CheckpointDirectory(str(tmp_path)).read_manifest(1).metrics == {"acc": None, "n": 10**300}


def test_a_stored_unreadable_metric_shows_as_unreadable(tmp_path, capsys):
    with Checkpointer(tmp_path, keep_best=1, metric="val_loss") as ckpt:
        for step, loss in [(1, 3.0), (2, 1.0), (3, 2.0)]:
            ckpt.save(step, {"w": np.full(2, step)}, metrics={"val_loss": loss})
    d = CheckpointDirectory(str(tmp_path))
    assert d.committed_epochs() == [2, 3]
    m = d.manifest(3)  # as an older epochal could write it
    m["metrics"]["val_loss"] = 10**400
    with open(d.manifest_path(3), "wb") as f:
        f.write(encode_manifest(m))
    best = best_of_directory(tmp_path)
    assert best is not None and best.epochs == [2] and best.unreadable == {3} and best.values[3] is None
    with Checkpointer(tmp_path, keep_best=1, metric="val_loss") as ckpt:
        assert ckpt.best_steps() == [2]
        ckpt.save(4, {"w": np.full(2, 4)}, metrics={"val_loss": 5.0})  # retention does not fail
        assert ckpt.steps() == [2, 3, 4]  # the unreadable one cannot be ranked: kept
        ckpt.save(5, {"w": np.full(2, 5)}, metrics={"val_loss": 6.0})
        assert ckpt.steps() == [2, 3, 5]
    capsys.readouterr()
    rc = cli_run(["ls", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "unreadable" in out and "internal error" not in out + err


def test_checkpointer_keep_best_metric_never_reported_raises_naming_it_and_the_keys(tmp_path):
    with Checkpointer(tmp_path, keep_best=2, metric="val_loss") as ckpt:
        with pytest.raises(MissingMetricError) as info:
            ckpt.save(1, {"w": np.zeros(2)}, metrics={"val_los": 1.0, "acc": 0.5})
        assert not isinstance(info.value, MissingBlobError)  # a metric is no blob
        text = str(info.value)
        assert "'val_loss'" in text and "'val_los'" in text and "'acc'" in text
        assert ckpt.steps() == []
        assert not (tmp_path / "local.1").exists()  # refused before anything was written
        assert not [n for n in os.listdir(tmp_path) if n.startswith("local.1")]
        ckpt.save(2, {"w": np.zeros(2), "val_loss": np.float64(0.25)})  # as a scalar of the state: fine
        assert ckpt.steps() == [2]
        assert CheckpointDirectory(str(tmp_path)).read_manifest(2).metrics == {"val_loss": 0.25}


def test_job_runner_saves_without_metrics_are_unranked(tmp_path):
    """No metric reported at all (the run evaluates less often than it saves): every save is
    committed unranked, and retention falls to keep_last; never a MissingBlobError."""
    import _crash_job as cj

    job, _ = cj.build_job(3)
    handler = DirectoryMetadataHandler(keep_best=1, keep_last=2, metric="val_loss")
    manager = MultiNodeCheckpointManager(str(tmp_path), "native", metadata_handler=handler)
    JobRunner(job, manager, progress=False).train(LocalSession(Workspace()))
    d = CheckpointDirectory(str(tmp_path))
    assert d.committed_epochs() == [2, 3]  # keep_last=2; nothing counted as a best one
    assert all(d.read_manifest(e).metrics == {"val_loss": None} for e in (2, 3))


def test_checkpointer_keep_best_with_unranked_saves(tmp_path):
    """keep_best=1 with evaluations every third save: the unranked saves are kept or dropped
    by keep_last, the best evaluated one is kept, the metric-less ones never count as best."""
    with Checkpointer(tmp_path, keep_best=1, keep_last=1, metric="val_loss") as ckpt:
        for step in range(1, 8):
            ev = {"val_loss": float(10 - step) if step != 6 else 0.5} if step % 3 == 0 else None
            ckpt.save(step, {"w": np.full(2, step)}, metrics=ev)
        assert ckpt.steps() == [6, 7]  # the best ranked (6: 0.5) and the newest (unranked)
        assert ckpt.best_steps() == [6]
    d = CheckpointDirectory(str(tmp_path))
    assert d.read_manifest(7).metrics == {"val_loss": None}


def test_handler_without_keep_best_records_no_metric_and_does_not_raise(tmp_path):
    h = DirectoryMetadataHandler(keep_last=2)
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=["n"], path_prefix=None, path_type=None)
    get_db_type("native").write(str(tmp_path / "n.1"), {"w": np.zeros(2)})
    h.write(1)
    m: Any = CheckpointDirectory(str(tmp_path)).read_manifest(1)
    assert m.metrics == {}
