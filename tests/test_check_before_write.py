"""Every path that writes into live objects checks all of them before it writes any (issue
23.4): LoadBlobs, the runner's resume, ``Checkpointer.restore``, the recovery reload and
``load_blobs_from_checkpoints``. After the error every live tensor is bit for bit what it
was, on every node."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import _live  # noqa: E402
from _live import bit_equal, tensors  # noqa: E402

from epochal import (  # noqa: E402
    BlobMismatchError,
    Checkpointer,
    CheckpointManager,
    DirectoryMetadataHandler,
    Job,
    JobRunner,
    MultiNodeCheckpointManager,
    Task,
    Workspace,
)
from epochal.checkpoint.tasks.steps import LoadBlobs  # noqa: E402
from epochal.integrations.torch import ResumableSampler  # noqa: E402

NODES = ["a", "b"]


def mlp(layers: int, seed: int) -> Any:
    torch.manual_seed(seed)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(4, 4), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def stepped(model: Any) -> Any:
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return opt


class Train:
    """One step of every model in the node's workspace (so each epoch changes the weights)."""

    def __init__(self, node: str) -> None:
        self.node = node

    def __call__(self, ws: Any) -> None:
        with torch.no_grad():
            for p in ws["model"].parameters():
                p.add_(0.5)
        ws["t"].add_(1.0)
        ws["done"] = ws["done"] + 1
        ws["stop"] = ws["done"] >= 2


class PerNode(_live.PerNode):
    """A session of a workspace per node whose epoch tasks are :class:`Train` steps."""

    def __init__(self, wss: dict[str, Workspace], replacement: Any = None) -> None:
        super().__init__(wss, replacement, epoch_kind=Train)


def node_ws(layers: int, seed: int) -> Workspace:
    ws = Workspace()
    ws["model"] = mlp(layers, seed)
    ws["opt"] = stepped(ws["model"])
    ws["t"] = torch.arange(5, dtype=torch.float32)
    ws["done"] = 0
    return ws


def two_node_job() -> Job:
    with Job(nodes_to_checkpoint=NODES) as job:
        for n in NODES:
            Task(step=Train(n), outputs=["stop"], node=n)
    job.add_stop_condition(job.epoch_group.tasks()[0].outputs()[0])
    return job


def manager(d: Any) -> MultiNodeCheckpointManager:
    return MultiNodeCheckpointManager(str(d), metadata_handler=DirectoryMetadataHandler())


def live(wss: dict[str, Workspace], node: str) -> list[Any]:
    ws = wss[node]
    return tensors(ws["model"], ws["opt"], ws["t"])


@pytest.fixture
def committed(tmp_path: Any) -> Any:
    """Epochs 0..2 of the two-node job, models of 2 layers on both nodes."""
    wss = {n: node_ws(2, i) for i, n in enumerate(NODES)}
    JobRunner(two_node_job(), manager(tmp_path), progress=False).train(PerNode(wss))
    return tmp_path


# ------------------------------------------------------------------ LoadBlobs
def test_loadblobs_checks_every_blob_first(tmp_path: Any) -> None:
    from epochal import get_db_type

    get_db_type("native").write(str(tmp_path / "db"), {"m1": mlp(2, 0), "m2": mlp(2, 1), "t": torch.ones(3)})
    ws = Workspace()
    ws["m1"], ws["m2"], ws["t"] = mlp(2, 5), mlp(3, 6), torch.zeros(3)  # m2: another depth
    before = tensors(ws["m1"], ws["m2"], ws["t"])
    with pytest.raises(BlobMismatchError, match="'m2'"):
        LoadBlobs(str(tmp_path / "db"), "native", ["m1", "m2", "t"], node="n", epoch=1)(ws)
    assert bit_equal(tensors(ws["m1"], ws["m2"], ws["t"]), before)


# ------------------------------------------------------------------ the runner's resume
def test_runner_resume_into_a_model_of_another_depth_touches_nothing(tmp_path: Any) -> None:
    def one_node(layers: int, seed: int) -> tuple[Job, Workspace, Any]:
        ws = node_ws(layers, seed)
        with Job(nodes_to_checkpoint=["a"]) as job:
            Task(step=Train("a"), outputs=["stop"], node="a")
        job.add_stop_condition(job.epoch_group.tasks()[0].outputs()[0])
        return job, ws, CheckpointManager(str(tmp_path), "a", metadata_handler=DirectoryMetadataHandler())

    job, ws, m = one_node(2, 0)
    JobRunner(job, m, progress=False).train(PerNode({"a": ws}))
    job, ws, m = one_node(3, 1)
    before = tensors(ws["model"], ws["opt"], ws["t"])
    with pytest.raises(BlobMismatchError, match="'model'"):
        JobRunner(job, m, progress=False).train(PerNode({"a": ws}))
    assert bit_equal(tensors(ws["model"], ws["opt"], ws["t"]), before)


def test_runner_resume_checks_every_node_before_any_loads(committed: Any) -> None:
    wss = {"a": node_ws(2, 7), "b": node_ws(3, 8)}  # node b's model changed depth
    before = {n: live(wss, n) for n in NODES}
    with pytest.raises(BlobMismatchError, match="node 'b'.*'model'"):
        JobRunner(two_node_job(), manager(committed), progress=False).train(PerNode(wss))
    for n in NODES:
        assert bit_equal(live(wss, n), before[n]), n  # node a was not loaded either


# ------------------------------------------------------------------ the recovery reload
def test_the_recovery_reload_checks_every_node_before_any_loads(tmp_path: Any) -> None:
    wss = {n: node_ws(2, i) for i, n in enumerate(NODES)}
    session = PerNode(wss, replacement=lambda node: node_ws(3, 9))  # placed again: another depth
    session.lose.add(("b", "epoch"))
    survivor: list[Any] = []

    real = session._run_compiled

    def spy(compiled: Any) -> None:
        if any(t.name.endswith("checkpoint_init") for t in compiled.tasks()) and wss.get("a") is not None \
                and session.replacement is not None and not survivor and ("b", "epoch") not in session.lose:
            survivor.extend(live(session.wss, "a"))  # node a as the reload finds it
        real(compiled)

    session._run_compiled = spy  # type: ignore[method-assign]
    with pytest.raises(BlobMismatchError, match="node 'b'.*'model'"):
        JobRunner(two_node_job(), manager(tmp_path), progress=False, max_failures=1).train(session)
    assert survivor and bit_equal(live(session.wss, "a"), survivor)


# ------------------------------------------------------------------ load_blobs_from_checkpoints
def test_load_blobs_from_checkpoints_checks_every_node_first(committed: Any) -> None:
    wss = {"a": node_ws(2, 7), "b": node_ws(3, 8)}
    before = {n: live(wss, n) for n in NODES}
    runner = JobRunner(two_node_job(), manager(committed), progress=False)
    with pytest.raises(BlobMismatchError, match="'model'"):
        runner.load_blobs_from_checkpoints(["model", "t"], 2, PerNode(wss))
    for n in NODES:
        assert bit_equal(live(wss, n), before[n]), n
    # the same call with fitting models loads both nodes
    wss = {"a": node_ws(2, 7), "b": node_ws(2, 8)}
    assert runner.load_blobs_from_checkpoints(["model", "t"], 2, PerNode(wss)) is True
    assert torch.equal(wss["a"]["t"], torch.arange(5, dtype=torch.float32) + 2)


# ------------------------------------------------------------------ Checkpointer.restore
def test_checkpointer_restore_checks_the_sampler_before_the_model(tmp_path: Any) -> None:
    def state(n_data: int, seed: int) -> dict[str, Any]:
        model = mlp(2, seed)
        return {"model": model, "opt": stepped(model), "sampler": ResumableSampler(list(range(n_data)), seed=1),
                "t": torch.arange(3, dtype=torch.float32) + seed}

    with Checkpointer(tmp_path) as ck:
        ck.save(1, state(10, 0))
    s = state(12, 5)  # the data set grew: the saved position does not fit
    before = tensors(s["model"], s["opt"], s["t"])
    pos = (s["sampler"].epoch, s["sampler"].position, s["sampler"].seed)
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(BlobMismatchError, match=r"'sampler'.*10 samples, the data set has 12"):
            ck.restore(s)
    assert bit_equal(tensors(s["model"], s["opt"], s["t"]), before)
    assert (s["sampler"].epoch, s["sampler"].position, s["sampler"].seed) == pos
