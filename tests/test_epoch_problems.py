"""Epoch problems typed (EpochProblem beside DbProblem) and verify levels with one definition
(VerifyLevel), the strings of the public API unchanged."""

from __future__ import annotations

import os
import typing

import numpy as np
import pytest

from epochal import CheckpointDirectory, Checkpointer, DirectoryMetadataHandler
from epochal.checkpoint.location.view import VERIFY_LEVELS, EpochProblem, VerifyLevel


def _saved(tmp_path) -> CheckpointDirectory:
    with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": np.full(4096, float(step), dtype=np.float32)})
    return CheckpointDirectory(tmp_path)


def _flip(path: str) -> None:
    raw = bytearray(open(path, "rb").read())
    at = raw.find(np.full(4096, 1.0, dtype=np.float32).tobytes()[:64])
    assert at >= 0
    raw[at + 100] ^= 0xFF
    with open(path, "wb") as f:
        f.write(raw)


def test_problems_are_typed_and_their_lines_are_the_old_strings(tmp_path):
    d = _saved(tmp_path)
    db = os.path.join(str(tmp_path), "local.1")
    _flip(db)
    [p] = d.epoch_problems(1, "full")
    assert isinstance(p, EpochProblem)
    assert (p.epoch, p.path, p.node, p.blob) == (1, db, "local", "w")
    assert str(p) == p.text and db in p.text and "blob 'w'" in p.text
    assert d.verify_epoch(1) == d.check_epoch(1, "full") == [p.text]
    assert d.epoch_problems(1, "quick") == [] and d.epoch_problems(2, "full") == []
    os.remove(os.path.join(str(tmp_path), "local.2"))
    assert d.epoch_problems(2, "none") == [EpochProblem(2, os.path.join(str(tmp_path), "local.2"),
                                                        f"{tmp_path}/local.2: missing (listed in the manifest)",
                                                        "local")]
    [gone] = d.epoch_problems(7)
    assert gone.epoch == 7 and gone.node is None and "manifest.7.json" in gone.text


def test_verify_levels_have_one_definition_and_take_the_strings():
    assert VERIFY_LEVELS == typing.get_args(VerifyLevel) == ("full", "quick", "none")
    for level in VERIFY_LEVELS:
        assert DirectoryMetadataHandler(verify=level).verify == level
    with pytest.raises(ValueError, match=r"verify must be one of \('full', 'quick', 'none'\), got 'fast'"):
        DirectoryMetadataHandler(verify="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="verify level must be one of"):
        CheckpointDirectory("/nonexistent").epoch_problems(1, "fast")  # type: ignore[arg-type]
