"""The managers create a checkpoint directory that does not exist yet
(a path under a regular file fails loudly, naming it), and ``file://`` URLs are the local disk
everywhere a checkpoint location is opened."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _crash_job as cj  # noqa: E402

from epochal import (  # noqa: E402
    Checkpointer,
    CheckpointManager,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Workspace,
)
from epochal.checkpoint.handler.directory import DirectoryMetadataHandler  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory
from epochal.cli.main import run as cli_run  # noqa: E402
from epochal.errors import CheckpointError  # noqa: E402
from epochal.storage.formats.base import get_db_type  # noqa: E402


def _train(manager, epochs=2, **kw):
    job, _ = cj.build_job(epochs)
    ws = Workspace()
    last = JobRunner(job, manager, progress=False, **kw).train(LocalSession(ws))
    return last, cj.model_blobs(ws)


def _db_blobs(path):
    return get_db_type("native").read(str(path), None)


@pytest.mark.parametrize("multi", [False, True], ids=["CheckpointManager", "MultiNodeCheckpointManager"])
def test_a_manager_without_handler_creates_the_missing_directory(tmp_path, multi):
    where = tmp_path / "not" / "yet"
    manager = (MultiNodeCheckpointManager(str(where), "native") if multi
               else CheckpointManager(str(where), "trainer_0", "native"))
    last, blobs = _train(manager, epochs=2)
    assert last == 2
    saved = _db_blobs(where / "trainer_0.2")  # the newest epoch's db holds the final values
    for name in ("w", "v", "ids"):
        assert np.array_equal(saved[name], blobs[name]), name


@pytest.mark.parametrize("multi", [False, True], ids=["CheckpointManager", "MultiNodeCheckpointManager"])
def test_a_directory_under_a_regular_file_fails_naming_it(tmp_path, multi):
    (tmp_path / "plain").write_text("a file")
    where = tmp_path / "plain" / "ckpt"
    manager = (MultiNodeCheckpointManager(str(where), "native") if multi
               else CheckpointManager(str(where), "trainer_0", "native"))
    with pytest.raises(CheckpointError, match="cannot create the checkpoint directory .*plain/ckpt"):
        _train(manager, epochs=2, max_failed_saves=1)
    assert (tmp_path / "plain").read_text() == "a file"


def test_the_two_is_url_agree_on_file_urls():
    from epochal.storage.formats import remote
    from epochal.storage.io import seam
    from epochal.storage.io.remote import fsspec_store

    assert remote.is_url is seam.is_url  # one definition, re-exported
    assert not hasattr(fsspec_store, "is_url")
    for fn in (seam.is_url, remote.is_url):
        assert not fn("file:///tmp/x") and fn("s3://b/k") and fn("memory://a/b") and not fn("/tmp/x")
    assert seam.local_path("file:///tmp/x") == "/tmp/x" == seam.local_path("file://localhost/tmp/x")
    assert seam.local_path("/tmp/y") == "/tmp/y" and seam.local_path("s3://b/k") == "s3://b/k"


def test_checkpointer_at_a_file_url_is_the_local_directory(tmp_path):
    url = f"file://{tmp_path}/run"
    with Checkpointer(url) as ckpt:
        ckpt.save(3, {"w": np.arange(4.0)})
        assert ckpt.steps() == [3]
    assert (tmp_path / "run" / ".epochal" / "manifest.3.json").is_file()
    state = {"w": np.zeros(4)}
    with Checkpointer(url) as ckpt:
        assert ckpt.restore(state) == 3
    assert state["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert CheckpointDirectory(url).committed_epochs() == [3]


def test_manager_and_handler_at_a_file_url_commit_and_resume(tmp_path, capsys):
    url = f"file://{tmp_path}/job"
    manager = MultiNodeCheckpointManager(url, "native", metadata_handler=DirectoryMetadataHandler())
    last, blobs = _train(manager, epochs=2)
    assert last == 2
    d = CheckpointDirectory(str(tmp_path / "job"))
    assert d.committed_epochs() == [0, 1, 2] and d.verify_epoch(2) == []
    manager = MultiNodeCheckpointManager(url, "native", metadata_handler=DirectoryMetadataHandler())
    last, again = _train(manager, epochs=2)  # resumes from 2, the finished job's last epoch
    assert last == 2 and d.committed_epochs() == [0, 1, 2]
    cj.assert_same_blobs(blobs, again)
    capsys.readouterr()
    assert cli_run(["ls", url]) == 0
    out = capsys.readouterr().out
    assert "committed" in out and "internal error" not in out
    assert cli_run(["verify", url]) == 0
