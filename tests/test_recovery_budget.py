"""Recovery with budget left: a node lost during the final save, during the
recovery's own reload, or in the exit group is recovered within ``max_failures``; once the
budget is spent the error names the node and the last committed epoch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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

EXITS: list[int] = []  # exit group runs (outside the workspace: it survives a lost node)


class Init:
    def __call__(self, ws: Any) -> None:
        ws["w"] = np.arange(6, dtype=np.float64)
        ws["log"] = np.zeros(0, np.int64)


class Train:
    def __call__(self, ws: Any) -> None:
        ws["w"] = ws["w"] * 1.5 + 1
        ws["log"] = np.append(ws["log"], np.int64(len(ws["log"]) + 1))


class Exit:
    def __call__(self, ws: Any) -> None:
        EXITS.append(int(len(ws["log"])))


def build(epochs: int = 6) -> Job:
    with Node("n"):
        with Job() as job:
            with job.init_group:
                Task(step=Init())
            Task(step=Train())
            with job.exit_group:
                Task(step=Exit())
            epoch_limiter(job, epochs)
    return job


def kind(compiled: Any, job: Job) -> str:
    if compiled.group is job.epoch_group:
        return "epoch"
    if compiled.group is job.exit_group:
        return "exit"
    names = [t.name.rsplit("/", 1)[-1] for t in compiled.tasks()]
    for k in ("checkpoint_save", "checkpoint_load"):
        if any(n.startswith(k) for n in names):
            return k
    return "other"


class Flaky(LocalSession):
    """Loses node 'n' (its workspace with it) at the listed (kind, n-th run of that kind)."""

    def __init__(self, job: Job, lose: set[tuple[str, int]]) -> None:
        super().__init__(Workspace())
        self.job, self.lose = job, set(lose)
        self.runs: dict[str, int] = {}
        self.replaced = 0

    def _run_compiled(self, compiled: Any) -> None:
        k = kind(compiled, self.job)
        self.runs[k] = self.runs.get(k, 0) + 1
        if (k, self.runs[k]) in self.lose:
            self.ws = Workspace()  # the machine died with its memory
            raise NodeLostError("n", f"lost during the {k} (test)")
        super()._run_compiled(compiled)

    def replace_node(self, node: str, *, timeout: float = 300.0) -> dict[str, Any]:
        self.replaced += 1
        self.ws = Workspace()
        return {}


def run(d: Path, session: Flaky, **kw: Any) -> int:
    manager = MultiNodeCheckpointManager(str(d), metadata_handler=DirectoryMetadataHandler())
    return JobRunner(session.job, manager, progress=False, recovery_timeout=5, **kw).train(session)


def blobs(ws: Any) -> dict[str, np.ndarray]:
    return {n: np.array(ws[n]) for n in ("w", "log")}


@pytest.fixture
def reference(tmp_path: Path) -> dict[str, np.ndarray]:
    EXITS.clear()
    s = Flaky(build(), set())
    assert run(tmp_path / "ref", s) == 6
    assert EXITS == [6]
    EXITS.clear()
    return blobs(s.ws)


def same(got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> None:
    for k in ref:
        assert got[k].dtype == ref[k].dtype and got[k].tobytes() == ref[k].tobytes(), k
    assert got["log"].tolist() == [1, 2, 3, 4, 5, 6]


def final_of(d: Path, epoch: int) -> bool:
    return bool(json.loads((d / ".epochal" / f"manifest.{epoch}.json").read_text())["final"])


def test_a_node_lost_during_the_final_save_is_recovered(tmp_path: Path, reference: Any) -> None:
    s = Flaky(build(), {("checkpoint_save", 7)})  # saves of epochs 0..6: the 7th is the final one
    assert run(tmp_path, s, max_failures=1) == 6
    assert s.replaced == 1
    same(blobs(s.ws), reference)
    assert final_of(tmp_path, 6) and EXITS == [6]


def test_a_node_lost_during_the_recoverys_reload_is_recovered(tmp_path: Path, reference: Any) -> None:
    s = Flaky(build(), {("epoch", 3), ("checkpoint_load", 1)})  # lost, then lost again while reloading
    assert run(tmp_path, s, max_failures=2) == 6
    assert s.replaced == 2
    same(blobs(s.ws), reference)


def test_a_node_lost_in_the_exit_group_is_recovered_without_rerunning_epochs(tmp_path: Path, reference: Any) -> None:
    s = Flaky(build(), {("exit", 1)})
    assert run(tmp_path, s, max_failures=1) == 6
    assert s.replaced == 1 and s.runs["epoch"] == 6  # no epoch ran twice
    same(blobs(s.ws), reference)
    assert EXITS == [6]  # the exit group ran (again) on the reloaded final epoch


@pytest.mark.parametrize("lose,budget,epoch", [
    ({("checkpoint_save", 7)}, 0, 5),
    ({("epoch", 3), ("checkpoint_load", 1)}, 1, 2),
    ({("exit", 1)}, 0, 6),
    ({("exit", 1), ("checkpoint_load", 1)}, 1, 6),
], ids=["final-save", "reload", "exit", "exit-then-reload"])
def test_a_spent_budget_names_node_and_last_committed_epoch(tmp_path: Path, lose: Any, budget: int,
                                                            epoch: int) -> None:
    EXITS.clear()
    s = Flaky(build(), lose)
    with pytest.raises(NodeLostError) as info:
        run(tmp_path, s, max_failures=budget)
    assert info.value.node == "n" and info.value.epoch == epoch
    assert f"last committed epoch: {epoch}" in str(info.value)
