"""Records around the dbs, crafted on purpose: symlinks, FIFOs and forged torch names never
make epochal write outside the directory, hang, or import code."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from epochal import (
    CheckpointManager,
    DirectoryMetadataHandler,
    Job,
    JobRunner,
    LocalSession,
    Node,
    Task,
    Workspace,
    epoch_limiter,
)
from epochal.checkpoint.location.view import CheckpointDirectory


class Init:
    def __call__(self, ws):
        ws["w"] = np.zeros(3)


class Step:
    def __call__(self, ws):
        ws["w"] = ws["w"] + 1


def run(d, epochs=2):
    with Node("n"):
        with Job() as job:
            with job.init_group:
                Task(step=Init())
            Task(step=Step())
            epoch_limiter(job, epochs)
    return JobRunner(job, CheckpointManager(str(d), "n", metadata_handler=DirectoryMetadataHandler()),
                     progress=False).train(LocalSession(Workspace()))


def test_a_symlinked_stats_log_is_never_appended_to(tmp_path, caplog):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    d = tmp_path / "ck"
    (d / ".epochal").mkdir(parents=True)
    os.symlink(outside, d / ".epochal" / "stats.jsonl")
    with caplog.at_level(logging.WARNING, logger="epochal"):
        assert run(d) == 2
    assert outside.read_text() == "precious\n"
    warned = [r.getMessage() for r in caplog.records if "Cannot append checkpoint stats" in r.getMessage()]
    assert warned and all("symbolic links" in w and "stats.jsonl" in w for w in warned), warned
    assert CheckpointDirectory(str(d)).committed_epochs() == [0, 1, 2]


def test_a_fifo_in_place_of_a_manifest_does_not_hang(tmp_path):
    run(tmp_path)
    d = CheckpointDirectory(str(tmp_path))
    os.unlink(d.manifest_path(2))
    os.mkfifo(d.manifest_path(2))
    os.mkfifo(d.pins_path)
    assert d.committed_epochs() == [0, 1]  # returns at once: the FIFO is not a manifest
    problems = d.verify_epoch(2)
    assert problems and "not a regular file" in problems[0] and "manifest.2.json" in problems[0]
    from epochal import CheckpointCorruptError

    with pytest.raises(CheckpointCorruptError, match="pins.json"):
        d.pins()


def test_a_symlinked_manifest_is_refused(tmp_path):
    run(tmp_path)
    d = CheckpointDirectory(str(tmp_path))
    os.rename(d.manifest_path(2), tmp_path / "elsewhere.json")
    os.symlink(tmp_path / "elsewhere.json", d.manifest_path(2))
    assert d.committed_epochs() == [0, 1]
    assert "symlink" in d.verify_epoch(2)[0]


def test_a_forged_torch_dtype_name_imports_nothing(tmp_path):
    pytest.importorskip("torch")
    code = (
        "import sys\n"
        "from epochal.integrations.torch import dtype_from_name, parse_device\n"
        "for bad in ('onnx', 'testing', '__class__', 'nn', 'x' * 100):\n"
        "    try:\n"
        "        dtype_from_name(bad)\n"
        "    except ValueError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit('accepted ' + bad)\n"
        "assert 'torch.onnx' not in sys.modules, 'a forged dtype name imported torch.onnx'\n"
        "import torch\n"
        "assert dtype_from_name('bfloat16') is torch.bfloat16 and dtype_from_name('float8_e4m3fn') is torch.float8_e4m3fn\n"
        "for bad in ('cpu:-1', 'cpu:99999999999999', 'cuda:0:0', 7):\n"
        "    try:\n"
        "        parse_device(bad)\n"
        "    except ValueError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit('accepted device %r' % (bad,))\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
