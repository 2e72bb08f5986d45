"""Incremental saves across ranks (``Checkpointer(incremental=True)`` under torch.distributed,
the DCP writer's ``incremental=True``): each rank writes only the bytes its own db of the step
before does not hold; retention keeps the bytes a kept step uses; every kept step verifies
with ``epochal verify`` and restores bit-equal in ranks that never saw it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_incremental import restore_steps, save_steps  # noqa: E402
from _dist_workers import run_ranks  # noqa: E402

from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_ranks_write_only_what_changed_and_every_kept_step_restores(tmp_path: Path, async_save: bool) -> None:
    path, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    run_ranks(save_steps, 2, str(path), str(out), async_save)
    d = CheckpointDirectory(str(path))
    assert d.committed_epochs() == [3, 4]
    assert d.has_incremental()
    for r in (0, 1):
        whole = 4 << 20  # each rank's half of the 8 MiB base, at least
        for step in (3, 4):
            db = path / d.read_manifest(step).nodes[f"rank{r}"].file
            assert os.path.getsize(db) < whole // 8, (db, os.path.getsize(db))  # the head and the records
    v = subprocess.run([sys.executable, "-m", "epochal", "verify", str(path)], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
    run_ranks(restore_steps, 2, str(path), str(out))
