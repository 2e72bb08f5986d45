"""Remote storage: final checkpoints uploaded to an S3-compatible server (moto, on 127.0.0.1)
and to fsspec's memory filesystem, then read back verified."""

from __future__ import annotations

import numpy as np
import pytest

fsspec = pytest.importorskip("fsspec", reason="the s3 extra is not installed")

from _pipeline import EXPECTED_TOTALS, build_pipeline  # noqa: E402

from epochal import (  # noqa: E402
    CheckpointNotFoundError,
    Cluster,
    Job,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
)
from epochal.checkpoint.tasks.upload import FsspecUploadBuilder  # noqa: E402
from epochal.storage.formats.remote import download_file, is_url, read_remote, upload_file  # noqa: E402


def _train_with_upload(tmp_path, url, opts):
    with Cluster():
        with Job() as job:
            for n in range(2):
                build_pipeline(n)
        from epochal import DirectoryMetadataHandler

        mgr = MultiNodeCheckpointManager(str(tmp_path), metadata_handler=DirectoryMetadataHandler())
        return JobRunner(job, mgr, upload_task_group_builder=FsspecUploadBuilder(url, opts)).train(
            LocalSession()
        )


def test_upload_to_s3_and_read_back(s3, tmp_path):
    assert _train_with_upload(tmp_path / "c", "s3://ckpts/run1", s3) == 4
    fs = fsspec.filesystem("s3", **s3)
    keys = sorted(k.split("/", 2)[2] for k in fs.find("ckpts/run1"))
    assert keys == [".epochal/manifest.4.json", "trainer_0.4", "trainer_1.4"]
    for node in ("trainer_0", "trainer_1"):
        assert fs.cat_file(f"ckpts/run1/{node}.4") == (tmp_path / "c" / f"{node}.4").read_bytes()
    values = read_remote("s3://ckpts/run1/trainer_1.4", ["trainer_1/total"], storage_options=s3)
    assert values["trainer_1/total"].tolist() == [EXPECTED_TOTALS[-1]]
    with pytest.raises(CheckpointNotFoundError, match="trainer_9.4"):
        read_remote("s3://ckpts/run1/trainer_9.4", storage_options=s3)
    # no temporary upload keys are left behind
    assert not [k for k in fs.find("ckpts") if ".tmp." in k]


def test_memory_filesystem_roundtrip(tmp_path):
    assert is_url("memory://x/y") and not is_url("/tmp/x") and not is_url("file:///tmp/x")
    assert _train_with_upload(tmp_path / "c", "memory://bucket/runs/a", {}) == 4
    local = tmp_path / "back"
    download_file("memory://bucket/runs/a/trainer_0.4", str(local))
    assert local.read_bytes() == (tmp_path / "c" / "trainer_0.4").read_bytes()
    src = tmp_path / "blob.bin"
    src.write_bytes(np.arange(1000, dtype=np.int64).tobytes())
    assert upload_file(str(src), "memory://bucket/raw.bin") == 8000
    assert fsspec.filesystem("memory").cat_file("/bucket/raw.bin") == src.read_bytes()
