"""The small collectives of a DistributedCheckpointer's ranks (epochal.integrations.ranks)
return as soon as gloo's worker has let their tensor go, and not before: every ``due()``,
``preempted`` and save of a training loop makes one, so a collective that always waited out
its one-second bound cost a DDP loop two seconds a step. Counted in sleeps, not timed."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from _dist_workers import run_ranks  # noqa: E402

from epochal.integrations import ranks  # noqa: E402

pytestmark = pytest.mark.unit


def _sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    seen: list[float] = []
    real = time.sleep

    def sleep(s: float) -> None:
        seen.append(s)
        real(s)

    monkeypatch.setattr(ranks.time, "sleep", sleep)
    return seen


def test_a_tensor_no_one_else_holds_is_released_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _sleeps(monkeypatch)
    t = torch.zeros(3, dtype=torch.int64)
    base = sys.getrefcount(t)  # as the collectives measure it, before the collective
    ranks._released(t, base)
    assert seen == []


def test_a_tensor_still_held_is_waited_for_until_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _sleeps(monkeypatch)
    t = torch.zeros(3, dtype=torch.int64)
    base = sys.getrefcount(t)
    held: list[Any] = [t]  # gloo's worker, still holding the tensor after the call returned

    def let_go() -> None:
        pause = threading.Event()  # (not time.sleep: that one is counted)
        while len(seen) < 5:
            pause.wait(0.001)
        held.clear()

    worker = threading.Thread(target=let_go)
    worker.start()
    ranks._released(t, base)
    worker.join()
    assert held == [] and len(seen) >= 5  # it waited while held, and returned once let go
    assert sys.getrefcount(t) == base


def _collectives(rank: int, world: int, out: str) -> None:
    import json

    slept: list[float] = []
    real_sleep = time.sleep
    ranks.time.sleep = lambda s: (slept.append(s), real_sleep(s))[1]  # type: ignore[assignment]
    group = ranks.RankGroup(None, "test")
    got = [group.all_max([rank, 10 - rank]) for _ in range(20)]
    b = [group.broadcast(7 + rank) for _ in range(5)]
    ranks.time.sleep = real_sleep  # type: ignore[assignment]
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"got": got, "b": b, "slept": len(slept)}, f)


@pytest.mark.slow
def test_twenty_five_collectives_of_two_ranks_agree_without_waiting_out_the_bound(tmp_path: Any) -> None:
    import json

    run_ranks(_collectives, 2, str(tmp_path / "out"))
    for rank in (0, 1):
        r = json.loads((tmp_path / f"out.{rank}").read_text())
        assert r["got"] == [[1, 10]] * 20 and r["b"] == [7] * 5
        # each wait is 0.2 ms sleeps for at most a second (5,000 a collective): a collective
        # that waited out its bound would make 125,000; gloo lets go within a few
        assert r["slept"] < 25 * 500, r["slept"]
