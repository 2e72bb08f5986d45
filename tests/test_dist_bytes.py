"""Fewer bytes across ranks: incremental saves (``Checkpointer(incremental=True)`` under
torch.distributed, the DCP writer's ``incremental=True``: each rank writes only the bytes its
own db of the step before does not hold; retention keeps the bytes a kept step uses) and
compression (``compression="zstd"``: each rank's db compressed as written, also on the
background thread). Every kept step verifies with ``epochal verify`` and restores bit-equal in
ranks that never saw it, on 2 ranks and on 1."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_bytes import restore_steps, save_steps  # noqa: E402
from _dist_workers import run_ranks  # noqa: E402

from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")]

#: each rank's half of the base (bf16, 4096 x 1024 in all)
HALF = 4 << 20


def saved(tmp_path: Path, async_save: bool, **options: object) -> tuple[Path, Path, CheckpointDirectory]:
    path, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    run_ranks(save_steps, 2, str(path), str(out), async_save, options)
    d = CheckpointDirectory(str(path))
    assert d.committed_epochs() == [3, 4]
    v = subprocess.run([sys.executable, "-m", "epochal", "verify", str(path)], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
    return path, out, d


def sizes(path: Path, d: CheckpointDirectory, step: int) -> list[int]:
    return [os.path.getsize(path / d.read_manifest(step).nodes[f"rank{r}"].file) for r in (0, 1)]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_ranks_write_only_what_changed_and_every_kept_step_restores(tmp_path: Path, async_save: bool) -> None:
    path, out, d = saved(tmp_path, async_save, incremental=True)
    assert d.has_incremental()
    for step in (3, 4):
        assert all(n < HALF // 8 for n in sizes(path, d, step)), sizes(path, d, step)  # the head and the records
    run_ranks(restore_steps, 2, str(path), str(out))
    run_ranks(restore_steps, 1, str(path), str(out))  # resharded: one rank reads both ranks' dbs


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_ranks_compress_their_dbs_and_every_kept_step_restores(tmp_path: Path, async_save: bool) -> None:
    path, out, d = saved(tmp_path, async_save, compression="zstd")
    for step in (3, 4):
        assert all(n < HALF * 0.85 for n in sizes(path, d, step)), sizes(path, d, step)  # bf16 planes: ~0.67x
    run_ranks(restore_steps, 2, str(path), str(out))
    run_ranks(restore_steps, 1, str(path), str(out))


@pytest.mark.parametrize("options", [{"incremental": True}, {"compression": "zstd"}], ids=["incremental", "zstd"])
def test_at_an_s3_url(tmp_path: Path, s3: dict[str, Any], options: dict[str, Any]) -> None:
    """The same at an s3:// URL (moto on loopback), async: the manifest records each rank's
    stored bytes, every kept step checks whole, and 2 ranks and 1 restore it bit-equal."""
    url, out = f"s3://ckpts/bytes-{secrets.token_hex(4)}/run", tmp_path / "out"
    out.mkdir()
    run_ranks(save_steps, 2, url, str(out), True, {**options, "storage_options": s3})
    d = CheckpointDirectory(url, storage_options=s3)
    assert d.committed_epochs() == [3, 4]
    bound = HALF // 8 if "incremental" in options else HALF * 0.85
    for step in (3, 4):
        stored = [d.read_manifest(step).nodes[f"rank{r}"].size for r in (0, 1)]
        assert all(n < bound for n in stored), stored
        assert not d.check_epoch(step, "full")
    run_ranks(restore_steps, 2, url, str(out), s3)
    run_ranks(restore_steps, 1, url, str(out), s3)
