"""The demo job: trains, resumes, stays finished, and trains on when asked for more epochs."""

from __future__ import annotations

import numpy as np

from epochal import get_db_type
from epochal.checkpoint.location.view import CheckpointDirectory
from epochal.demo import run_demo


def test_demo_resumes_and_extends(tmp_path, capsys):
    d = str(tmp_path / "ck")
    assert run_demo(d, epochs=2, points=3000) == 2
    out = capsys.readouterr().out
    assert "starting a new job" in out and "epoch   1  loss" in out and "epoch   2  loss" in out
    assert CheckpointDirectory(d).committed_epochs() == [0, 1, 2]

    assert run_demo(d, epochs=2, points=3000) == 2  # finished: loads, trains nothing
    out = capsys.readouterr().out
    assert "already finished at epoch 2" in out and "epoch   3" not in out

    assert run_demo(d, epochs=4, points=3000) == 4  # more epochs: continues from 2
    out = capsys.readouterr().out
    assert "loaded checkpoint 2" in out and "epoch   3  loss" in out and "epoch   1  loss" not in out
    # keep_last=3: the three newest epochs remain
    assert CheckpointDirectory(d).committed_epochs() == [2, 3, 4]
    final = get_db_type("native").read(f"{d}/trainer.4", ["epoch", "model/w0"])
    assert final["epoch"] == 4 and np.isfinite(final["model/w0"]).all()


def test_demo_more_continues_each_run(tmp_path, capsys):
    d = str(tmp_path / "ck")
    assert run_demo(d, more=2, points=2000) == 2
    assert run_demo(d, more=2, points=2000) == 4
    out = capsys.readouterr().out
    assert "resuming after epoch 2" in out and "epoch   4  loss" in out
