"""The load promise, one matrix: every door x every mismatch, each load in a fresh process
(as a user resumes), every live tensor compared bit for bit after the error.

Before any live byte is written, every blob of the load is checked against its manifest
(digest, size) and against the live object it goes into (key set, shapes, dtypes, parameter
groups); then everything is written, or nothing is (docs/reliability.md, "One promise at
every door"). The doors here are the engine's own (the Checkpointer, the JobRunner's
``train()`` resume, ``load_blobs_from_checkpoints``); the recovery reload is in
tests/test_check_before_write.py, the ranks' and the framework doors in their own files
(docs/reliability.md lists them).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _fresh  # noqa: E402
import _promise  # noqa: E402

pytestmark = pytest.mark.system

#: case -> (error type, words the message must hold); None: the load succeeds
EXPECTED: dict[str, tuple[str, list[str]] | None] = {
    "fits": None,
    "deeper": ("BlobMismatchError", ["nothing was restored", "'model'", "keys missing from the checkpoint",
                                     "4.bias, 4.weight", "'opt'"]),
    "shallower": ("BlobMismatchError", ["'model'", "keys the live module lacks", "2.bias, 2.weight"]),
    "groups": ("BlobMismatchError", ["nothing was restored", "'opt'"]),
    "shape": ("BlobMismatchError", ["'t'", "shape (5,)", "shape (6,)"]),
    "dtype": ("BlobMismatchError", ["'t'", "torch.float32", "torch.float64"]),
    "sd_keys": ("BlobMismatchError", ["'sd'", "keys missing from the checkpoint", "4.weight, 4.bias"]),
    "older_db": ("CheckpointCorruptError", ["digest", "the manifest says", "3"]),
    "flipped": ("CheckpointCorruptError", ["'model'", "checksum"]),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: Any) -> str:
    root = str(tmp_path_factory.mktemp("promise"))
    done = _fresh.run(os.path.join(HERE, "_promise.py"), ["save", root], timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return root


def run_load(saved: str, tmp_path: Any, door: str, case: str) -> dict[str, Any]:
    root = str(tmp_path / "copy")
    shutil.copytree(saved, root)
    out = _fresh.run(os.path.join(HERE, "_promise.py"), ["load", door, case, root], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", list(EXPECTED))
@pytest.mark.parametrize("door", _promise.DOORS)
def test_every_door_checks_everything_before_it_writes(saved: str, tmp_path: Any, door: str, case: str) -> None:
    got = run_load(saved, tmp_path, door, case)
    want = EXPECTED[case]
    if want is None:
        assert got["error"] is None, got["message"]
        assert got["restored"] and not got["untouched"]  # the checkpoint's values, in place
        return
    kind, words = want
    assert got["error"] == kind, got
    assert "MissingBlobError" not in got["bases"]
    for w in words:
        assert w in got["message"], (w, got["message"])
    assert got["untouched"], f"{door} / {case}: a live tensor changed before the error: {got['message']}"


# ------------------------------------------------------------------ strict=False, in process
def test_strict_false_restores_the_keys_both_have_and_reports_the_rest(tmp_path: Any) -> None:
    from epochal import Checkpointer

    small, big = _promise.mlp(2, 0), _promise.mlp(3, 1)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"sd": small.state_dict(), "model": _promise.mlp(2, 2)})
    live = {"sd": big.state_dict(), "model": _promise.mlp(3, 3)}
    extra = {k: v.clone() for k, v in big.state_dict().items() if k.startswith("4.")}
    extra_model = {k: v.clone() for k, v in live["model"].state_dict().items() if k.startswith("4.")}
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(live, strict=False) == 1
        report = ck.last_restore
    assert report is not None and report.step == 1
    assert sorted(report.missing_keys["sd"]) == ["4.bias", "4.weight"]
    assert sorted(report.missing_keys["model"]) == ["4.bias", "4.weight"]
    assert report.unexpected_keys == {}
    for k in ("0.weight", "0.bias", "2.weight", "2.bias"):  # the saved values, in the live tensors
        assert torch.equal(big.state_dict()[k], small.state_dict()[k])
        assert torch.equal(live["sd"][k], small.state_dict()[k])
    assert set(live["sd"]) == set(big.state_dict())  # the live keys stay, with their values
    for k, v in extra.items():
        assert torch.equal(big.state_dict()[k], v) and torch.equal(live["sd"][k], v)
    for k, v in extra_model.items():
        assert torch.equal(live["model"].state_dict()[k], v)


def test_strict_false_ignores_unexpected_keys(tmp_path: Any) -> None:
    from epochal import Checkpointer

    big, small = _promise.mlp(3, 0), _promise.mlp(2, 1)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"sd": big.state_dict()})
    live = {"sd": small.state_dict()}
    with Checkpointer(tmp_path) as ck:
        ck.restore(live, strict=False)
        assert ck.last_restore is not None
        assert sorted(ck.last_restore.unexpected_keys["sd"]) == ["4.bias", "4.weight"]
    assert set(live["sd"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert torch.equal(small.state_dict()["2.weight"], big.state_dict()["2.weight"])


def test_the_state_dict_idiom_names_the_model_keys_not_only_the_optimizer(tmp_path: Any) -> None:
    from epochal import BlobMismatchError, Checkpointer

    big = _promise.mlp(3, 0)
    opt = _promise.stepped(big)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"model": big.state_dict(), "opt": opt.state_dict()})
    small = _promise.mlp(2, 1)
    sopt = _promise.stepped(small)
    live = {"model": small.state_dict(), "opt": sopt.state_dict()}
    before = _promise.tensors({"model": small, "opt": sopt, "t": torch.zeros(1), "sd": {}})
    with Checkpointer(tmp_path) as ck, pytest.raises(BlobMismatchError) as info:
        ck.restore(live)
    text = str(info.value)
    assert "blob 'model'" in text and "keys the live dict lacks: 4.weight, 4.bias" in text
    assert _promise.same(_promise.tensors({"model": small, "opt": sopt, "t": torch.zeros(1), "sd": {}}), before)
