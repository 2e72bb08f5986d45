"""The same behaviours through both doors: the ``Checkpointer`` and ``JobRunner`` +
``CheckpointManager`` + ``DirectoryMetadataHandler`` run one engine
(``epochal.checkpoint.engine``), so each test runs against both and checks values: files
present, arrays bit-equal, manifests, stats lines."""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal import (
    Checkpointer,
    CheckpointManager,
    DirectoryMetadataHandler,
    Job,
    JobRunner,
    LocalSession,
    Node,
    Task,
    Workspace,
    epoch_limiter,
    get_db_type,
)
from epochal.checkpoint.handler.metadata import DbReport
from epochal.errors import CheckpointLockedError
from epochal.jobs.events import RunListener


def step_w(w: np.ndarray) -> np.ndarray:
    return w * 1.5 + 1


def expected(k: int) -> np.ndarray:
    w = np.arange(6, dtype=np.float64)
    for _ in range(k):
        w = step_w(w)
    return w


class Init:
    def __call__(self, ws: Any) -> None:
        ws["w"] = np.arange(6, dtype=np.float64)


class Train:
    def __call__(self, ws: Any) -> None:
        ws["w"] = step_w(ws["w"])
        ws["loss"] = np.float64(ws["w"].sum())


class _Each(RunListener):
    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def on_epoch_end(self, epoch: int, seconds: float) -> None:
        self.fn()


class RunnerDoor:
    """JobRunner + CheckpointManager + DirectoryMetadataHandler; node "n", db ``n.<epoch>``."""

    name = "runner"
    node = "n"

    def run(self, d: Path, until: int, *, async_save: bool = False, metrics: bool = False,
            max_failed_saves: int | None = 2, during: Callable[[], None] | None = None) -> tuple[int | None, np.ndarray]:
        with Node(self.node):
            with Job() as job:
                with job.init_group:
                    Task(step=Init())
                Task(step=Train())
                epoch_limiter(job, until)
        ws = Workspace()
        manager = CheckpointManager(str(d), self.node, metadata_handler=DirectoryMetadataHandler())
        runner = JobRunner(job, manager, progress=False, async_save=async_save, max_failed_saves=max_failed_saves,
                           metrics={"loss": "loss"} if metrics else None,
                           listeners=[_Each(during)] if during else [])
        runner.train(LocalSession(ws))
        return runner.resume_from_epoch, np.array(ws["w"])


class CheckpointerDoor:
    """The Checkpointer; node "local", db ``local.<step>``; a fresh start saves step 0 as the
    runner saves epoch 0."""

    name = "checkpointer"
    node = "local"

    def run(self, d: Path, until: int, *, async_save: bool = False, metrics: bool = False,
            max_failed_saves: int | None = 2, during: Callable[[], None] | None = None) -> tuple[int | None, np.ndarray]:
        state: dict[str, Any] = {"w": np.arange(6, dtype=np.float64)}
        with Checkpointer(d, async_save=async_save, max_failed_saves=max_failed_saves) as ck:
            resumed = ck.restore(state)
            step = resumed or 0
            if resumed is None:
                ck.save(0, state)
            while step < until:
                step += 1
                state["w"] = step_w(state["w"])
                ck.save(step, state, metrics={"loss": float(state["w"].sum())} if metrics else None)
                if during:
                    during()
        return resumed, np.array(state["w"])


@pytest.fixture(params=[RunnerDoor, CheckpointerDoor], ids=lambda c: c.name)
def door(request: Any) -> Any:
    return request.param()


def manifests(d: Path) -> list[int]:
    return sorted(int(p.name.split(".")[1]) for p in (d / ".epochal").glob("manifest.*.json"))


def stats(d: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (d / ".epochal" / "stats.jsonl").read_text().splitlines()]


def test_resume_from_the_newest(tmp_path: Path, door: Any) -> None:
    resumed, w = door.run(tmp_path, 3)
    assert resumed is None and w.tobytes() == expected(3).tobytes()
    assert manifests(tmp_path) == [0, 1, 2, 3]
    resumed, w = door.run(tmp_path, 5)
    assert resumed == 3
    assert w.tobytes() == expected(5).tobytes()
    assert manifests(tmp_path) == [0, 1, 2, 3, 4, 5]


def test_a_damaged_newest_is_skipped(tmp_path: Path, door: Any) -> None:
    door.run(tmp_path, 3)
    db = tmp_path / f"{door.node}.3"
    data = bytearray(db.read_bytes())
    data[-20] ^= 0xFF  # a flipped bit in the data
    db.write_bytes(bytes(data))
    resumed, w = door.run(tmp_path, 4)
    assert resumed == 2  # step 3 skipped
    assert w.tobytes() == expected(4).tobytes()  # 2 loaded right, 3 and 4 run again
    got = get_db_type("native").read(str(tmp_path / f"{door.node}.4"), ["w"])["w"]
    assert got.tobytes() == expected(4).tobytes()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_save_leaves_the_earlier_checkpoints(tmp_path: Path, door: Any, monkeypatch: Any,
                                                      async_save: bool) -> None:
    backend = get_db_type("native")
    real = type(backend).write
    before: dict[str, bytes] = {}

    def failing(self: Any, path: str, blobs: Any, *a: Any, **kw: Any) -> Any:
        if path.endswith(f"{door.node}.3"):
            before.update({p.name: p.read_bytes() for p in tmp_path.glob(f"{door.node}.*")})
            raise OSError(errno.ENOSPC, "No space left on device (test)", path)
        return real(self, path, blobs, *a, **kw)

    monkeypatch.setattr(type(backend), "write", failing)
    resumed, w = door.run(tmp_path, 5, async_save=async_save, max_failed_saves=2)
    assert w.tobytes() == expected(5).tobytes()
    assert manifests(tmp_path) == [0, 1, 2, 4, 5]  # 3 failed, training went on
    assert not (tmp_path / f"{door.node}.3").exists() and not list(tmp_path.glob("*.tmp*"))
    assert before and all((tmp_path / n).read_bytes() == b for n, b in before.items())  # untouched
    got = backend.read(str(tmp_path / f"{door.node}.2"), ["w"])["w"]
    assert got.tobytes() == expected(2).tobytes()


def test_two_failed_saves_in_a_row_raise_naming_them(tmp_path: Path, door: Any, monkeypatch: Any) -> None:
    backend = get_db_type("native")
    real = type(backend).write

    def failing(self: Any, path: str, blobs: Any, *a: Any, **kw: Any) -> Any:
        if path.rsplit(".", 1)[-1] in ("2", "3"):
            raise OSError(errno.EIO, "I/O error (test)", path)
        return real(self, path, blobs, *a, **kw)

    monkeypatch.setattr(type(backend), "write", failing)
    with pytest.raises(Exception, match=r"2 checkpoint saves in a row failed.*(epochs|steps) 2, 3.*"
                                        r"newest committed checkpoint is (epoch|step) 1"):
        door.run(tmp_path, 5, max_failed_saves=2)
    assert manifests(tmp_path) == [0, 1]


def test_background_saves_are_committed(tmp_path: Path, door: Any) -> None:
    resumed, w = door.run(tmp_path, 4, async_save=True)
    assert manifests(tmp_path) == [0, 1, 2, 3, 4]
    for k in range(5):
        got = get_db_type("native").read(str(tmp_path / f"{door.node}.{k}"), ["w"])["w"]
        assert got.tobytes() == expected(k).tobytes(), k


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_stats_lines_have_bytes_and_ns(tmp_path: Path, door: Any, async_save: bool) -> None:
    door.run(tmp_path, 3, async_save=async_save)
    door.run(tmp_path, 3)  # a resume: one load line
    lines = stats(tmp_path)
    saves = {ln["epoch"]: ln for ln in lines if ln["action"] == "checkpoint_save"}
    assert sorted(saves) == [0, 1, 2, 3]
    for epoch, ln in saves.items():
        assert ln["node"] == door.node and ln["ns"] > 0
        assert ln["bytes"] > 0 and ln["bytes"] <= (tmp_path / f"{door.node}.{epoch}").stat().st_size
    loads = [ln for ln in lines if ln["action"] == "checkpoint_load"]
    assert [ln["epoch"] for ln in loads] == [3] and loads[0]["bytes"] > 0 and loads[0]["ns"] > 0


def test_metrics_are_recorded(tmp_path: Path, door: Any) -> None:
    door.run(tmp_path, 3, metrics=True)
    for k in (1, 2, 3):
        m = json.loads((tmp_path / ".epochal" / f"manifest.{k}.json").read_text())
        assert m["metrics"] == {"loss": float(expected(k).sum())}, k


def test_the_handler_gets_the_nodes_reports(tmp_path: Path, door: Any, monkeypatch: Any) -> None:
    """The commit takes each db's size and digest from the step that wrote it: the handler
    never reopens the db (no fsync, no reread at commit)."""
    seen: dict[int, dict[str, DbReport]] = {}
    real = DirectoryMetadataHandler.report_dbs

    def spy(self: Any, epoch: int, dbs: dict[str, DbReport]) -> None:
        seen[int(epoch)] = dict(dbs)
        real(self, epoch, dbs)

    monkeypatch.setattr(DirectoryMetadataHandler, "report_dbs", spy)
    door.run(tmp_path, 2)
    assert sorted(seen) == [0, 1, 2]
    for epoch, dbs in seen.items():
        db = str(tmp_path / f"{door.node}.{epoch}")
        assert list(dbs) == [door.node]
        assert dbs[door.node].size == Path(db).stat().st_size
        assert dbs[door.node].digest == get_db_type("native").digest(db)
        m = json.loads((tmp_path / ".epochal" / f"manifest.{epoch}.json").read_text())
        assert m["nodes"][door.node]["digest"] == dbs[door.node].digest


def test_the_writer_lock_is_held_and_let_go(tmp_path: Path, door: Any) -> None:
    refused: list[str] = []

    def try_lock() -> None:
        other = DirectoryMetadataHandler()
        other.set_params(db_prefix=str(tmp_path), db_type="native", node_names=["x"],
                         path_prefix=None, path_type=None)
        try:
            other.acquire_lock()
            other.release_lock()
        except CheckpointLockedError as ex:
            refused.append(str(ex))

    door.run(tmp_path, 2, during=try_lock)
    # a second lock in the same process says so plainly, naming the holder
    assert len(refused) == 2 and "already held by this process" in refused[0]
    try_lock()  # after the run: free
    assert len(refused) == 2
