"""DirectoryMetadataHandler(mirror=URL): every committed epoch is pushed to a remote copy,
and a job whose local disk is gone resumes from it (fsspec memory:// and moto's S3 server)."""

from __future__ import annotations

import json
import logging
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import pytest

fsspec = pytest.importorskip("fsspec", reason="the s3 extra is not installed")

from _pipeline import EXPECTED_TOTALS, build_pipeline  # noqa: E402

import epochal as ep  # noqa: E402
from epochal.checkpoint.mirroring.mirror import RemoteMirror  # noqa: E402
from epochal.storage.formats import remote  # noqa: E402

NODES = ("trainer_0", "trainer_1")
LAST = len(EXPECTED_TOTALS)  # epochs 0 (after init) .. LAST


def _url() -> str:
    return f"memory://mirror-{secrets.token_hex(4)}/run"


def _train(local: Path, handler: ep.DirectoryMetadataHandler, resume: int | None = None) -> int:
    with ep.Cluster():
        with ep.Job() as job:
            for n in range(len(NODES)):
                build_pipeline(n)
        mgr = ep.MultiNodeCheckpointManager(str(local), metadata_handler=handler)
        return int(ep.JobRunner(job, mgr, resume_from_epoch=resume).train(ep.LocalSession()))


def _total(local: Path, node: str, epoch: int) -> int:
    got = ep.get_db_type("native").read(str(local / f"{node}.{epoch}"), [f"{node}/total"])
    return int(np.asarray(got[f"{node}/total"])[0])


def _fs(url: str, opts: dict[str, Any] | None = None) -> tuple[Any, str]:
    return remote.filesystem(url, **(opts or {}))


def _forget_after(url: str, epoch: int, opts: dict[str, Any] | None = None) -> None:
    """Make the remote look like the machine died right after committing ``epoch``."""
    mirror = RemoteMirror(url, opts)
    for e in mirror.epochs():
        if e > epoch:
            mirror.delete(e)


def test_every_commit_is_mirrored(tmp_path: Path) -> None:
    url = _url()
    assert _train(tmp_path / "c", ep.DirectoryMetadataHandler(mirror=url)) == LAST
    mirror = RemoteMirror(url)
    assert mirror.epochs() == list(range(LAST + 1))
    fs, root = _fs(url)
    for epoch in range(LAST + 1):
        local_manifest = json.loads((tmp_path / "c" / ".epochal" / f"manifest.{epoch}.json").read_text())
        assert mirror.manifest(epoch) == local_manifest
        assert local_manifest["final"] is (epoch == LAST)
        for node in NODES:
            assert fs.cat_file(f"{root}/{node}.{epoch}") == (tmp_path / "c" / f"{node}.{epoch}").read_bytes()
    assert not [k for k in fs.find(root) if ".tmp." in k]  # no temp keys left


def test_lost_disk_resumes_from_the_mirror(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = _url()
    _train(tmp_path / "a", ep.DirectoryMetadataHandler(mirror=url))
    _forget_after(url, 2)  # the first machine died after committing epoch 2
    fs, root = _fs(url)
    remote_db = fs.cat_file(f"{root}/trainer_1.2")
    new_disk = tmp_path / "b"  # a new machine: nothing local
    with caplog.at_level(logging.INFO, logger="epochal"):
        assert _train(new_disk, ep.DirectoryMetadataHandler(mirror=url)) == LAST
    assert f"Restored epoch 2 from {url}" in caplog.text
    assert (new_disk / "trainer_1.2").read_bytes() == remote_db
    assert not (new_disk / "trainer_1.1").exists()  # only the epoch resumed from is fetched
    for node in NODES:
        assert _total(new_disk, node, LAST) == EXPECTED_TOTALS[-1]
    assert RemoteMirror(url).epochs() == list(range(LAST + 1))  # pushed again from there on


def test_finished_job_on_the_mirror_is_not_rerun(tmp_path: Path) -> None:
    url = _url()
    _train(tmp_path / "a", ep.DirectoryMetadataHandler(mirror=url))
    new_disk = tmp_path / "b"
    handler = ep.DirectoryMetadataHandler(mirror=url)
    assert _train(new_disk, handler) == LAST
    assert handler.is_final(LAST)
    assert sorted(p.name for p in new_disk.iterdir() if not p.name.startswith(".")) == [
        f"{n}.{LAST}" for n in NODES
    ]


def test_damaged_remote_epoch_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = _url()
    _train(tmp_path / "a", ep.DirectoryMetadataHandler(mirror=url))
    _forget_after(url, 2)
    fs, root = _fs(url)
    key = f"{root}/trainer_1.2"
    data = bytearray(fs.cat_file(key))
    data[len(data) // 3] ^= 0x40  # same size: the digest or the checksums must tell
    fs.pipe_file(key, bytes(data))
    new_disk = tmp_path / "b"
    with caplog.at_level(logging.INFO, logger="epochal"):
        assert _train(new_disk, ep.DirectoryMetadataHandler(mirror=url)) == LAST
    assert "Cannot restore epoch 2" in caplog.text and "trainer_1.2" in caplog.text
    assert f"Restored epoch 1 from {url}" in caplog.text
    for node in NODES:
        assert _total(new_disk, node, LAST) == EXPECTED_TOTALS[-1]
    assert not [p for p in new_disk.iterdir() if ".tmp." in p.name]


def test_newer_local_epoch_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = _url()
    local = tmp_path / "c"
    _train(local, ep.DirectoryMetadataHandler(mirror=url))
    _forget_after(url, 1)
    pulled: list[int] = []
    monkeypatch.setattr(RemoteMirror, "pull", lambda self, *a, **k: pulled.append(a[2]))
    handler = ep.DirectoryMetadataHandler(mirror=url)
    handler.set_params(str(local), "native", list(NODES))
    assert handler.last_epoch() == LAST and pulled == []


def test_explicit_epoch_only_on_the_mirror(tmp_path: Path) -> None:
    url = _url()
    _train(tmp_path / "a", ep.DirectoryMetadataHandler(mirror=url))
    new_disk = tmp_path / "b"
    assert _train(new_disk, ep.DirectoryMetadataHandler(mirror=url), resume=1) == LAST
    assert (new_disk / "trainer_0.1").exists()
    for node in NODES:
        assert _total(new_disk, node, LAST) == EXPECTED_TOTALS[-1]


def test_failed_push_is_retried_after_the_next_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    url = _url()
    real = remote.upload_file
    failed: list[str] = []

    def flaky(local: str, dest: str, **kw: Any) -> int:
        if dest.endswith(".1") and not failed:
            failed.append(dest)
            raise OSError(5, "connection reset")
        return real(local, dest, **kw)

    monkeypatch.setattr("epochal.checkpoint.mirroring.mirror.upload_file", flaky)
    with caplog.at_level(logging.WARNING, logger="epochal"):
        assert _train(tmp_path / "c", ep.DirectoryMetadataHandler(mirror=url)) == LAST
    assert failed and "Cannot mirror epoch 1" in caplog.text
    assert RemoteMirror(url).epochs() == list(range(LAST + 1))
    fs, root = _fs(url)
    assert fs.cat_file(f"{root}/trainer_0.1") == (tmp_path / "c" / "trainer_0.1").read_bytes()


def test_retention_at_both_ends(tmp_path: Path) -> None:
    url = _url()
    # a lost machine's run left epochs 0..2 on the mirror
    _train(tmp_path / "a", ep.DirectoryMetadataHandler(mirror=url))
    _forget_after(url, 2)
    new_disk = tmp_path / "b"
    assert _train(new_disk, ep.DirectoryMetadataHandler(mirror=url, keep_last=2)) == LAST
    assert RemoteMirror(url).epochs() == [LAST - 1, LAST]
    handler = ep.DirectoryMetadataHandler()
    handler.set_params(str(new_disk), "native", list(NODES))
    assert handler.committed_epochs() == [LAST - 1, LAST]
    fs, root = _fs(url)
    assert sorted(k.rsplit("/", 1)[-1] for k in fs.find(root) if "/." not in k) == sorted(
        f"{n}.{e}" for n in NODES for e in (LAST - 1, LAST)
    )


def test_other_node_list_is_not_restored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = _url()
    _train(tmp_path / "a", ep.DirectoryMetadataHandler(mirror=url))
    handler = ep.DirectoryMetadataHandler(mirror=url)
    handler.set_params(str(tmp_path / "b"), "native", ["trainer_0", "trainer_1", "trainer_2"])
    with caplog.at_level(logging.WARNING, logger="epochal"):
        assert handler.last_epoch() is None
    assert "do not match this job's" in caplog.text
    assert not any((tmp_path / "b").glob("trainer_*"))


def test_s3_mirror(tmp_path: Path, s3: dict[str, Any]) -> None:
    url = "s3://ckpts/mirror-run"
    assert _train(tmp_path / "a", ep.DirectoryMetadataHandler(mirror=url, mirror_options=s3)) == LAST
    _forget_after(url, 3, s3)
    new_disk = tmp_path / "b"
    assert _train(new_disk, ep.DirectoryMetadataHandler(mirror=url, mirror_options=s3)) == LAST
    assert (new_disk / "trainer_0.3").read_bytes() == (tmp_path / "a" / "trainer_0.3").read_bytes()
    for node in NODES:
        assert _total(new_disk, node, LAST) == EXPECTED_TOTALS[-1]
    assert RemoteMirror(url, s3).epochs() == list(range(LAST + 1))


def test_cli_pull_restores_a_verified_epoch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("click")
    from epochal.cli.main import run

    url = (tmp_path / "bucket").as_uri()  # file://: a mirror on a mounted filesystem
    _train(tmp_path / "a", ep.DirectoryMetadataHandler(mirror=url))
    assert run(["pull", url, str(tmp_path / "b"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["epoch"] == LAST and got["final"] is True
    assert got["files"] == [f"{n}.{LAST}" for n in NODES]
    for node in NODES:
        assert (tmp_path / "b" / f"{node}.{LAST}").read_bytes() == (tmp_path / "a" / f"{node}.{LAST}").read_bytes()
    handler = ep.DirectoryMetadataHandler()
    handler.set_params(str(tmp_path / "b"), "native", list(NODES))
    assert handler.last_epoch() == LAST  # committed and intact there

    # the newest remote epoch damaged: skipped with a note, the next one restored
    bucket_db = tmp_path / "bucket" / f"trainer_0.{LAST}"
    raw = bytearray(bucket_db.read_bytes())
    raw[100] ^= 0xFF
    bucket_db.write_bytes(bytes(raw))
    assert run(["pull", url, str(tmp_path / "c")]) == 0
    cap = capsys.readouterr()
    assert f"restored epoch {LAST - 1}" in cap.out and f"skipped epoch {LAST}" in cap.err
    # an explicit epoch that is damaged, or absent: exit 1, one line naming it
    assert run(["pull", url, str(tmp_path / "d"), "--epoch", str(LAST)]) == 1
    assert f"trainer_0.{LAST}" in capsys.readouterr().err
    assert not any((tmp_path / "d").glob("trainer_*"))  # nothing half-restored
    assert run(["pull", url, str(tmp_path / "d"), "--epoch", "99"]) == 1
    assert "epoch 99" in capsys.readouterr().err
    assert run(["pull", (tmp_path / "empty").as_uri(), str(tmp_path / "d")]) == 1
    assert "no committed epoch" in capsys.readouterr().err
    assert run(["pull", url, str(tmp_path / "d"), "-o", "novalue"]) == 2


def _gated_uploads(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[str]]:
    """Uploads that wait for the returned event; the list records every upload started."""
    import threading

    gate = threading.Event()
    started: list[str] = []
    real = remote.upload_file

    def gated(local: str, dest: str, **kw: Any) -> int:
        started.append(dest)
        assert gate.wait(30), "upload gate never opened"
        return real(local, dest, **kw)

    monkeypatch.setattr("epochal.checkpoint.mirroring.mirror.upload_file", gated)
    return gate, started


def _commit_one(local: Path, handler: ep.DirectoryMetadataHandler, epoch: int) -> None:
    local.mkdir(parents=True, exist_ok=True)
    handler.set_params(str(local), "native", ["n0"])
    ep.get_db_type("native").write(str(local / f"n0.{epoch}"), {"w": np.full(3, epoch, dtype=np.float32)})
    handler.write(epoch)


def test_background_push_does_not_block_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = _url()
    gate, started = _gated_uploads(monkeypatch)
    handler = ep.DirectoryMetadataHandler(mirror=url)
    _commit_one(tmp_path / "c", handler, 0)  # returns while the upload waits at the gate
    assert handler.committed_epochs() == [0]
    assert RemoteMirror(url).epochs() == []  # not pushed yet
    gate.set()
    handler.flush()
    assert RemoteMirror(url).epochs() == [0] and len(started) == 1


def test_foreground_push_is_done_when_the_commit_returns(tmp_path: Path) -> None:
    url = _url()
    handler = ep.DirectoryMetadataHandler(mirror=url, mirror_background=False)
    _commit_one(tmp_path / "c", handler, 0)
    assert handler._mirror_queue is None
    assert RemoteMirror(url).epochs() == [0]


def test_runner_waits_for_the_pushes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    url = _url()
    gate, started = _gated_uploads(monkeypatch)
    timer = threading.Timer(0.3, gate.set)  # the network is slow; train must still end pushed
    timer.start()
    try:
        assert _train(tmp_path / "c", ep.DirectoryMetadataHandler(mirror=url)) == LAST
    finally:
        timer.cancel()
    assert RemoteMirror(url).epochs() == list(range(LAST + 1))
    assert RemoteMirror(url).manifest(LAST)["final"] is True


def test_pull_needs_room_for_the_whole_epoch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    import errno
    import os

    url = _url()
    _train(tmp_path / "a", ep.DirectoryMetadataHandler(mirror=url))

    class Tiny:
        f_bavail, f_frsize = 0, 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny())
    mirror = RemoteMirror(url)
    with pytest.raises(OSError) as e:
        mirror.pull(str(tmp_path / "b"), str(tmp_path / "b" / ".epochal"), LAST, "native", list(NODES))
    assert e.value.errno == errno.ENOSPC and "b" in str(e.value.filename)
    assert not [p for p in (tmp_path / "b").iterdir() if p.name != ".epochal"]
    handler = ep.DirectoryMetadataHandler(mirror=url)
    handler.set_params(str(tmp_path / "b"), "native", list(NODES))
    with caplog.at_level(logging.WARNING, logger="epochal"):
        assert handler.last_epoch() is None  # nothing restored, the job would start afresh
    assert "No space" in caplog.text or "not enough free space" in caplog.text


def test_delete_finishes_an_interrupted_delete(tmp_path: Path) -> None:
    url = _url()
    _train(tmp_path / "a", ep.DirectoryMetadataHandler(mirror=url))
    fs, root = _fs(url)
    fs.rm(f"{root}/trainer_0.2")  # a delete that stopped after one db
    mirror = RemoteMirror(url)
    mirror.delete(2)
    mirror.delete(2)  # nothing left to remove: no error
    assert 2 not in mirror.epochs() and not fs.exists(f"{root}/trainer_1.2")
    assert mirror.epochs() == [e for e in range(LAST + 1) if e != 2]


def test_each_node_pushes_its_own_db_and_the_driver_only_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Machines that share no disk: the driver never uploads a db (RemoteMirror.push, which
    reads the dbs from the driver's disk, is never called), yet the mirror is complete."""
    url = _url()
    driver_pushes: list[int] = []

    def no_driver_push(self: RemoteMirror, db_dir: str, epoch: int, manifest: dict[str, Any]) -> int:
        driver_pushes.append(epoch)
        raise AssertionError("the driver must not upload dbs")

    monkeypatch.setattr(RemoteMirror, "push", no_driver_push)
    assert _train(tmp_path / "c", ep.DirectoryMetadataHandler(mirror=url, mirror_from_nodes=True)) == LAST
    assert driver_pushes == []
    mirror = RemoteMirror(url)
    assert mirror.epochs() == list(range(LAST + 1))
    fs, root = _fs(url)
    for epoch in range(LAST + 1):
        for node in NODES:
            assert fs.cat_file(f"{root}/{node}.{epoch}") == (tmp_path / "c" / f"{node}.{epoch}").read_bytes()


def test_a_node_push_that_fails_is_pushed_by_the_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    from epochal.storage.formats import remote as remote_mod

    url = _url()
    real = remote_mod.upload_file
    calls: list[str] = []

    def flaky(local: str, dest: str, **opts: Any) -> int:
        calls.append(dest)
        if dest.endswith("trainer_1.2") and len([c for c in calls if c.endswith("trainer_1.2")]) == 1:
            raise OSError("network down")
        return real(local, dest, **opts)

    monkeypatch.setattr(remote_mod, "upload_file", flaky)
    with caplog.at_level(logging.WARNING, logger="epochal"):
        handler = ep.DirectoryMetadataHandler(mirror=url, mirror_background=False, mirror_from_nodes=True)
        assert _train(tmp_path / "c", handler) == LAST
    assert "Cannot push" in caplog.text and "trainer_1.2" in caplog.text
    assert RemoteMirror(url).epochs() == list(range(LAST + 1))
    fs, root = _fs(url)
    assert fs.cat_file(f"{root}/trainer_1.2") == (tmp_path / "c" / "trainer_1.2").read_bytes()
