"""The Hugging Face Trainer door keeps the load promise: a resume into a model of another
shape (vocab 64 -> 67, 2 -> 3 layers, 2 -> 1 layer) is refused before any tensor is written,
naming the keys, with ``global_step`` untouched; each resume in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _fresh  # noqa: E402
import _hf_train as H  # noqa: E402

pytestmark = pytest.mark.system

RESUME = textwrap.dedent("""
    import json, os, sys, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, sys.argv[3])
    import torch
    import _hf_train as H
    from transformers import GPT2Config, GPT2LMHeadModel
    vocab, layers = (int(x) for x in sys.argv[2].split(","))
    torch.manual_seed(5)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=16, n_embd=32, n_layer=layers, n_head=2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    t = H.make_trainer(sys.argv[1], "epochal", 8, 4, model=model)
    error = None
    try:
        t.train(resume_from_checkpoint=True)
    except Exception as ex:
        error = f"{type(ex).__name__}: {ex}"
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    print(json.dumps({"error": error, "changed": changed, "global_step": t.state.global_step}))
""")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: Any) -> str:
    out = str(tmp_path_factory.mktemp("hf") / "run")
    H.make_trainer(out, "epochal", 4, 4).train()  # checkpoint-4 of a 2-layer, vocab-64 GPT-2
    return out


def resume(saved: str, shape: str) -> dict[str, Any]:
    import shutil
    import tempfile

    out = os.path.join(tempfile.mkdtemp(), "run")
    shutil.copytree(saved, out)  # (the resume writes its own checkpoints there)
    got = _fresh.run("-c:" + RESUME, [out, shape, HERE], env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("shape, words", [
    ("67,2", ["transformer.wte.weight: checkpoint shape (64, 32), live shape (67, 32)"]),
    ("64,3", ["keys missing from the checkpoint", "transformer.h.2."]),
    ("64,1", ["keys the live GPT2LMHeadModel lacks", "transformer.h.1."]),
])
def test_a_resume_into_another_shape_changes_nothing(saved: str, shape: str, words: list[str]) -> None:
    got = resume(saved, shape)
    assert got["error"] is not None and got["error"].startswith("BlobMismatchError"), got
    assert "nothing was restored" in got["error"] and "checkpoint-4" in got["error"]
    for w in words:
        assert w in got["error"], (w, got["error"])
    assert got["changed"] == [] and got["global_step"] == 0


def test_the_same_shape_still_resumes(saved: str) -> None:
    got = resume(saved, "64,2")
    assert got["error"] is None and got["global_step"] == 8 and got["changed"]


# ------------------------------------------------------------------ the tools on an HF output dir
def epochal_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "epochal", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def test_the_tools_understand_an_hf_output_dir(saved: str) -> None:
    ls = epochal_cli("ls", saved, "--json")
    assert ls.returncode == 0, ls.stderr
    assert [e["epoch"] for e in json.loads(ls.stdout)["epochs"]] == [4]
    ok = epochal_cli("verify", saved)
    assert ok.returncode == 0 and "checkpoint-4" in ok.stdout and "intact" in ok.stdout, ok.stdout + ok.stderr
    shown = epochal_cli("inspect", os.path.join(saved, "checkpoint-4"), "--json")
    assert shown.returncode == 0, shown.stderr
    assert {"optimizer", "scheduler", "rng", "files"} <= {b["name"] for b in json.loads(shown.stdout)["blobs"]}


def test_verify_checks_every_file_a_step_records(saved: str, tmp_path: Any) -> None:
    import shutil

    out = str(tmp_path / "run")
    shutil.copytree(saved, out)
    weights = os.path.join(out, "checkpoint-4", "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(100)
    for target in (os.path.join(out, "checkpoint-4"), out):
        got = epochal_cli("verify", target)
        assert got.returncode == 1, got.stdout + got.stderr
        assert "model.safetensors" in got.stdout and "100 bytes" in got.stdout, got.stdout
