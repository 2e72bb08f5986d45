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


def test_a_step_one_process_wrote_resumes_on_two_ranks_bit_identical(tmp_path: Path) -> None:
    import subprocess
    import sys

    from _dist_agreement import resume_on_ranks

    path, out = str(tmp_path / "ckpt"), str(tmp_path)
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import _dist_agreement as a; a.save_one_process({path!r}, {out!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    run_ranks(resume_on_ranks, 2, path, out)
    saved = json.load(open(os.path.join(out, "saved.json")))
    for rank in range(2):
        got = json.load(open(os.path.join(out, f"resumed{rank}.json")))
        assert got["step"] == 4 and got["plain"] == 4 and got["same_wrapper"], got
        assert got["tensors"] == saved, rank  # model and optimizer, bit for bit, on each rank


def test_fsdp2_at_world_one_saves_and_reshards_to_and_from_it(tmp_path: Path) -> None:
    from _dist_workers import fsdp_restore, fsdp_save

    one, full1 = str(tmp_path / "one"), str(tmp_path / "one.json")
    run_ranks(fsdp_save, 1, one, full1)  # DTensor parameters in a world of one rank
    assert CheckpointDirectory(one).committed_epochs() == [4]
    assert "dcp" in CheckpointDirectory(one).read_manifest(4).nodes
    run_ranks(fsdp_restore, 2, one, full1, 4, "fsdp")  # 1 -> 2
    run_ranks(fsdp_restore, 1, one, full1, 4, "fsdp")  # 1 -> 1
    two, full2 = str(tmp_path / "two"), str(tmp_path / "two.json")
    run_ranks(fsdp_save, 2, two, full2)
    run_ranks(fsdp_restore, 1, two, full2, 4, "fsdp")  # 2 -> 1, still sharded
