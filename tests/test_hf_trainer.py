"""epochal.integrations.transformers: the Hugging Face Trainer with epochal checkpoints.

A tiny GPT-2 built from a config (tests/_hf_train.py, no download), dropout on, 14 steps over
1.4 epochs of a 10-batch data set, saved every 4 steps. Every resumed run is compared bit for
bit (a digest of every parameter) with transformers' own Trainer doing the same run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(__file__))
import _fresh  # noqa: E402
import _hf_train as H  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from epochal.errors import CheckpointCorruptError, CheckpointError  # noqa: E402
from epochal.integrations import hf_folder  # noqa: E402
from epochal.storage.formats.base import get_db_type  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_hf_train.py")
MAX, EVERY = 14, 4


class _Stop(Exception):
    pass


class StopAt(TrainerCallback):
    """Leave train() right after the checkpoint of step k is saved (a stopped job)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def on_save(self, args, state, control, **kw):
        if state.global_step == self.k:
            raise _Stop


def _stopped_and_resumed(out: str, kind: str, k: int) -> tuple[str, object]:
    t = H.make_trainer(out, kind, MAX, EVERY, callbacks=[StopAt(k)])
    with pytest.raises(_Stop):
        t.train()
    r = H.make_trainer(out, kind, MAX, EVERY)
    r.train(resume_from_checkpoint=True)
    return H.params_digest(r.model), r


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """transformers' own Trainer, uninterrupted: the digest every run must end with."""
    t = H.make_trainer(str(tmp_path_factory.mktemp("hf") / "full"), "hf", MAX, EVERY)
    t.train()
    return H.params_digest(t.model)


@pytest.fixture(scope="module")
def run12(tmp_path_factory) -> str:
    """An epochal run stopped after the save of step 12 (checkpoints 4, 8, 12), copied by the
    tests that damage it."""
    out = str(tmp_path_factory.mktemp("ep") / "run12")
    with pytest.raises(_Stop):
        H.make_trainer(out, "epochal", MAX, EVERY, callbacks=[StopAt(12)]).train()
    return out


def _copy(src: str, dst: str) -> str:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("k", [8, 12])  # mid-epoch, and in the second epoch
def test_stop_and_resume_is_bit_identical_to_transformers_own(tmp_path, reference, k):
    hf_digest, _ = _stopped_and_resumed(str(tmp_path / "hf"), "hf", k)
    ours, _ = _stopped_and_resumed(str(tmp_path / "ep"), "epochal", k)
    assert hf_digest == reference  # transformers' own resume is exact here...
    assert ours == reference       # ...and so is ours
    folder = tmp_path / "ep" / f"checkpoint-{k}"
    names = set(os.listdir(folder))
    assert f"rank0.{k}" in names and "model.safetensors" in names and "trainer_state.json" in names
    assert not {n for n in names if n.endswith((".pt", ".pth"))}  # no pickled state
    blobs = {b.name for b in get_db_type("native").describe(str(folder / f"rank0.{k}"))}
    assert blobs == {"optimizer", "scheduler", "rng", "files"}


def test_weights_readable_by_from_pretrained(tmp_path):
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    out = str(tmp_path / "ep")
    H.make_trainer(out, "epochal", 8, EVERY).train()
    H.make_trainer(str(tmp_path / "hf"), "hf", 8, EVERY).train()
    m = GPT2LMHeadModel.from_pretrained(os.path.join(out, "checkpoint-8"))
    theirs = load_file(str(tmp_path / "hf" / "checkpoint-8" / "model.safetensors"))
    assert H.params_digest(m) == H.params_digest(GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf" / "checkpoint-8")))
    mine = load_file(os.path.join(out, "checkpoint-8", "model.safetensors"))
    assert mine.keys() == theirs.keys()
    assert all(mine[n].view(-1).view(torch.uint8).equal(theirs[n].view(-1).view(torch.uint8)) for n in mine)


@pytest.mark.parametrize("victim", ["model.safetensors", "rank0.12", "trainer_state.json"])
def test_damaged_newest_is_skipped_with_a_warning(tmp_path, run12, reference, caplog, victim):
    out = _copy(run12, str(tmp_path / "run"))
    path = os.path.join(out, "checkpoint-12", victim)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # flip one byte in the second half (data, not only headers)
        f.seek(size * 3 // 4)
        b = f.read(1)
        f.seek(size * 3 // 4)
        f.write(bytes([b[0] ^ 0x20]))
    found = hf_folder.find_resume_checkpoint(out)
    assert found is not None and found.folder == os.path.join(out, "checkpoint-8")
    with pytest.raises(CheckpointCorruptError, match="checkpoint-12"):
        hf_folder.verify_checkpoint(os.path.join(out, "checkpoint-12"))
    # a damaged folder named explicitly is refused, naming the file
    with pytest.raises(CheckpointCorruptError, match=victim.replace(".", r"\.")):
        H.make_trainer(str(tmp_path / "x"), "epochal", MAX, EVERY).train(resume_from_checkpoint=os.path.dirname(path))
    r = H.make_trainer(out, "epochal", MAX, EVERY)
    with caplog.at_level(logging.WARNING, logger="epochal"):
        r.train(resume_from_checkpoint=True)
    assert any("checkpoint-12" in m and victim in m for m in caplog.messages), caplog.messages
    assert H.params_digest(r.model) == reference  # resumed from step 8, exact
    hf_folder.verify_checkpoint(os.path.dirname(path))  # step 12 saved again, intact


def _verify(folder: str) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "epochal", "verify", "--json", folder], capture_output=True, text=True)
    return p.returncode, json.loads(p.stdout)


def test_epochal_verify_reads_what_was_written(run12, tmp_path):
    for k in (4, 8, 12):
        rc, result = _verify(os.path.join(run12, f"checkpoint-{k}"))
        assert rc == 0 and result["ok"], result
        assert [os.path.basename(f["path"]) for f in result["files"]] == [f"rank0.{k}"]
    out = _copy(run12, str(tmp_path / "run"))
    db = os.path.join(out, "checkpoint-8", "rank0.8")
    with open(db, "r+b") as f:
        f.seek(os.path.getsize(db) // 2)
        b = f.read(1)
        f.seek(os.path.getsize(db) // 2)
        f.write(bytes([b[0] ^ 1]))
    rc, result = _verify(os.path.dirname(db))
    assert rc == 1 and not result["ok"] and result["files"][0]["problems"], result


def test_save_total_limit_keeps_exactly_n(tmp_path):
    out = str(tmp_path / "ep")
    H.make_trainer(out, "epochal", 20, 2, save_total_limit=3).train()
    assert sorted(os.listdir(out)) == ["checkpoint-16", "checkpoint-18", "checkpoint-20"]


def test_load_best_model_at_end_as_transformers_does(tmp_path):
    runs = {}
    for kind in ("hf", "epochal"):
        t = H.make_trainer(str(tmp_path / kind), kind, 12, 2, eval_strategy="steps", eval_steps=2,
                           load_best_model_at_end=True, metric_for_best_model="loss",
                           save_total_limit=2, eval_dataset=H.TokenSet(8, seed=5))
        t.train()
        runs[kind] = (os.path.basename(t.state.best_model_checkpoint), H.params_digest(t.model),
                      sorted(n for n in os.listdir(tmp_path / kind) if n.startswith("checkpoint-")))
    assert runs["epochal"] == runs["hf"]
    assert runs["hf"][0] != "checkpoint-12"  # the best is not the last: the load mattered


def test_save_only_model(tmp_path):
    out = str(tmp_path / "ep")
    H.make_trainer(out, "epochal", 4, EVERY, save_only_model=True).train()
    folder = os.path.join(out, "checkpoint-4")
    blobs = {b.name for b in get_db_type("native").describe(os.path.join(folder, "rank0.4"))}
    assert blobs == {"files"}
    assert {"model.safetensors", "config.json", "trainer_state.json"} <= set(os.listdir(folder))
    hf_folder.verify_checkpoint(folder)


def test_transformers_own_checkpoints_are_not_loaded(tmp_path, caplog):
    out = str(tmp_path / "hf")
    H.make_trainer(out, "hf", 4, EVERY).train()
    with caplog.at_level(logging.WARNING, logger="epochal"), pytest.raises(ValueError, match="No valid checkpoint"):
        H.make_trainer(out, "epochal", 8, EVERY).train(resume_from_checkpoint=True)
    assert any("checkpoint-4" in m and "not a checkpoint written by epochal" in m for m in caplog.messages)
    with pytest.raises(CheckpointError, match="not a checkpoint written by epochal"):
        H.make_trainer(out, "epochal", 8, EVERY).train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))


def _script(out: str, *args: str, env: dict | None = None) -> _fresh.Fresh:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), HERE])))
    e.update(env or {})
    return _fresh.start(SCRIPT, [out, "epochal", str(MAX), str(EVERY), *args], env=e)


def _done(p: subprocess.Popen) -> str:
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-3000:]
    return [line.split()[1] for line in out.splitlines() if line.startswith("DONE ")][0]


@pytest.mark.slow
def test_sigkill_inside_a_save_then_resume_without_pickle(tmp_path, reference):
    out = str(tmp_path / "ep")
    p = _script(out, env={"HF_TEST_SLEEP_IN_SAVE": "8"})
    assert p.stdout is not None
    for line in p.stdout:  # wait until the save of step 8 is half written
        if line.startswith("SAVING 8"):
            break
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    names = set(os.listdir(out))
    assert "checkpoint-8" not in names and "checkpoint-4" in names
    temp = os.path.join(out, ".epochal-tmp-checkpoint-8")
    assert "model.safetensors" in os.listdir(temp)  # the kill was mid-save
    # transformers' own resume would take any checkpoint-N folder; the half one has none
    digest = _done(_script(out, "resume", env={"HF_TEST_NO_PICKLE": "1"}))
    assert digest == reference
    assert not os.path.exists(temp)
    with open(os.path.join(out, f"checkpoint-{MAX}", "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == MAX


@pytest.mark.slow
def test_sigkill_at_a_random_moment_then_resume(tmp_path, reference):
    import random
    import time

    out = str(tmp_path / "ep")
    rnd = random.Random(int(os.environ.get("HF_TEST_SEED", "0")) or None)
    at = rnd.randint(EVERY + 1, MAX - 1)  # after checkpoint 4 is committed: steps, the saves of 8, 12
    p = _script(out, env={"HF_TEST_SLOW_STEPS": "1"})
    assert p.stdout is not None
    for line in p.stdout:  # each step prints STEP n, then sleeps 0.1 s; the save of n follows
        if line.strip() == f"STEP {at}":
            break
    time.sleep(rnd.uniform(0.0, 0.15))
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert any(n.startswith("checkpoint-") for n in os.listdir(out))
    assert _done(_script(out, "resume")) == reference


@pytest.mark.slow
def test_bench_hf_runs(tmp_path):
    root = os.path.dirname(HERE)
    p = subprocess.run([sys.executable, os.path.join(root, "bench", "bench_hf.py"), "--rounds", "1", "--embd", "32",
                        "--layers", "1", "--vocab", "64", "--dir", str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "save    epochal" in p.stdout and "resume  epochal" in p.stdout
    assert not os.path.exists(tmp_path / "b")


def test_private_surface_named_in_one_place():
    """Every private method of transformers.Trainer the module overrides or calls is in
    OVERRIDDEN or CALLED (the one place a new transformers release is checked against)."""
    import inspect
    import re

    import transformers

    from epochal.integrations import transformers as T

    mixin = set(T.EpochalTrainerMixin.__dict__)
    base = {n for n in dir(transformers.Trainer) if n.startswith("_") and not n.startswith("__")}
    assert set(T.OVERRIDDEN) == mixin & base
    called = set(re.findall(r"\bt\.(_[a-z]\w*)\(", inspect.getsource(T))) & base
    assert called <= set(T.CALLED) | set(T.OVERRIDDEN)
    assert all(callable(getattr(transformers.Trainer, n)) for n in T.OVERRIDDEN + T.CALLED)


def test_transformers_own_resume_fails_on_a_half_written_folder(tmp_path):
    """Why the commit by rename matters: transformers' own Trainer picks a checkpoint-N that a
    kill left without its last file (trainer_state.json) and fails on it."""
    import shutil

    out = str(tmp_path / "hf")
    H.make_trainer(out, "hf", 4, EVERY).train()
    shutil.copytree(os.path.join(out, "checkpoint-4"), os.path.join(out, "checkpoint-8"))
    os.unlink(os.path.join(out, "checkpoint-8", "trainer_state.json"))
    with pytest.raises(FileNotFoundError, match="checkpoint-8"):
        H.make_trainer(out, "hf", 12, EVERY).train(resume_from_checkpoint=True)
