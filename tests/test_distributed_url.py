"""A DistributedCheckpointer on an s3:// URL (2 gloo ranks, CPU; the moto server on loopback):
every rank writes its db to the bucket, rank 0 commits once, a restore into another sharding
is bit-equal with unpickling made to raise, and the step is a whole, intact one."""

from __future__ import annotations

import secrets
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
pytest.importorskip("fsspec", reason="the s3 extra is not installed")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from _dist_workers import run_ranks  # noqa: E402
from _dist_workers_plans import url_saves  # noqa: E402

from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402

pytestmark = pytest.mark.slow  # spawns gloo ranks and a moto server


def test_ranks_save_to_an_s3_url_and_restore_resharded(s3: dict[str, Any]) -> None:
    url = f"s3://ckpts/dist-{secrets.token_hex(4)}/run"
    run_ranks(url_saves, 2, url, s3)
    d = CheckpointDirectory(url, storage_options=s3)
    assert d.committed_epochs() == [1, 2, 3]
    for step in (1, 3):
        assert sorted(d.read_manifest(step).nodes) == ["dcp", "rank0", "rank1"]
        assert not d.check_epoch(step, "full")


def test_one_process_restores_the_ranks_step_from_the_url(s3: dict[str, Any]) -> None:
    """No process group: ``epochal.Checkpointer(url, storage_options=...)`` on a URL whose
    newest step was written by ranks is a DistributedCheckpointer; it restores the full
    tensors into plain ones, bit-equal."""
    from _dist_workers import full_state
    from _torch_bits import bits

    import epochal

    url = f"s3://ckpts/dist-{secrets.token_hex(4)}/run"
    run_ranks(url_saves, 2, url, s3)
    want = full_state(3.0)
    into: dict[str, Any] = {k: torch.zeros_like(t) for k, t in want.items()}
    into.update(step=0, cfg={})
    with epochal.Checkpointer(url, storage_options=s3) as ck:
        assert type(ck).__name__ == "Checkpointer" and type(ck.distributed).__name__ == "DistributedCheckpointer"
        assert ck.restore(into) == 3
    assert all(bits(into[k]) == bits(t) for k, t in want.items())
    assert into["step"] == 5 and into["cfg"] == {"lr": 0.25, "names": ["a", "b"]}
