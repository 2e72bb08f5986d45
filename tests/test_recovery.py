"""JobRunner(max_failures=N): a node lost mid-run is placed again, every node reloads the last
committed epoch, and the same train() finishes bit-identical to an uninterrupted run."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from epochal import (
    DirectoryMetadataHandler,
    Job,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    Task,
    Workspace,
    epoch_limiter,
)
from epochal.errors import NodeLostError


class Init:
    def __call__(self, ws):
        ws["w"] = np.arange(6, dtype=np.float64)
        ws["log"] = np.zeros(0, np.int64)


class Train:
    def __call__(self, ws):
        ws["w"] = ws["w"] * 1.5 + 1
        ws["log"] = np.append(ws["log"], np.int64(len(ws["log"]) + 1))


def build(epochs=6):
    with Node("n"):
        with Job() as job:
            with job.init_group:
                Task(step=Init())
            Task(step=Train())
            epoch_limiter(job, epochs)
    return job


class FlakySession(LocalSession):
    """Loses node 'n' (its workspace: a new process would start empty) at chosen runs of the
    epoch group; ``replace_node`` gives it a fresh workspace, as RaySession gives a new actor."""

    def __init__(self, job, lose_at=(), placeable=True):
        super().__init__(Workspace())
        self.job, self.lose_at, self.placeable = job, set(lose_at), placeable
        self.epoch_runs = 0
        self.replaced: list[str] = []

    def _run_compiled(self, compiled):
        if compiled.group is self.job.epoch_group or compiled is self.job.epoch_group:
            self.epoch_runs += 1
            if self.epoch_runs in self.lose_at:
                super()._run_compiled(compiled)  # the epoch ran halfway...
                self.ws = Workspace()  # ...then the machine died with its memory
                raise NodeLostError("n", "its Ray actor is gone (test)")
        super()._run_compiled(compiled)

    def replace_node(self, node, *, timeout=300.0):
        if not self.placeable:
            raise NodeLostError(node, f"no machine offers it within {timeout:g} s")
        self.replaced.append(node)
        self.ws = Workspace()
        return {}


def run(d, session, **kw):
    manager = MultiNodeCheckpointManager(str(d), metadata_handler=DirectoryMetadataHandler())
    return JobRunner(session.job, manager, progress=False, **kw).train(session)


def blobs(ws):
    return {n: np.array(ws[n]) for n in ("w", "log")}


@pytest.fixture
def reference(tmp_path):
    s = FlakySession(build())
    assert run(tmp_path / "ref", s) == 6
    return blobs(s.ws)


def test_a_lost_node_is_replaced_and_the_run_finishes_bit_identical(tmp_path, reference, caplog):
    s = FlakySession(build(), lose_at={3, 6})
    with caplog.at_level(logging.WARNING, logger="epochal"):
        assert run(tmp_path, s, max_failures=2, recovery_timeout=5) == 6
    assert s.replaced == ["n", "n"]
    got = blobs(s.ws)
    for k in reference:
        assert got[k].dtype == reference[k].dtype and got[k].tobytes() == reference[k].tobytes(), k
    assert got["log"].tolist() == [1, 2, 3, 4, 5, 6]  # each epoch counted once: reloaded, rerun
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("Recovered from the loss of 'n'" in m for m in msgs) == 2
    assert any("failure 1 of at most 2" in m and "reloads epoch 2" in m for m in msgs), msgs


def test_without_max_failures_a_lost_node_names_node_and_last_epoch(tmp_path):
    s = FlakySession(build(), lose_at={4})
    with pytest.raises(NodeLostError) as info:
        run(tmp_path, s)
    assert info.value.node == "n" and info.value.epoch == 3
    assert "node 'n' was lost" in str(info.value) and "last committed epoch: 3" in str(info.value)
    assert s.replaced == []


def test_one_failure_too_many_raises(tmp_path):
    s = FlakySession(build(), lose_at={2, 4})
    with pytest.raises(NodeLostError, match=r"after 1 recovered failure.*last committed epoch: 2"):
        run(tmp_path, s, max_failures=1, recovery_timeout=5)
    assert s.replaced == ["n"]


def test_a_node_that_cannot_be_placed_in_time_raises(tmp_path):
    s = FlakySession(build(), lose_at={2}, placeable=False)
    with pytest.raises(NodeLostError, match="no machine offers it within 5 s.*last committed epoch: 1"):
        run(tmp_path, s, max_failures=3, recovery_timeout=5)


def test_bad_values_are_refused_up_front():
    with pytest.raises(ValueError, match="max_failures"):
        JobRunner(build(), max_failures=-1)
    with pytest.raises(ValueError, match="async_save"):
        JobRunner(build(), max_failures=1, async_save=True)
