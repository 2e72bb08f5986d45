"""export_safetensors: one state dict out of a checkpoint, read back by safetensors alone."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
st = pytest.importorskip("safetensors.torch", reason="the safetensors extra is not installed")

import epochal  # noqa: E402
from epochal.errors import CheckpointError, CheckpointNotFoundError, MissingBlobError  # noqa: E402
from epochal.storage.formats.base import get_db_type  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _torch_bits import bits  # noqa: E402


class TiedLM(torch.nn.Module):
    """Tied embeddings plus parameters and buffers of the dtypes that must survive."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(11, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.proj = torch.nn.Linear(6, 6).to(torch.bfloat16)
        self.register_buffer("fp16", torch.randn(5, generator=g).to(torch.float16))
        self.register_buffer("f8", torch.randn(7, generator=g).to(torch.float8_e4m3fn))
        self.register_buffer("f8b", torch.randn(2, 3, generator=g).to(torch.float8_e5m2))
        self.register_buffer("count", torch.tensor(2**40 + seed, dtype=torch.int64))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
            self.norm.weight[0] = float("nan")
            self.norm.bias[1] = -0.0


def test_module_round_trip_through_safetensors_alone(tmp_path: Path) -> None:
    model = TiedLM(0)
    with epochal.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, {"model": TiedLM(9), "step": 1})
        ckpt.save(2, {"model": model, "step": 2})  # the newest committed step is exported
    out = tmp_path / "model.safetensors"
    written = epochal.export_safetensors(tmp_path / "ckpt", "model", out)

    sd = model.state_dict()
    assert "head.weight" not in written and set(written) == set(sd) - {"head.weight"}
    loaded = st.load_file(str(out))
    assert set(loaded) == set(written)
    for key, t in loaded.items():
        assert t.dtype == sd[key].dtype and t.shape == sd[key].shape, key
        assert bits(t) == bits(sd[key]), key
    assert {loaded[k].dtype for k in ("proj.weight", "fp16", "f8", "f8b")} == {
        torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2}

    fresh = TiedLM(5)
    missing, unexpected = st.load_model(fresh, str(out), strict=True)
    assert not missing and not unexpected
    assert fresh.head.weight is fresh.emb.weight  # still tied
    for key, t in fresh.state_dict().items():
        assert bits(t) == bits(sd[key]), key

    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["head.weight"] == "emb.weight" and meta["blob"] == "model"


def test_dict_of_tensors_from_a_db_keeps_names_and_drops_aliases(tmp_path: Path) -> None:
    a = torch.randn(3, 4).to(torch.bfloat16)
    value = {"a": a, "alias_of_a": a, "b": torch.arange(6, dtype=torch.int32).reshape(2, 3),
             "c": torch.randn(4, dtype=torch.float64)}
    db = tmp_path / "node.3"
    get_db_type("native").write(str(db), {"weights": value, "other": 7})
    out = tmp_path / "w.safetensors"
    out.write_bytes(b"old")
    written = epochal.export_safetensors(db, "weights", out)
    loaded = st.load_file(str(out))
    assert sorted(written) == sorted(loaded) == ["a", "b", "c"]
    for key in written:
        assert loaded[key].dtype == value[key].dtype and bits(loaded[key]) == bits(value[key])


def test_from_a_safetensors_db(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    db = tmp_path / "node.0"
    get_db_type("safetensors").write(str(db), {"model": model, "n": 3})
    epochal.export_safetensors(db, "model", tmp_path / "m.safetensors")
    fresh = torch.nn.Linear(3, 2).to(torch.bfloat16)
    assert st.load_model(fresh, str(tmp_path / "m.safetensors"), strict=True) == (set(), [])
    assert bits(fresh.weight) == bits(model.weight) and bits(fresh.bias) == bits(model.bias)


def test_errors_name_the_blob_and_leave_out_alone(tmp_path: Path) -> None:
    db = tmp_path / "n.1"
    get_db_type("native").write(str(db), {"n": 3, "mixed": {"w": torch.ones(2), "step": 4}})
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"keep")
    with pytest.raises(CheckpointError, match="blob 'n'"):
        epochal.export_safetensors(db, "n", out)
    with pytest.raises(CheckpointError, match=r"\['step'\].*not a tensor"):
        epochal.export_safetensors(db, "mixed", out)
    with pytest.raises(MissingBlobError, match="nope"):
        epochal.export_safetensors(db, "nope", out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no committed"):
        epochal.export_safetensors(tmp_path / "empty", "model", out)
    with pytest.raises(MissingBlobError, match="'model'"):
        with epochal.Checkpointer(tmp_path / "c") as ckpt:
            ckpt.save(0, {"x": torch.ones(1)})
        epochal.export_safetensors(tmp_path / "c", "model", out)
    assert out.read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp." in p.name) == []
