"""Saves that reuse the DCP plans of the last save while the state's structure holds (2 gloo
ranks, FSDP2, CPU): counted reuses and full plannings, a structure change on one rank making
every rank plan again, no collective on the training thread in an async save, and every step
restoring bit-equal."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from _dist_workers import run_ranks  # noqa: E402
from _dist_workers_plans import async_write_fails_on_one_rank, plans_kept  # noqa: E402

from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.integrations.dcp.plan_cache import SavePlanCache  # noqa: E402
from epochal.integrations.distributed import DistributedCheckpointer  # noqa: E402

pytestmark = pytest.mark.slow  # spawns gloo ranks


@pytest.mark.parametrize("async_save", [False, True])
def test_unchanged_structure_reuses_plans_and_restores_bit_equal(tmp_path: Path, async_save: bool) -> None:
    run_ranks(plans_kept, 2, str(tmp_path / "ckpt"), async_save)
    d = CheckpointDirectory(str(tmp_path / "ckpt"))
    assert d.committed_epochs() == [1, 2, 3, 4, 5]
    for step in (2, 5):  # a step saved with kept plans is a whole, intact step
        assert sorted(d.read_manifest(step).nodes) == ["dcp", "rank0", "rank1"]
        assert not d.check_epoch(step, "full")


def test_one_process_reuses_plans_and_replans_on_a_new_shape(tmp_path: Path) -> None:
    """No process group: a tensor of a new shape is a new structure (planned in full); the
    same shape again reuses the plans; each step holds its own values."""
    states = [torch.full((3,), 1.0), torch.full((3,), 2.0), torch.full((4,), 3.0), torch.full((4,), 4.0)]
    with DistributedCheckpointer(tmp_path) as ck:
        assert isinstance(ck._plans, SavePlanCache)
        for step, t in enumerate(states):
            ck.save(step, {"t": t, "n": step})
        assert (ck._plans.hits, ck._plans.misses) == (2, 2)
        for step, t in enumerate(states):
            into = {"t": torch.zeros_like(t), "n": -1}
            ck._load(step, into)
            assert torch.equal(into["t"], t) and into["n"] == step


def test_a_failed_background_write_raises_on_every_rank_at_wait(tmp_path: Path) -> None:
    run_ranks(async_write_fails_on_one_rank, 2, str(tmp_path / "ckpt"))
    d = CheckpointDirectory(str(tmp_path / "ckpt"))
    assert d.committed_epochs() == [1, 3]
    assert not (tmp_path / "ckpt" / "rank1.2").exists()
