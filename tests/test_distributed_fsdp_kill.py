"""FSDP2 training under epochal's DistributedCheckpointer (2 gloo ranks, CPU), with a per-rank
torchdata StatefulDataLoader: SIGKILL inside a save (a rank stalled before or after writing
its db, at a random save step) and at a random moment, then resumed: the final state of each
rank (its parameter and optimizer shards, RNG, data loader, losses) is bit-identical to an
uninterrupted run's, and the step being saved at the kill was never committed."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
pytest.importorskip("torchdata", reason="torchdata (StatefulDataLoader) is not installed")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import _fresh  # noqa: E402
from _dist_workers import free_port  # noqa: E402

from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402

pytestmark = pytest.mark.slow  # spawns gloo ranks and kills them
TRAIN = str(Path(__file__).parent / "_dist_train.py")
STEPS = 14  # 5 batches of 4 per rank per epoch: saves (every 3) fall mid-epoch


def _launch(ckpt: Path, out: Path, stall: str = "") -> list[Any]:
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "EPOCHAL_QUIET": "1",
               "EPOCHAL_TEST_FSDP": "1", "EPOCHAL_TEST_STALL": stall, "PYTHONWARNINGS": "ignore"}
        procs.append(_fresh.start(TRAIN, [str(ckpt), str(out), str(STEPS)], env=env))
    return procs


def _finish(procs: list[Any]) -> None:
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out


def _kill(procs: list[Any], may_have_finished: bool = False) -> bool:
    """SIGKILL every rank; whether one was killed. Each must be killed, not finished, unless
    ``may_have_finished`` (a kill at a random moment after the last commit may land as a rank
    ends the run: exit status 0)."""
    for p in procs:
        p.send_signal(signal.SIGKILL)
    codes = []
    for p in procs:
        p.communicate(timeout=60)
        codes.append(p.returncode)
    assert all(c == -signal.SIGKILL or (may_have_finished and c == 0) for c in codes), codes
    return -signal.SIGKILL in codes


def _final(out: Path) -> list[dict[str, Any]]:
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]


def _read_until(p: Any, text: str) -> str:
    lines = []
    while True:
        line = p.stdout.readline()  # type: ignore[union-attr]
        assert line, "".join(lines)
        lines.append(line)
        if text in line:
            return line


def test_fsdp2_killed_inside_a_save_and_at_random_resumes_bit_identical(tmp_path: Path) -> None:
    base = tmp_path / "base"
    _finish(_launch(base / "ckpt", base / "out"))
    want = _final(base / "out")
    assert want[0]["0.weight"] != want[1]["0.weight"]  # each rank holds its own shard
    assert want[0]["rng"] != want[1]["rng"] and want[0]["sampler"] != want[1]["sampler"]

    rnd = random.Random(os.getpid())
    run = tmp_path / "run"
    stall_rank, stall_step = rnd.choice((0, 1)), rnd.choice((6, 9, 12))
    phase = rnd.choice(("before", "after"))
    procs = _launch(run / "ckpt", run / "out", stall=f"{stall_rank}:{stall_step}:{phase}")
    _read_until(procs[stall_rank], f"stalling {phase} writing step {stall_step}")
    time.sleep(rnd.uniform(0.0, 0.3))  # the other rank may be waiting in the save's collectives
    _kill(procs)
    d = CheckpointDirectory(str(run / "ckpt"))
    assert d.committed_epochs()[-1] == stall_step - 3, (d.committed_epochs(), stall_step, phase)
    if phase == "after":  # that rank's db is durable, yet the step has no manifest
        assert (run / "ckpt" / f"rank{stall_rank}.{stall_step}").exists()

    # the rerun resumes the step before, and is killed again at a random moment after a commit
    procs = _launch(run / "ckpt", run / "out")
    first = _read_until(procs[0], "resumed")
    assert f"resumed {stall_step - 3} " in first, first
    newest = d.committed_epochs()[-1]  # (keep_last=2: the count of steps stays the same)
    deadline = time.monotonic() + 60
    while (d.committed_epochs()[-1] == newest and any(p.poll() is None for p in procs)
           and time.monotonic() < deadline):
        time.sleep(0.01)
    time.sleep(rnd.uniform(0.0, 0.3))
    if not all(p.poll() is None for p in procs):
        _finish(procs)
    elif _kill(procs, may_have_finished=True):  # (both may have ended the run as it landed)
        last = d.committed_epochs()[-1]
        procs = _launch(run / "ckpt", run / "out")
        first = _read_until(procs[0], "resumed")
        assert f"resumed {last} " in first, first
        _finish(procs)
    assert _final(run / "out") == want
    assert d.committed_epochs()[-1] == STEPS and not d.check_epoch(STEPS, "full")
    assert sorted(d.read_manifest(STEPS).nodes) == ["dcp", "rank0", "rank1"]
