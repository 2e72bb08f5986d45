"""Background saves: snapshot arenas reused across epochs, bounded, never
overwritten while their write is in flight; the writer thread shut down when done."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
from _pipeline import build_pipeline

from epochal import (
    Checkpointer,
    CheckpointManager,
    Cluster,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Workspace,
    get_db_type,
    register_db_type,
)
from epochal.checkpoint.tasks.background import (
    DEFAULT_SWITCH_INTERVAL,
    BackgroundSaver,
    arena_bytes,
    process_saver,
)
from epochal.storage.formats.native.backend import NativeBackend

GATE = threading.Event()


class GatedNative(NativeBackend):
    """The native format, whose writes wait for GATE (so a write stays in flight)."""

    name = "gated"

    def write(self, path, blobs):
        assert GATE.wait(30)
        return super().write(path, blobs)



def _read(path):
    return get_db_type("native").read(str(path))


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(300, 200)).astype(np.float32), "b": rng.integers(0, 9, 77),
            "step": np.int64(seed), "note": f"epoch {seed}"}


def _check(path, expected):
    saved = _read(path)
    assert set(saved) == set(expected)
    for k, v in expected.items():
        if isinstance(v, np.ndarray):
            assert saved[k].dtype == v.dtype and saved[k].tobytes() == v.tobytes()
        else:
            assert saved[k] == v


def test_the_snapshot_arena_is_reused_and_each_file_has_its_epochs_bits(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=True)
    state = _state(0)
    expected = {}
    for step in range(1, 5):
        state["w"] += np.float32(step)  # in place: the live arrays keep their memory
        state["b"][step] = -step
        state["step"], state["note"] = np.int64(step), f"epoch {step}"
        expected[step] = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()}
        ckpt.save(step, state)
        state["w"] *= -1  # training goes on while the write runs
        state["b"][:] = 1000 + step
    ckpt.close()
    pool = ckpt._saver.pool
    assert (pool.allocated, pool.reused, pool.fresh) == (1, 3, 0)
    assert pool.pooled_bytes == 0 and not ckpt._saver.running  # closed: freed, thread gone
    for step, values in expected.items():
        _check(tmp_path / f"local.{step}", values)


def test_an_arena_in_flight_is_never_reused(tmp_path, monkeypatch):
    """Two saves of one node in flight at once: the second gets a second pooled arena (the
    default bound allows two per owner), and changes to the live values after each
    snapshot reach neither file."""
    from epochal.storage.formats import base

    monkeypatch.setattr(base, "_registry", dict(base._registry))  # "gated" for this test only
    register_db_type("gated", GatedNative)
    ws = Workspace()
    ws.update(_state(1))
    s = LocalSession(ws)
    mgr = CheckpointManager(str(tmp_path), "n", db_type="gated")
    s.run(mgr.init())
    GATE.clear()
    saver = process_saver()
    before = (saver.pool.allocated, saver.pool.reused, saver.pool.fresh)
    try:
        s.run(mgr.save(1, background=True))  # held at the gate: its arena is leased
        first = {k: np.copy(ws[k]) for k in ("w", "b")}
        ws["w"] *= 2
        ws["b"] += 5
        s.run(mgr.save(2, background=True))
        second = {k: np.copy(ws[k]) for k in ("w", "b")}
        ws["w"] += 1
        ws["b"] -= 100
        assert sys.getswitchinterval() == pytest.approx(DEFAULT_SWITCH_INTERVAL)
    finally:
        GATE.set()
    s.run(mgr.join_save(1))
    s.run(mgr.join_save(2))
    assert sys.getswitchinterval() == pytest.approx(0.005)  # put back after the last write
    after = (saver.pool.allocated, saver.pool.reused, saver.pool.fresh)
    assert after[0] - before[0] == 2 and after[2] - before[2] == 0
    for epoch, values in ((1, first), (2, second)):
        saved = _read(tmp_path / f"n.{epoch}")
        for k, v in values.items():
            assert saved[k].tobytes() == v.tobytes()
    # the arena came back: the next save reuses it and writes the live values of now
    third = np.copy(ws["w"])
    s.run(mgr.save(3, background=True))
    ws["w"] -= 7
    s.run(mgr.join_save(3))
    assert saver.pool.reused - after[1] == 1
    assert _read(tmp_path / "n.3")["w"].tobytes() == third.tobytes()


def test_max_host_bytes_bounds_the_pool(tmp_path):
    state = _state(2)
    layout = [v.nbytes for v in (state["w"], state["b"])]
    small = BackgroundSaver(max_host_bytes=state["w"].nbytes // 2)  # below one state: no snapshot memory
    with pytest.raises(ValueError, match="max_host_bytes"):
        BackgroundSaver(max_host_bytes=-1)
    seen = []
    for epoch in range(3):
        state["w"] += 1
        snap = small.snapshot("n@x", state)
        seen.append(small.pool.pooled_bytes)
        small.start(str(tmp_path / f"n.{epoch}"), "native", snap)
        small.join(str(tmp_path / f"n.{epoch}"))
        assert _read(tmp_path / f"n.{epoch}")["w"].tobytes() == state["w"].tobytes()
    assert seen == [0, 0, 0] and small.pool.fresh == 0 and small.pool.allocated == 0
    assert small.synchronous == 3  # below one state: each save written from the live state, no copy
    small.close()
    # the default bound is two states' worth per owner; saves joined before the next
    # snapshot use one arena each: two owners, two arenas
    auto = BackgroundSaver()
    for epoch in range(3):
        for owner in ("a", "b"):
            db = str(tmp_path / f"{owner}.{epoch}")
            auto.start(db, "native", auto.snapshot(owner, state))
            assert auto.pool.pooled_bytes <= auto.pool.limit
            auto.join(db)
    one = arena_bytes((*layout, 8, len("epoch 2")))
    assert auto.pool.limit == 4 * one and auto.pool.pooled_bytes == 2 * one
    assert (auto.pool.allocated, auto.pool.reused, auto.pool.fresh) == (2, 4, 0)
    # a state that changes shape within the arena's capacity: the arena is reused
    state["w"] = np.zeros((10, 10), dtype=np.float32)
    auto.start(str(tmp_path / "a.9"), "native", auto.snapshot("a", state))
    auto.join(str(tmp_path / "a.9"))
    assert auto.pool.pooled_bytes == 2 * one and auto.pool.refitted == 1
    assert _read(tmp_path / "a.9")["w"].tobytes() == state["w"].tobytes()
    # one that outgrows it: the stale arena goes, the new one takes its place
    state["w"] = np.zeros((600, 600), dtype=np.float32)
    auto.start(str(tmp_path / "a.10"), "native", auto.snapshot("a", state))
    auto.join(str(tmp_path / "a.10"))
    assert auto.pool.pooled_bytes == one + arena_bytes((state["w"].nbytes, layout[1], 8, len("epoch 2")))
    auto.close()
    assert auto.pool.pooled_bytes == 0


def test_a_failed_write_surfaces_at_join_and_gives_its_arena_back(tmp_path):
    saver = BackgroundSaver()
    state = _state(3)
    saver.start(str(tmp_path / "missing" / "n.1"), "native", saver.snapshot("n", state))
    with pytest.raises(FileNotFoundError):
        saver.join(str(tmp_path / "missing" / "n.1"))
    assert sys.getswitchinterval() == pytest.approx(0.005)
    saver.start(str(tmp_path / "n.2"), "native", saver.snapshot("n", state))
    saver.join(str(tmp_path / "n.2"))
    assert (saver.pool.allocated, saver.pool.reused) == (1, 1)
    _check(tmp_path / "n.2", state)
    saver.close()


def _save_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("epochal-save")]


def test_the_writer_thread_is_shut_down_after_train(tmp_path):
    from epochal import Job

    with Cluster():
        with Job() as job:
            build_pipeline(0)
        mgr = MultiNodeCheckpointManager(str(tmp_path))
        assert JobRunner(job, mgr, async_save=True).train(LocalSession()) == 4
    assert _save_threads() == []
    assert not process_saver().running and process_saver().pool.pooled_bytes == 0
    assert sorted(_read(tmp_path / "trainer_0.3")) == sorted(_read(tmp_path / "trainer_0.4"))
