"""Checkpoints at an fsspec URL as ``db_prefix`` (memory:// and moto's S3 server on
127.0.0.1): a job trained there end to end, resumed from the URL alone, retention, pins and
stats at the URL, the writer lease, and a URL that does not exist."""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fsspec", reason="the s3 extra is not installed")

from _pipeline import EXPECTED_TOTALS, build_pipeline  # noqa: E402

import epochal as ep  # noqa: E402
from epochal.checkpoint.location.naming import db_token, split_db_file  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.errors import CheckpointError, CheckpointLockedError  # noqa: E402
from epochal.storage.io.remote.fsspec_store import filesystem_for  # noqa: E402

NODES = ("trainer_0", "trainer_1")
LAST = len(EXPECTED_TOTALS)


@pytest.fixture(params=["memory", "s3"])
def where(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any] | None]:
    """A fresh run URL and the storage options that reach it."""
    if request.param == "memory":
        return f"memory://url-{secrets.token_hex(4)}/run", None
    return f"s3://ckpts/url-{secrets.token_hex(4)}/run", request.getfixturevalue("s3")


def _train(url: str, handler: Any, opts: dict[str, Any] | None, resume: int | None = None) -> int:
    with ep.Cluster():
        with ep.Job() as job:
            for n in range(len(NODES)):
                build_pipeline(n)
        mgr = ep.MultiNodeCheckpointManager(url, metadata_handler=handler, storage_options=opts)
        return int(ep.JobRunner(job, mgr, resume_from_epoch=resume).train(ep.LocalSession()))


def _keys(url: str) -> list[str]:
    fs, root = filesystem_for(url)
    fs.invalidate_cache()
    return sorted(k[len(root) + 1:] for k in fs.find(root))


def _cat(url: str) -> bytes:
    fs, path = filesystem_for(url)
    return bytes(fs.cat_file(path))


def _db(url: str, node: str, epoch: int) -> str:
    """The URL of ``node``'s committed db of ``epoch``, as its manifest names it (with its
    writer's token)."""
    return CheckpointDirectory(url).db_path(node, epoch)


def _forget_after(url: str, epoch: int) -> None:
    """Make the URL look like the job died right after committing ``epoch``."""
    fs, root = filesystem_for(url)
    for key in _keys(url):
        name = key.rsplit("/", 1)[-1]
        split = split_db_file(name)
        ep_ = name.split(".")[-2] if name.endswith(".json") else str(split[1]) if split else ""
        if ep_.isdigit() and int(ep_) > epoch:
            fs.rm_file(f"{root}/{key}")


def test_a_job_at_a_url_end_to_end_and_resumed_from_it(
    where: tuple[str, dict[str, Any] | None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, opts = where
    monkeypatch.chdir(tmp_path)  # nothing may land in a local folder named "s3:" or "memory:"
    assert _train(url, ep.DirectoryMetadataHandler(storage_options=opts), opts) == LAST
    keys = _keys(url)
    for epoch in range(LAST + 1):
        assert f".epochal/manifest.{epoch}.json" in keys
        for node in NODES:  # each db named with its writer's token, as the manifest says
            name = _db(url, node, epoch).rsplit("/", 1)[-1]
            assert name in keys and name.startswith(f"{node}.{epoch}.") and db_token(name) is not None
    assert not [k for k in keys if ".tmp." in k]
    assert ".epochal/lease.json" not in keys  # released when train ended
    d = CheckpointDirectory(url)
    assert d.committed_epochs() == list(range(LAST + 1))
    manifest = d.manifest(LAST)
    assert manifest["final"] is True
    for node in NODES:  # the manifest records what the nodes reported: true sizes and digests
        db = _db(url, node, LAST)
        assert manifest["nodes"][node]["size"] == len(_cat(db))
        assert manifest["nodes"][node]["digest"] == ep.get_db_type("native").digest(db)
        got = ep.get_db_type("native").read(db, [f"{node}/total"])
        assert int(np.asarray(got[f"{node}/total"])[0]) == EXPECTED_TOTALS[-1]
    assert d.check_epoch(LAST, "full") == []
    uninterrupted = {node: _cat(_db(url, node, LAST)) for node in NODES}
    m2 = _cat(f"{url}/.epochal/manifest.2.json")

    _forget_after(url, 2)  # the job died after committing epoch 2; a fresh session resumes
    assert CheckpointDirectory(url).committed_epochs() == [0, 1, 2]
    assert _train(url, ep.DirectoryMetadataHandler(storage_options=opts), opts) == LAST
    assert _cat(f"{url}/.epochal/manifest.2.json") == m2  # epochs 0..2 were not retrained
    for node in NODES:
        assert _cat(_db(url, node, LAST)) == uninterrupted[node]  # bit-identical
    assert os.listdir(tmp_path) == []
    loads = [r for r in CheckpointDirectory(url).stats() if r["action"] == "checkpoint_load"]
    assert sorted((r["epoch"], r["node"]) for r in loads) == [(2, n) for n in NODES]


def test_retention_pins_and_stats_at_the_url(where: tuple[str, dict[str, Any] | None]) -> None:
    url, opts = where
    handler = ep.DirectoryMetadataHandler(keep_last=2, storage_options=opts)
    handler.pin(1)
    assert _train(url, handler, opts) == LAST
    d = CheckpointDirectory(url)
    assert d.committed_epochs() == [1, LAST - 1, LAST]
    assert d.pins() == {1}
    keys = _keys(url)
    assert sorted(k for k in keys if not k.startswith(".epochal/")) == sorted(
        _db(url, n, e).rsplit("/", 1)[-1] for n in NODES for e in (1, LAST - 1, LAST))
    stats = d.stats()
    saves = [(r["epoch"], r["node"]) for r in stats if r["action"] == "checkpoint_save"]
    assert sorted(saves) == sorted((e, n) for e in range(LAST + 1) for n in NODES)
    assert all(r["bytes"] and r["bytes"] > 0 for r in stats)
    assert len([k for k in keys if k.startswith(".epochal/stats/")]) == LAST + 1  # one per report
    handler.unpin(1)
    assert CheckpointDirectory(url).pins() == set()


def test_a_second_writer_is_refused_and_an_expired_lease_taken_over(
    where: tuple[str, dict[str, Any] | None], caplog: pytest.LogCaptureFixture,
) -> None:
    url, opts = where
    first = ep.DirectoryMetadataHandler(storage_options=opts, lease_seconds=60)
    first.set_params(url, "native", list(NODES))
    first.acquire_lock()
    lease = json.loads(_cat(f"{url}/.epochal/lease.json"))
    assert lease["pid"] == os.getpid() and lease["expires_at"] > time.time() + 50
    with pytest.raises(CheckpointLockedError) as e:
        _train(url, ep.DirectoryMetadataHandler(storage_options=opts), opts)
    assert f"{url}/.epochal/lease.json" in str(e.value) and f"pid {os.getpid()}" in str(e.value)
    assert CheckpointDirectory(url).committed_epochs() == []  # nothing was written
    first.release_lock()
    assert ".epochal/lease.json" not in _keys(url)

    stale = ep.DirectoryMetadataHandler(storage_options=opts, lease_seconds=0.01)
    stale.set_params(url, "native", list(NODES))
    stale.acquire_lock()  # and its holder dies without releasing it: no more renewals
    stale._lock.stop_renewal()  # type: ignore[union-attr]
    time.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="epochal"):
        assert _train(url, ep.DirectoryMetadataHandler(storage_options=opts), opts) == LAST
    assert "Taking over the expired checkpoint lease" in caplog.text


def test_a_commit_renews_the_lease(where: tuple[str, dict[str, Any] | None]) -> None:
    url, opts = where
    h = ep.DirectoryMetadataHandler(storage_options=opts, lease_seconds=30)
    h.set_params(url, "native", ["n"])
    h.acquire_lock()
    before = json.loads(_cat(f"{url}/.epochal/lease.json"))["expires_at"]
    ep.get_db_type("native").write(f"{url}/n.0", {"v": np.arange(3)})
    time.sleep(0.02)
    h.write(0)  # no node report (a handler driven by hand): size and digest from the store
    after = json.loads(_cat(f"{url}/.epochal/lease.json"))["expires_at"]
    assert after > before
    entry = CheckpointDirectory(url).manifest(0)["nodes"]["n"]
    assert entry["size"] == len(_cat(f"{url}/n.0"))
    h.release_lock()


def test_a_url_that_does_not_exist(s3: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"s3://no-such-bucket-{secrets.token_hex(3)}/run"
    d = CheckpointDirectory(url, storage_options=s3)
    assert d.committed_epochs() == [] and d.scan() == {}
    with pytest.raises((CheckpointError, OSError)) as e:
        _train(url, ep.DirectoryMetadataHandler(storage_options=s3), s3)
    assert "no-such-bucket" in str(e.value)
    with pytest.raises(CheckpointError) as e2:  # an explicit epoch that is not there
        _train(f"memory://empty-{secrets.token_hex(3)}/run", ep.DirectoryMetadataHandler(), None, resume=1)
    assert "epoch 1" in str(e2.value)
    assert os.listdir(tmp_path) == []


def test_db_name_joins_urls_with_a_slash() -> None:
    from epochal.checkpoint.location.naming import db_name

    assert db_name(3, "trainer_0", "s3://b/run") == "s3://b/run/trainer_0.3"
    assert db_name(3, "trainer_0", "s3://b/run/") == "s3://b/run/trainer_0.3"
    assert db_name(3, "t", "", "s3://b/run/pre_") == "s3://b/run/pre_t.3"


def test_resume_at_a_url_reads_headers_only_and_a_damaged_db_found_by_the_load_falls_back(
    where: tuple[str, dict[str, Any] | None], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    from epochal.storage.io.remote import fsspec_store

    url, opts = where
    assert _train(url, ep.DirectoryMetadataHandler(storage_options=opts), opts) == LAST
    _forget_after(url, 2)
    sizes = sum(len(_cat(_db(url, n, 2))) for n in NODES)
    asked: list[int] = []
    real = fsspec_store.FsspecSource.read

    def read(self: Any, nbytes: int, offset: int) -> bytes:
        data = real(self, nbytes, offset)
        asked.append(len(data))
        return data

    monkeypatch.setattr(fsspec_store.FsspecSource, "read", read)
    h = ep.DirectoryMetadataHandler(storage_options=opts)  # verify="full" by default
    h.set_params(url, "native", list(NODES))
    assert h.last_epoch() == 2
    assert 0 < sum(asked) < sizes // 4  # size and digest from headers, not every byte
    monkeypatch.undo()

    damaged = _db(url, "trainer_1", 2)
    fs, path = filesystem_for(damaged)
    data = bytearray(fs.cat_file(path))
    at = data.find(np.arange(10, dtype=np.int64).tobytes())  # trainer_1/data's bytes
    assert at > 0
    data[at + 3] ^= 0x01  # same size, same header: only the checksums can tell
    fs.pipe_file(path, bytes(data))
    # an explicit epoch: the load's error names the db
    with pytest.raises(CheckpointError) as e:
        _train(url, ep.DirectoryMetadataHandler(storage_options=opts), opts, resume=2)
    assert damaged in str(e.value)
    # the chosen epoch: the load finds the damage and the run falls back to epoch 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="epochal"):
        assert _train(url, ep.DirectoryMetadataHandler(storage_options=opts), opts) == LAST
    said = [r.getMessage() for r in caplog.records]
    assert any("epoch 2 is damaged" in m and damaged in m for m in said), said
    assert any("Resuming from epoch 1" in m for m in said), said
