"""Background saves prepared as a run starts: with ``async_save=True`` both doors
have the engine call ``BackgroundSaver.prepare`` (the Checkpointer in ``restore``, the
JobRunner before its init save or after its resume load), so the snapshot arena exists and
is faulted in before the first background save, which then takes it (``reused``, nothing
allocated or fresh on the training thread). Checked with the pool's counters, the arena's
residency (mincore) and the bits of what was saved; no timings."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import epochal
from epochal.checkpoint.engine import CheckpointEngine
from epochal.checkpoint.tasks import background
from epochal.checkpoint.tasks.background import arena_bytes
from epochal.checkpoint.tasks.handler_calls import NO_RECORDS
from epochal.errors import NodeLostError
from epochal.jobs.job import epoch_limiter

MIB = 1 << 20


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal(MIB // 4, dtype=np.float32), "b": rng.integers(0, 9, 3 << 16)}


def _need(state: dict[str, np.ndarray]) -> int:
    return arena_bytes(tuple(v.nbytes for v in state.values()))


def _warmed(pool: background.SnapshotPool) -> None:
    """Wait for the pool's warmer thread to finish (joined: no timeout to tune)."""
    warmer = pool._warmer
    if warmer is not None:
        warmer.join()


def _resident(buf: np.ndarray) -> float:
    """The fraction of ``buf``'s pages in memory (mincore)."""
    page = 4096
    lo = buf.ctypes.data - buf.ctypes.data % page
    n = (buf.ctypes.data + buf.nbytes - lo + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(n * page), vec) == 0
    return sum(v & 1 for v in vec) / n


def test_checkpointer_restore_prepares_the_arena_its_first_async_save_takes(tmp_path):
    state = _state(0)
    with epochal.Checkpointer(tmp_path, async_save=True) as c:
        pool = c._saver.pool
        assert c.restore(state) is None  # a new run: prepared all the same
        assert (pool.allocated, pool.reused, pool.fresh) == (1, 0, 0)
        _warmed(pool)
        (arena,) = pool._arenas
        assert pool.warmed == 1 and arena.nbytes == _need(state) and pool.pooled_bytes == _need(state)
        assert _resident(arena.buffer) == 1.0 and not arena.buffer.any()  # faulted in, still zeros
        c.save(1, state)
        c.wait()
        assert (pool.allocated, pool.reused, pool.fresh) == (1, 1, 0)  # the save took it
    # a resumed run: its restore prepares again, before its first save
    with epochal.Checkpointer(tmp_path, async_save=True) as c:
        live = {k: np.zeros_like(v) for k, v in state.items()}
        assert c.restore(live) == 1
        for k, v in state.items():
            assert np.array_equal(live[k], v)
        pool = c._saver.pool
        assert (pool.allocated, pool.reused, pool.fresh) == (1, 0, 0)
        live["a"] += 1.0
        c.save(2, live)
        c.wait()
        assert (pool.allocated, pool.reused, pool.fresh) == (1, 1, 0)
    saved = epochal.get_db_type("native").read(str(tmp_path / "local.2"))
    assert np.array_equal(saved["a"], state["a"] + 1.0) and np.array_equal(saved["b"], state["b"])


def test_checkpointer_without_async_save_prepares_nothing(tmp_path):
    state = _state(1)
    with epochal.Checkpointer(tmp_path) as c:
        c.restore(state)
        assert c._saver.pool.allocated == 0 and c._saver.pool.pooled_bytes == 0


def test_a_failed_prepare_never_fails_the_run_but_a_lost_node_does():
    engine = CheckpointEngine(NO_RECORDS)

    def broken() -> None:
        raise OSError("no memory to spare")

    assert engine.prepare_saves(broken) is False
    assert engine.prepare_saves(lambda: None) is True

    def lost() -> None:
        raise NodeLostError("n", "its process is gone")

    with pytest.raises(NodeLostError):
        engine.prepare_saves(lost)


def _job(seen: list[tuple[int, int, int, int]], limit: int) -> epochal.Job:
    """A job of one node whose every epoch records the process saver's pool counters (what
    the pool did up to that epoch: the init save, or the resume), then adds 1 to ``w``."""

    def epoch(ws):
        pool = background.process_saver().pool
        seen.append((pool.allocated, pool.reused, pool.fresh, pool.pooled_bytes))
        ws["w"] = ws["w"] + 1.0

    def init(ws):
        ws.update(_state(2))
        ws["w"] = np.arange(MIB // 4, dtype=np.float32)  # + 1 per epoch: exact

    with epochal.Job() as job, epochal.Node("trainer"):
        with job.init_group:
            epochal.Task(step=init, name="init")
        epochal.Task(step=epoch, name="epoch")
        epoch_limiter(job, limit)
    return job


@pytest.fixture
def new_saver(monkeypatch: pytest.MonkeyPatch):
    """A fresh process saver for each run (its counters start at 0)."""
    monkeypatch.setattr(background._SAVERS, "saver", None)


@pytest.mark.parametrize("async_save", [True, False])
def test_runner_prepares_before_its_first_background_save(tmp_path, new_saver, async_save):
    seen: list[tuple[int, int, int, int]] = []
    ws = epochal.Workspace()
    mgr = epochal.CheckpointManager(str(tmp_path), "trainer", metadata_handler=epochal.DirectoryMetadataHandler())
    runner = epochal.JobRunner(_job(seen, 2), mgr, async_save=async_save, progress=False)
    assert runner.train(epochal.LocalSession(ws)) == 2
    need = _need(_state(2)) + arena_bytes((MIB,))  # a, b and w
    if async_save:
        # the init save (epoch 0) snapshotted into the arena prepared for it
        assert seen[0][:3] == (1, 1, 0) and seen[0][3] >= need
    else:
        assert seen[0] == (0, 0, 0, 0)
    # a resumed run: prepared after the load, before any save of this run
    background._SAVERS.saver = None
    seen.clear()
    ws2 = epochal.Workspace()
    mgr2 = epochal.CheckpointManager(str(tmp_path), "trainer", metadata_handler=epochal.DirectoryMetadataHandler())
    runner2 = epochal.JobRunner(_job(seen, 4), mgr2, async_save=async_save, progress=False)
    assert runner2.train(epochal.LocalSession(ws2)) == 4
    if async_save:
        assert seen[0][:3] == (1, 0, 0) and seen[0][3] >= need
        assert seen[1][:3] == (1, 1, 0)  # epoch 3's save took the prepared arena
    else:
        assert seen[0] == (0, 0, 0, 0)
    assert np.array_equal(ws2["w"], np.arange(MIB // 4, dtype=np.float32) + 4.0)
    saved = epochal.get_db_type("native").read(str(tmp_path / "trainer.4"))
    assert np.array_equal(saved["w"], np.arange(MIB // 4, dtype=np.float32) + 4.0)


def test_a_finished_job_resumed_prepares_nothing(tmp_path, new_saver):
    seen: list[tuple[int, int, int, int]] = []
    mgr = epochal.CheckpointManager(str(tmp_path), "trainer", metadata_handler=epochal.DirectoryMetadataHandler())
    epochal.JobRunner(_job(seen, 1), mgr, async_save=True, progress=False).train(epochal.LocalSession(epochal.Workspace()))
    background._SAVERS.saver = None
    mgr2 = epochal.CheckpointManager(str(tmp_path), "trainer", metadata_handler=epochal.DirectoryMetadataHandler())
    runner = epochal.JobRunner(_job(seen, 1), mgr2, async_save=True, progress=False)
    assert runner.train(epochal.LocalSession(epochal.Workspace())) == 1  # the limit is reached
    assert background.process_saver().pool.allocated == 0


def test_every_node_of_a_multi_node_job_is_prepared(tmp_path, new_saver):
    seen: list[tuple[int, int, int, list[str]]] = []

    def init(ws):
        ws["w"] = np.ones(MIB // 4, dtype=np.float32)

    def epoch(ws):
        pool = background.process_saver().pool
        seen.append((pool.allocated, pool.reused, pool.fresh, sorted(a.owner for a in pool._arenas)))

    with epochal.Job() as job:
        for node in ("t0", "t1"):
            with epochal.Node(node):
                with job.init_group:
                    epochal.Task(step=init, name="init")
                epochal.Task(step=epoch, name="epoch")
                epoch_limiter(job, 1)
    mgr = epochal.MultiNodeCheckpointManager(str(tmp_path), "native", metadata_handler=epochal.DirectoryMetadataHandler())
    epochal.JobRunner(job, mgr, async_save=True, progress=False).train(epochal.LocalSession(epochal.Workspace()))
    assert seen[0][:3] == (2, 2, 0)  # one arena per node, each taken by that node's init save
    assert seen[0][3] == [f"t0@{tmp_path}", f"t1@{tmp_path}"]
