"""What the ranks of a collective save agree on before anything is written: the step. Ranks
passing different steps to ``save`` get an error naming both steps, on every rank, and no
file is left behind (2 gloo ranks on CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from _dist_agreement import disagreeing_steps  # noqa: E402
from _dist_workers import run_ranks  # noqa: E402

from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402

pytestmark = pytest.mark.system


def test_ranks_saving_different_steps_fail_on_every_rank_naming_both(tmp_path: Path) -> None:
    path, out = str(tmp_path / "ckpt"), str(tmp_path)
    run_ranks(disagreeing_steps, 2, path, out)
    seen = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    for rank, lines in enumerate(seen):
        assert lines[2] == "SAVED 6", lines
        for a, b in ((2, 3), (4, 5)):
            line = lines[(a - 2) // 2]
            assert line.startswith("CheckpointError") and "different steps" in line, (rank, line)
            assert f"step {a}" in line and f"step {b}" in line, (rank, line)
    assert CheckpointDirectory(path).committed_epochs() == [6]
    left = sorted(n for n in os.listdir(path) if not n.startswith("."))
    assert left == ["dcp.6", "rank0.6", "rank1.6"], left  # nothing of steps 2-5
