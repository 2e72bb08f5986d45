"""The plain-loop Checkpointer (restore/save/wait/due/preempted, on the directory layout of the
Job model) and the data position: ResumableSampler and torchdata's StatefulDataLoader resumed
mid-epoch, exactly, with the documented DataLoader recipe."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

import epochal  # noqa: E402
from epochal import Checkpointer, RNGState  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.errors import CheckpointError, UnsupportedBlobError  # noqa: E402
from epochal.integrations.torch import ResumableSampler  # noqa: E402
from epochal.jobs.cadence import parse_interval  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _torch_bits import same_state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

DataLoader = torch.utils.data.DataLoader
TensorDataset = torch.utils.data.TensorDataset


def training(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    return {"model": model, "opt": opt, "sched": sched, "rng": RNGState(), "history": [], "n": 0}


def steps(state: dict[str, Any], k: int) -> None:
    for _ in range(k):
        loss = state["model"](torch.randn(5, 4)).square().mean()
        state["opt"].zero_grad()
        loss.backward()
        state["opt"].step()
        state["sched"].step()
        state["history"].append(loss.item())
        state["n"] += 1


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}


# ----------------------------------------------------------------------------- the Checkpointer

def test_fresh_start_then_restore_in_place_bit_identical(tmp_path: Path) -> None:
    ref = training(0)
    steps(ref, 6)
    with Checkpointer(tmp_path) as ckpt:
        state = training(0)
        before = snapshot(state)
        assert ckpt.restore(state) is None and same_state(snapshot(state), before)
        steps(state, 3)
        ckpt.save(3, state)
    # a new process, in effect: other seeds, fresh objects
    state = training(123)
    model, opt = state["model"], state["opt"]
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(state) == 3 and ckpt.last_step == 3
        assert state["model"] is model and state["opt"] is opt  # in place
        assert state["n"] == 3 and len(state["history"]) == 3  # plain values replaced
        steps(state, 3)
        ckpt.save(6, state)
    assert same_state(snapshot(state), snapshot(ref))
    # the usual layout: dbs local.<step>, one manifest per step, seen by CheckpointDirectory
    d = CheckpointDirectory(tmp_path)
    assert d.committed_epochs() == [3, 6] and sorted(d.scan()) == [3, 6]
    assert d.manifest(6)["nodes"]["local"]["file"] == "local.6" and d.verify_epoch(6) == []
    assert [s["action"] for s in d.stats()] == ["checkpoint_save", "checkpoint_load", "checkpoint_save"]


def test_restore_skips_a_damaged_newest_step_and_warns(tmp_path: Path, caplog: Any) -> None:
    with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.full((64,), float(step))})
    path = tmp_path / "local.2"
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x10
    path.write_bytes(bytes(raw))
    state = {"w": torch.zeros(64)}
    with caplog.at_level(logging.WARNING, "epochal"), Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(state) == 1
    assert torch.equal(state["w"], torch.ones(64))
    assert "local.2" in caplog.text


def test_entries_the_checkpoint_lacks_keep_their_values(tmp_path: Path, caplog: Any) -> None:
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, {"a": 1})
    state = {"a": 0, "ema": torch.ones(2)}
    with caplog.at_level(logging.WARNING, "epochal"), Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(state) == 0
    assert state["a"] == 1 and torch.equal(state["ema"], torch.ones(2)) and "'ema'" in caplog.text


def test_keep_last_and_metrics_in_the_manifest(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, keep_last=2) as ckpt:
        for step in range(5):
            ckpt.save(step, {"w": torch.ones(3) * step}, metrics={"loss": torch.tensor(step / 2), "acc": np.float32(0.5)})
        assert ckpt.steps() == [3, 4] and ckpt.best_steps() == []
    d = CheckpointDirectory(tmp_path)
    assert sorted(d.scan()) == [3, 4]
    assert d.manifest(4)["metrics"] == {"loss": 2.0, "acc": 0.5}


def test_async_save_snapshots_then_commits_on_wait_and_close(tmp_path: Path) -> None:
    w = torch.zeros(1000)
    d = CheckpointDirectory(tmp_path)
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, {"w": w})
    w += 1  # after the snapshot: not in checkpoint 1
    ckpt.wait()
    assert d.committed_epochs() == [1]
    ckpt.save(2, {"w": w})
    ckpt.close()  # commits the save in flight
    assert d.committed_epochs() == [1, 2]
    got = {"w": torch.empty(1000)}
    with Checkpointer(tmp_path) as again:
        assert again.restore(got) == 2
    assert torch.equal(got["w"], torch.ones(1000))
    from epochal.storage.formats.base import get_db_type

    assert torch.equal(get_db_type("native").read(str(tmp_path / "local.1"))["w"], torch.zeros(1000))
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save(3, {"w": w})


def test_a_failed_save_raises_and_leaves_earlier_checkpoints(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)})
        with pytest.raises(UnsupportedBlobError):
            ckpt.save(2, {"w": torch.ones(2), "bad": object()})
        loader = DataLoader(TensorDataset(torch.arange(4)))
        with pytest.raises(UnsupportedBlobError, match="ResumableSampler"):
            ckpt.save(2, {"loader": loader})
        with pytest.raises(ValueError):
            ckpt.save(-1, {"w": torch.ones(2)})
        assert ckpt.steps() == [1]
    assert CheckpointDirectory(tmp_path).verify_epoch(1) == [] and sorted(CheckpointDirectory(tmp_path).scan()) == [1]


def test_one_writer_per_directory(tmp_path: Path) -> None:
    from epochal.errors import CheckpointLockedError

    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointLockedError, match=str(os.getpid())):
            Checkpointer(tmp_path)
        ckpt.save(0, {"x": 1})
    with Checkpointer(tmp_path) as again:  # released on close
        assert again.restore({"x": 0}) == 0


def test_url_directory_works_and_makes_no_local_folder(tmp_path: Path, monkeypatch: Any) -> None:
    """A URL directory (fsspec memory:// here; s3:// alike) is supported since the records
    moved behind a record store: steps saved there restore bit for bit, nothing is local."""
    pytest.importorskip("fsspec", reason="the s3 extra is not installed")
    import secrets

    monkeypatch.chdir(tmp_path)
    url = f"memory://ckpt-{secrets.token_hex(4)}/run"
    with Checkpointer(url, keep_last=2) as ckpt:
        for step in range(3):
            ckpt.save(step, {"w": np.arange(4) + step, "step": step})
    assert CheckpointDirectory(url).committed_epochs() == [1, 2]
    state: dict[str, Any] = {"w": np.zeros(4, dtype=np.int64), "step": -1}
    with Checkpointer(url) as again:
        assert again.restore(state) == 2
    assert state["w"].tolist() == [2, 3, 4, 5] and state["step"] == 2
    assert list(tmp_path.iterdir()) == []  # no local folder was made


def test_sigterm_sets_preempted_and_close_restores_the_handler(tmp_path: Path) -> None:
    def mine(signum: int, frame: Any) -> None:
        raise AssertionError("the Checkpointer's handler should be active")

    old = signal.signal(signal.SIGTERM, mine)
    try:
        with Checkpointer(tmp_path) as ckpt:
            assert not ckpt.preempted and not ckpt.due(3, every=2)
            os.kill(os.getpid(), signal.SIGTERM)
            assert ckpt.preempted and ckpt.due(3, every=2)
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)


def test_outside_the_main_thread_no_handler_is_installed(tmp_path: Path) -> None:
    import threading

    before = signal.getsignal(signal.SIGTERM)
    seen: list[Any] = []

    def worker() -> None:
        with Checkpointer(tmp_path) as ckpt:
            seen.append(signal.getsignal(signal.SIGTERM))
            ckpt.save(0, {"x": 1})
            seen.append(ckpt.preempted)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [before, False] and signal.getsignal(signal.SIGTERM) is before


def test_due_every_and_interval(tmp_path: Path, monkeypatch: Any) -> None:
    import epochal.checkpointer.core as cp

    now = [1000.0]
    monkeypatch.setattr(cp.time, "monotonic", lambda: now[0])
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.due(7) and ckpt.due(4, every=2) and not ckpt.due(5, every=2)
        assert not ckpt.due(5, interval="30m")
        now[0] += 1799
        assert not ckpt.due(5, interval="30m") and ckpt.due(5, every=3, interval=1799)
        now[0] += 1
        assert ckpt.due(5, interval="30m")
        ckpt.save(5, {"x": 1})  # the clock restarts at a save
        assert not ckpt.due(6, interval="30m")
    assert parse_interval("1h30m") == 5400 and parse_interval("90s") == 90 and parse_interval(2) == 2
    for bad in ("", "3 parsecs", "-5s", 0, "1h x"):
        with pytest.raises(ValueError):
            parse_interval(bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the data position

def test_resumable_sampler_positions_and_errors() -> None:
    s = ResumableSampler(range(10), seed=3)
    first = list(s)
    assert sorted(first) == list(range(10)) and (s.epoch, s.position) == (0, 10)
    second = list(s)  # a used-up epoch: the next iter() starts the next one, in a new order
    assert s.epoch == 1 and second != first and sorted(second) == list(range(10))
    s.set_epoch(1)  # names the current (used-up) epoch: nothing left of it
    assert list(s) == [] and list(s) == s.order(2) and s.epoch == 2
    assert list(ResumableSampler(range(5), shuffle=False)) == [0, 1, 2, 3, 4]
    t = ResumableSampler(range(10), seed=3)
    it = iter(t)
    head = [next(it) for _ in range(4)]
    del it  # abandoned: the position stays
    assert t.state_dict() == {"epoch": 0, "position": 4, "seed": 3, "shuffle": True, "size": 10}
    u = ResumableSampler(range(10), seed=99)
    u.load_state_dict(t.state_dict())
    assert head + list(u) == first
    u.set_epoch(1)
    assert u.position == 0
    with pytest.raises(ValueError, match="10 samples, the data set has 12"):
        ResumableSampler(range(12)).load_state_dict(t.state_dict())
    with pytest.raises(ValueError, match="shuffle"):
        ResumableSampler(range(10), shuffle=False).load_state_dict(t.state_dict())
    with pytest.raises(ValueError, match="position"):
        ResumableSampler(range(10)).load_state_dict({**t.state_dict(), "position": -1})


DATA = TensorDataset(torch.arange(23))
EPOCHS = 3


def plain_loader(recipe: bool) -> tuple[Any, dict[str, Any]]:
    sampler = ResumableSampler(DATA, seed=5)
    gen = torch.Generator() if recipe else None
    loader = DataLoader(DATA, batch_size=4, sampler=sampler, generator=gen)
    return loader, {"sampler": sampler, "rng": RNGState(), "log": [], "epoch": 0}


def stateful_loader(recipe: bool) -> tuple[Any, dict[str, Any]]:
    sdl = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
    from torchdata.stateful_dataloader.sampler import RandomSampler

    if recipe:  # a sampler with a generator of its own, and one for the loader's base seeds
        loader = sdl.StatefulDataLoader(DATA, batch_size=4, generator=torch.Generator(),
                                        sampler=RandomSampler(DATA, generator=torch.Generator().manual_seed(5)))
    else:  # one generator for both: a resumed iter() draws from the shuffle's generator
        loader = sdl.StatefulDataLoader(DATA, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
    return loader, {"loader": loader, "rng": RNGState(), "log": [], "epoch": 0}


def run_loop(loader: Any, state: dict[str, Any], ckpt: Any = None, stop_at: int | None = None) -> bool:
    """EPOCHS passes over the loader with dropout between batches (the global torch RNG);
    the log records each batch's indices and dropout mask. True when stopped at ``stop_at``."""
    drop = torch.nn.Dropout(0.5)
    while state["epoch"] < EPOCHS:
        if "sampler" in state:  # the recipe: the loop's epoch decides
            state["sampler"].set_epoch(state["epoch"])
        for (x,) in loader:
            state["log"].append((x.tolist(), drop(torch.ones(4)).tolist()))
            if len(state["log"]) == stop_at:
                ckpt.save(stop_at, state)
                return True
        state["epoch"] += 1
    return False


def resumed_log(tmp_path: Path, make: Any, recipe: bool, stop_at: int) -> list[Any]:
    with Checkpointer(tmp_path / f"{make.__name__}{recipe}{stop_at}") as ckpt:
        torch.manual_seed(0)
        assert run_loop(*make(recipe), ckpt, stop_at)
        torch.manual_seed(1)  # a new process, in effect
        loader, state = make(recipe)
        assert ckpt.restore(state) == stop_at
        assert not run_loop(loader, state)
    return state["log"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("make", [plain_loader, stateful_loader])
def test_loader_resumed_mid_epoch_is_exact_with_the_recipe(tmp_path: Path, make: Any) -> None:
    torch.manual_seed(0)
    loader, state = make(True)
    run_loop(loader, state)
    ref = state["log"]
    assert len(ref) == 6 * EPOCHS and sorted(i for b, _ in ref[:6] for i in b) == list(range(23))
    for stop_at in (1, 3, 6, 8, 12, 17):  # mid-epoch, at the end of an epoch, the last batch
        assert resumed_log(tmp_path, make, True, stop_at) == ref, stop_at


@pytest.mark.parametrize("make", [plain_loader, stateful_loader])
def test_without_the_recipe_a_mid_epoch_resume_drifts(tmp_path: Path, make: Any) -> None:
    """The pitfall the recipe avoids (so the test above can fail): iter() draws a seed."""
    torch.manual_seed(0)
    loader, state = make(False)
    run_loop(loader, state)
    assert resumed_log(tmp_path, make, False, 8) != state["log"]


def test_a_users_sampler_with_a_growing_permutation_restores(tmp_path: Path) -> None:
    """State whose tensors change size (a permutation drawn at the first epoch)."""

    class PermSampler:
        def __init__(self) -> None:
            self.perm = torch.empty(0, dtype=torch.int64)
            self.pos = 0

        def state_dict(self) -> dict[str, Any]:
            return {"perm": self.perm, "pos": self.pos}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.perm, self.pos = sd["perm"], sd["pos"]

    s = PermSampler()
    s.perm, s.pos = torch.randperm(48), 17
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, {"s": s})
        live = PermSampler()
        assert ckpt.restore({"s": live}) == 0
    assert torch.equal(live.perm, s.perm) and live.pos == 17
    assert epochal.Checkpointer is Checkpointer
