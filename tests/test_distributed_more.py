"""epochal.Checkpointer under torch.distributed with 4 gloo ranks on CPU: FSDP2 state saved by
2 ranks restored into 4 and saved by 4 restored into 2, bit-equal to the gathered full state;
DTensors on a 2-D (2, 2) mesh (Shard/Replicate on each mesh dim) restored into the same mesh
with other placements, into a 1-D mesh of 4, and into (1, 2) and (2, 1) meshes of 2 ranks;
``epochal export --blob model`` of the 4-rank step: the gathered model, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from _dist_workers import fsdp_save, run_ranks  # noqa: E402
from _dist_workers_more import four_ranks, two_ranks  # noqa: E402
from _torch_bits import bits  # noqa: E402

from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402

pytestmark = pytest.mark.slow  # spawns 2 and 4 gloo ranks


def test_fsdp2_two_to_four_to_two_and_a_2d_mesh_resharded(tmp_path: Path) -> None:
    fsdp, meshes = tmp_path / "fsdp", tmp_path / "mesh"
    full2, full4 = tmp_path / "full2.json", tmp_path / "full4.json"
    run_ranks(fsdp_save, 2, str(fsdp), str(full2))  # step 4, by 2 ranks
    run_ranks(four_ranks, 4, str(fsdp), str(full2), str(full4), str(meshes))  # 2 -> 4; step 6 by 4
    d = CheckpointDirectory(str(fsdp))
    assert sorted(d.read_manifest(4).nodes) == ["dcp", "rank0", "rank1"]
    assert sorted(d.read_manifest(6).nodes) == ["dcp", "rank0", "rank1", "rank2", "rank3"]
    assert json.loads(full4.read_text()) != json.loads(full2.read_text())  # it trained on
    m = CheckpointDirectory(str(meshes))
    assert m.committed_epochs() == [1] and "dcp" in m.read_manifest(1).nodes
    run_ranks(two_ranks, 2, str(fsdp), str(full4), str(meshes))  # 4 -> 2; (2, 2) -> (1, 2), (2, 1)
    assert not d.check_epoch(6, "full") and not m.check_epoch(1, "full")

    # epochal export --blob of a step written by 4 ranks: the model gathered whole
    out = tmp_path / "model.safetensors"
    cli = [sys.executable, "-m", "epochal", "export", str(fsdp), str(out), "--to", "safetensors"]
    r = subprocess.run([*cli, "--blob", "model"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    from safetensors.torch import load_file

    want = {k: v for k, v in json.loads(full4.read_text()).items() if k.startswith("model.")}
    assert {f"model.{k}": bits(v).hex() for k, v in load_file(str(out)).items()} == want
    r = subprocess.run([*cli, "--blob", "nope"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "step 6 holds no tensor of 'nope'" in r.stderr + r.stdout, r
