"""Best-k retention: the pure policy, the directory handler (Job model, the metric from a scalar
blob) and the Checkpointer (the metric from ``metrics=``), each over a resumed run."""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from epochal import JobRunner, LocalSession, MultiNodeCheckpointManager, Workspace  # noqa: E402
from epochal.checkpoint.handler.directory import DirectoryMetadataHandler  # noqa: E402
from epochal.checkpoint.location.retention import RetentionPolicy, best_epochs, epochs_to_delete  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory, best_of_directory

# a metric per epoch (epoch 0, saved after init, has none): the best are not the newest
LOSS = [None, 5.0, 3.0, 4.0, 1.0, 6.0, 2.0, 7.0, 2.0, 8.0, float("nan"), 9.0]


def expected_kept(epochs: int, k: int, last: int = 1, mode: str = "min") -> list[int]:
    """The best k of epochs 1..epochs by LOSS (ties: older), plus the newest ``last``."""
    ranked = [(v, e) for e, v in enumerate(LOSS[: epochs + 1]) if v is not None and not math.isnan(v)]
    sign = 1 if mode == "min" else -1
    best = [e for _, e in sorted(ranked, key=lambda ve: (sign * ve[0], ve[1]))[:k]]
    return sorted({*best, *range(epochs - last + 1, epochs + 1)})


# ----------------------------------------------------------------------------- pure function

def test_best_epochs_ranks_ignores_unranked_and_breaks_ties_to_the_older() -> None:
    metrics = {e: v for e, v in enumerate(LOSS)}
    assert best_epochs(metrics, 3, "min") == [4, 6, 8]
    assert best_epochs(metrics, 2, "max") == [11, 9]
    assert best_epochs({1: 2.0, 2: 2.0, 3: 1.0}, 2) == [3, 1]
    assert best_epochs({0: None, 1: float("nan"), 2: True, 3: "x"}, 5) == []


@pytest.mark.parametrize(
    "policy, expected_deleted",
    [
        (RetentionPolicy(keep_best=2, metric="val_loss"), [0, 1, 2, 3, 5, 7, 8, 9, 10]),
        (RetentionPolicy(keep_best=2, metric="val_loss", keep_last=3), [0, 1, 2, 3, 5, 7, 8]),
        (RetentionPolicy(keep_best=1, metric="val_loss", mode="max", keep_every=5), [1, 2, 3, 4, 6, 7, 8, 9]),
    ],
)
def test_keep_best_is_a_union_with_the_other_knobs(policy: RetentionPolicy, expected_deleted: list[int]) -> None:
    metrics = {e: v for e, v in enumerate(LOSS)}
    assert epochs_to_delete(range(12), 11, (), policy, metrics=metrics) == expected_deleted


def test_keep_best_keeps_epochs_it_cannot_rank_and_pins() -> None:
    policy = RetentionPolicy(keep_best=1, metric="m")
    # epoch 2 is absent from the metrics (say only a mirror has it): kept; 0 is pinned
    assert epochs_to_delete(range(5), 4, {0}, policy, metrics={0: 9, 1: 1, 3: 5, 4: 7}) == [3]


def test_keep_best_needs_a_metric_and_a_mode() -> None:
    with pytest.raises(ValueError, match="metric"):
        RetentionPolicy(keep_best=2)
    with pytest.raises(ValueError, match="mode"):
        RetentionPolicy(keep_best=2, metric="m", mode="lowest")
    with pytest.raises(ValueError):
        RetentionPolicy(keep_best=0, metric="m")


# ----------------------------------------------------------------------------- Job model

class Crash(Exception):
    pass


def job_run(directory: Any, epochs: int, crash_at: int | None = None, **handler_kw: Any) -> None:
    """A numpy job whose epoch step sets the scalar blob ``val_loss`` from LOSS."""
    import _crash_job as cj

    def hook(e: int, ws: Any) -> None:
        ws["val_loss"] = np.float64(LOSS[e])
        if e == crash_at:
            raise Crash(e)

    job, _ = cj.build_job(epochs, hook=hook)
    from epochal import Node, Task

    with job.init_group, Node("trainer_0"):
        Task(step=lambda ws: ws.__setitem__("val_loss", np.float64("nan")))
    handler = DirectoryMetadataHandler(**handler_kw)
    manager = MultiNodeCheckpointManager(str(directory), "native", metadata_handler=handler)
    try:
        JobRunner(job, manager, progress=False).train(LocalSession(Workspace()))
    except Crash:
        pass


def test_handler_keeps_exactly_the_best_over_a_resumed_job(tmp_path: Any) -> None:
    kw = {"keep_best": 2, "metric": "val_loss", "mode": "min"}
    job_run(tmp_path, 9, crash_at=5, **kw)  # epochs 0..4 committed, then a crash
    d = CheckpointDirectory(str(tmp_path))
    assert d.committed_epochs() == expected_kept(4, 2)
    job_run(tmp_path, 9, **kw)  # resumes from 4, runs to 9
    assert d.committed_epochs() == expected_kept(9, 2) == [4, 6, 9]
    assert sorted(d.scan()) == [4, 6, 9]  # no db of a deleted epoch is left behind
    m = d.manifest(6)
    assert m["metrics"] == {"val_loss": 2.0}
    assert m["keep_best"] == {"k": 2, "metric": "val_loss", "mode": "min"}
    best = best_of_directory(tmp_path)
    assert best is not None and best.epochs == [4, 6] and best.metric == "val_loss"
    assert best.values[9] == 8.0
    assert best_of_directory(tmp_path, metric="val_loss", mode="max", k=1).epochs == [9]  # type: ignore[union-attr]


def test_handler_records_nan_as_unranked_and_no_metric_means_no_record(tmp_path: Any) -> None:
    job_run(tmp_path / "a", 2, keep_best=1, metric="val_loss")
    d = CheckpointDirectory(str(tmp_path / "a"))
    assert d.committed_epochs() == [2]  # 1 (loss 5) is worse than 2 (loss 3); 0 is NaN
    job_run(tmp_path / "b", 2)
    d = CheckpointDirectory(str(tmp_path / "b"))
    assert "metrics" not in d.manifest(1) and "keep_best" not in d.manifest(1)
    assert best_of_directory(tmp_path / "b") is None


# ----------------------------------------------------------------------------- Checkpointer

def test_checkpointer_keeps_exactly_the_best_over_a_resumed_run(tmp_path: Any) -> None:
    from epochal import Checkpointer

    kw = {"keep_last": 1, "keep_best": 3, "metric": "val_loss"}
    with Checkpointer(tmp_path, **kw) as ckpt:  # steps 1..5, the metric through metrics=
        assert ckpt.restore({"w": np.zeros(2)}) is None
        for step in range(1, 6):
            ckpt.save(step, {"w": np.full(2, step)}, metrics={"val_loss": LOSS[step]})
        assert ckpt.steps() == expected_kept(5, 3)
    state: dict[str, Any] = {"w": np.zeros(2)}
    with Checkpointer(tmp_path, **kw) as ckpt:  # a rerun: the metric as a scalar in the state
        assert ckpt.restore(state) == 5 and state["w"].tolist() == [5, 5]
        for step in range(6, 12):
            ckpt.save(step, {"w": np.full(2, step), "val_loss": LOSS[step]})
        assert ckpt.steps() == expected_kept(11, 3) == [4, 6, 8, 11]
        assert ckpt.best_steps() == [4, 6, 8]
    d = CheckpointDirectory(str(tmp_path))
    assert sorted(d.scan()) == [4, 6, 8, 11] and d.manifest(8)["metrics"] == {"val_loss": 2.0}
    assert d.manifest(11)["metrics"] == {"val_loss": 9.0}
