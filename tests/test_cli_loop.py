"""The CLI on Checkpointer directories: `epochal ls` marks the best checkpoints, and
`epochal export --to safetensors --blob` writes one state dict that safetensors alone reads."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("click")

from epochal import Checkpointer  # noqa: E402
from epochal.cli.main import run  # noqa: E402


def make(d, losses):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    with Checkpointer(str(d), keep_best=2, metric="val_loss") as ckpt:
        for step, loss in enumerate(losses, start=1):
            with torch.no_grad():
                model[0].weight.add_(step)
            ckpt.save(step, {"model": model}, metrics={"val_loss": loss})
    return model


def test_ls_marks_the_best(tmp_path, capsys):
    make(tmp_path, [0.9, 0.3, 0.7, 0.5])
    assert run(["ls", str(tmp_path), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    best = {e["epoch"]: e["best"] for e in listing["epochs"]}
    assert best[2] == 1 and best[4] == 2 and best.get(3) is None
    assert run(["ls", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "best (min val_loss)" in text and "#1 0.3" in text and "#2 0.5" in text


def test_export_blob_to_safetensors_is_read_by_safetensors_alone(tmp_path, capsys):
    from safetensors.torch import load_file, load_model

    model = make(tmp_path / "ck", [0.5, 0.4])
    out = tmp_path / "model.safetensors"
    assert run(["export", str(tmp_path / "ck"), "--to", "safetensors", "--blob", "model", str(out)]) == 0
    assert "wrote 4 tensor(s) of blob 'model'" in capsys.readouterr().out
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    load_model(fresh, str(out))  # strict
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert sorted(load_file(str(out))) == sorted(model.state_dict())
    assert run(["export", str(tmp_path / "ck"), "--to", "npz", "--blob", "model", str(out)]) == 2
    assert run(["export", str(tmp_path / "ck"), "--to", "npz", str(tmp_path / "x.npz")]) == 1
