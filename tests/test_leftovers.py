"""Nothing left behind by saves to a URL that failed or were killed: temp upload keys (and on
S3 multipart uploads in progress) are removed by the next lease holder, staging files when the save fails and (those of dead
processes) when a process stages its first write. memory:// and moto's S3 on 127.0.0.1."""

from __future__ import annotations

import gc
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fsspec", reason="the s3 extra is not installed")

import epochal as ep  # noqa: E402
from epochal.errors import CheckpointLockedError  # noqa: E402
from epochal.storage.io import atomic  # noqa: E402
from epochal.storage.io.remote import fsspec_store  # noqa: E402
from epochal.storage.io.remote.fsspec_store import filesystem_for, set_storage_options  # noqa: E402


@pytest.fixture(params=["memory", "s3"])
def where(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any] | None]:
    if request.param == "memory":
        return f"memory://left-{secrets.token_hex(4)}/run", None
    url, opts = f"s3://ckpts/left-{secrets.token_hex(4)}/run", request.getfixturevalue("s3")
    set_storage_options(url, opts)
    return url, opts


@pytest.fixture
def stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "stage"
    folder.mkdir()
    monkeypatch.setenv("EPOCHAL_STAGE_DIR", str(folder))
    return folder


def _keys(url: str) -> list[str]:
    fs, root = filesystem_for(url)
    fs.invalidate_cache()
    return sorted(k[len(root) + 1:] for k in fs.find(root))


def _put(url: str, data: bytes) -> None:
    fs, path = filesystem_for(url)
    fs.pipe_file(path, data)
    fs.invalidate_cache()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_lease_holder_removes_dead_uploads_at_start(where: tuple[str, dict[str, Any] | None]) -> None:
    url, opts = where
    _put(f"{url}/n.0", b"committed-looking db")
    _put(f"{url}/n.3.tmp.upload.deadbeef", b"half an upload")
    _put(f"{url}/.epochal/pins.json.tmp.upload.0123abcd", b"x")
    _put(f"{url}/notes.tmp.upload.txt", b"not one of ours")  # not an upload's temp name
    h = ep.DirectoryMetadataHandler(storage_options=opts)
    h.set_params(url, "native", ["n"])
    assert ".epochal/pins.json.tmp.upload.0123abcd" in _keys(url)  # not before the lease is held
    h.acquire_lock()
    try:
        assert _keys(url) == [".epochal/lease.json", "n.0", "notes.tmp.upload.txt"]
    finally:
        h.release_lock()
    # a job refused the lease removes nothing
    _put(f"{url}/n.4.tmp.upload.cafef00d", b"in flight")
    first = ep.DirectoryMetadataHandler(storage_options=opts)
    first.set_params(url, "native", ["n"])
    first.acquire_lock()
    try:
        second = ep.DirectoryMetadataHandler(storage_options=opts)
        second.set_params(url, "native", ["n"])
        with pytest.raises(CheckpointLockedError):
            second.acquire_lock()
    finally:
        first.release_lock()
    assert "n.4.tmp.upload.cafef00d" not in _keys(url)  # the first (holder) removed it at start
    fs, path = filesystem_for(f"{url}/notes.tmp.upload.txt")
    fs.rm_file(path)  # the S3 server's state outlives this module: leave no ".tmp." key behind


@pytest.mark.parametrize("step", ["put", "mv", "upload_part"])
def test_a_failed_upload_leaves_no_staging_file_and_no_temp_key(
    where: tuple[str, dict[str, Any] | None], stage: Path, monkeypatch: pytest.MonkeyPatch, step: str,
) -> None:
    """memory:// uploads to a temp key and moves it (a failed PUT, a failed move); S3 uploads
    straight to the final key, whole or not at all (a failed PUT of a body streamed from the
    staging file, a failed part of a multipart upload: the upload is aborted, no part is
    left)."""
    url, _ = where
    s3 = url.startswith("s3://")
    if step == ("mv" if s3 else "upload_part"):
        pytest.skip(f"no {step} in an upload to {url.split(':')[0]}")
    db = f"{url}/n.0"
    backend = ep.get_db_type("native")
    backend.write(db, {"v": np.arange(4)})
    before = bytes(filesystem_for(db)[0].cat_file(filesystem_for(db)[1]))
    fs = filesystem_for(db)[0]
    data: dict[str, Any] = {"v": np.arange(1000)}

    def broken(*a: Any, **k: Any) -> None:
        raise OSError(5, f"injected: {step} failed")

    if step == "upload_part":  # 12 MiB in 5 MiB parts: the second part fails
        from epochal.storage.io import tuning

        monkeypatch.setattr(tuning, "UPLOAD_PART", 5 << 20)
        data = {"v": np.arange(12 << 20, dtype=np.uint8)}
        from aiobotocore.client import AioBaseClient

        real = AioBaseClient._make_api_call
        parts: list[int] = []

        async def flaky(self: Any, operation: str, params: dict[str, Any]) -> Any:
            if operation == "UploadPart":
                parts.append(params["PartNumber"])
                if params["PartNumber"] == 2:
                    broken()
            return await real(self, operation, params)

        monkeypatch.setattr(AioBaseClient, "_make_api_call", flaky)
    elif step == "put" and s3:  # the streamed PUT goes out through s3fs's client
        puts: list[str] = []

        def put_object(**k: Any) -> None:  # (s3fs picks the request options by this name)
            puts.append(k["Key"])
            broken()

        monkeypatch.setattr(fs.s3, "put_object", put_object)
    else:  # a failed PUT, or a failed server-side move
        monkeypatch.setattr(fs, "put_file" if step == "put" else step, broken)
    with pytest.raises(OSError, match="injected"):
        backend.write(db, data)
    monkeypatch.undo()
    assert os.listdir(stage) == []
    assert _keys(url) == ["n.0"]
    assert bytes(fs.cat_file(filesystem_for(db)[1])) == before  # the old object stands
    if step == "put" and s3:
        assert [k.rsplit("/", 1)[-1] for k in puts] == ["n.0"]  # one PUT, straight to the key
    if step == "upload_part":
        assert 2 in parts and len(parts) >= 2  # it was a multipart upload
        bucket, key, _ = fs.split_path(filesystem_for(db)[1])
        pending = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads", [])
        assert pending == []  # aborted: no part is left on the server


def test_a_streamed_put_cut_off_mid_body_is_sent_again_whole(
    s3: dict[str, Any], stage: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The db's PUT streams its body from the staging file; a connection lost after 1 MiB of
    it is retried by botocore from the file's start, so the object holds the whole db (never
    the rest of the file as the whole object), and the load checks every byte of it."""
    from aiobotocore.endpoint import AioEndpoint
    from botocore.exceptions import ConnectionClosedError

    url = f"s3://ckpts/cut-{secrets.token_hex(4)}/run"
    set_storage_options(url, s3)
    real = AioEndpoint._send
    cut: list[int] = []

    async def flaky(self: Any, request: Any) -> Any:
        if request.method == "PUT" and request.url.endswith("/n.0") and not cut:
            cut.append(len(request.body.read(1 << 20)))  # part of the body went out...
            raise ConnectionClosedError(endpoint_url=request.url)  # ... then the line dropped
        return await real(self, request)

    monkeypatch.setattr(AioEndpoint, "_send", flaky)
    data = {"v": np.random.default_rng(3).integers(0, 255, 3 << 20, dtype=np.uint8), "k": np.arange(7)}
    ep.get_db_type("native").write(f"{url}/n.0", data)
    monkeypatch.undo()
    assert cut == [1 << 20]
    got = ep.get_db_type("native").read(f"{url}/n.0")
    assert got["v"].tobytes() == data["v"].tobytes() and got["k"].tolist() == list(range(7))
    fs, path = filesystem_for(f"{url}/n.0")
    assert fs.info(path)["size"] > 3 << 20
    assert os.listdir(stage) == []


def test_a_multipart_upload_sends_each_part_from_its_slice_and_again_whole_when_cut(
    s3: dict[str, Any], stage: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Above twice the part size the db goes up in parts, each streamed from its slice of the
    staging file; part 2 cut after 1 MiB is sent again from its own first byte (not the
    file's, not where it was cut), and the object is the db, bit for bit."""
    from aiobotocore.endpoint import AioEndpoint
    from botocore.exceptions import ConnectionClosedError

    from epochal.storage.io import tuning

    monkeypatch.setattr(tuning, "UPLOAD_PART", 5 << 20)  # 12 MiB: parts of 5, 5 and 2 MiB
    url = f"s3://ckpts/parts-{secrets.token_hex(4)}/run"
    set_storage_options(url, s3)
    real = AioEndpoint._send
    seen: list[tuple[str, int, bytes]] = []  # (part number, body position at the start, first bytes)

    async def flaky(self: Any, request: Any) -> Any:
        if request.method == "PUT" and "partNumber=" in request.url:
            number = request.url.split("partNumber=")[1].split("&")[0]
            at = request.body.tell()
            head = request.body.read(16)
            request.body.seek(at)
            seen.append((number, at, head))
            if number == "2" and sum(1 for n, _, _ in seen if n == "2") == 1:
                request.body.read(1 << 20)
                raise ConnectionClosedError(endpoint_url=request.url)
        return await real(self, request)

    monkeypatch.setattr(AioEndpoint, "_send", flaky)
    data = {"v": np.random.default_rng(5).integers(0, 255, 12 << 20, dtype=np.uint8)}
    ep.get_db_type("native").write(f"{url}/n.0", data)
    monkeypatch.undo()
    fs, path = filesystem_for(f"{url}/n.0")
    blob = bytes(fs.cat_file(path))
    part = 5 << 20
    assert sorted(n for n, _, _ in seen) == ["1", "2", "2", "3"]
    for number, at, head in seen:  # every attempt starts at its part's first byte
        assert at == 0 and head == blob[(int(number) - 1) * part:][:16], number
    assert ep.get_db_type("native").read(f"{url}/n.0")["v"].tobytes() == data["v"].tobytes()
    assert os.listdir(stage) == []


def test_a_streamed_put_cut_off_at_every_attempt_fails_and_leaves_the_old_object(
    s3: dict[str, Any], stage: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once botocore's attempts are spent the save fails: no further call re-sends the same,
    already read body (s3fs's ``call_s3`` would, and store the rest of the file as the whole
    object); the object committed before stands."""
    from aiobotocore.endpoint import AioEndpoint
    from botocore.exceptions import ConnectionClosedError

    url = f"s3://ckpts/cutall-{secrets.token_hex(4)}/run"
    set_storage_options(url, {**s3, "config_kwargs": {"retries": {"total_max_attempts": 2, "mode": "standard"}}})
    backend = ep.get_db_type("native")
    backend.write(f"{url}/n.0", {"v": np.arange(5)})
    fs, path = filesystem_for(f"{url}/n.0")
    before = bytes(fs.cat_file(path))
    real = AioEndpoint._send
    cuts: list[int] = []

    async def flaky(self: Any, request: Any) -> Any:
        if request.method == "PUT" and request.url.endswith("/n.0"):
            if len(cuts) < 2:  # every attempt botocore makes
                assert request.body.tell() == 0
                cuts.append(len(request.body.read(1 << 20)))
                raise ConnectionClosedError(endpoint_url=request.url)
        return await real(self, request)

    monkeypatch.setattr(AioEndpoint, "_send", flaky)
    with pytest.raises(OSError):
        backend.write(f"{url}/n.0", {"v": np.random.default_rng(4).integers(0, 255, 3 << 20, dtype=np.uint8)})
    monkeypatch.undo()
    assert cuts == [1 << 20, 1 << 20]  # both attempts started from the file's first byte
    fs.invalidate_cache()
    assert bytes(fs.cat_file(path)) == before
    assert backend.read(f"{url}/n.0")["v"].tolist() == list(range(5))
    assert os.listdir(stage) == []


def test_a_sink_dropped_without_commit_removes_its_staging_file(
    where: tuple[str, dict[str, Any] | None], stage: Path,
) -> None:
    url, _ = where
    sink = fsspec_store.FsspecStore().create(f"{url}/n.0")
    sink.write(b"abc")
    assert len(os.listdir(stage)) == 1
    del sink
    gc.collect()
    assert os.listdir(stage) == []
    assert _keys(url) == []


def test_stale_staging_files_of_dead_processes_are_removed_at_the_first_write(
    where: tuple[str, dict[str, Any] | None], stage: Path,
) -> None:
    url, _ = where
    me, dead = atomic.hostname(), _dead_pid()
    stale = stage / f"epochal-stage.{me}.{dead}.k2j4_x1"
    alive = stage / f"epochal-stage.{me}.{os.getppid()}.a1b2c3d4"
    foreign = stage / f"epochal-stage.other-host.{dead}.zz9"
    other = stage / "unrelated.file"
    for p in (stale, alive, foreign, other):
        p.write_bytes(b"x" * 100)
    fsspec_store._swept.discard(str(stage))
    ep.get_db_type("native").write(f"{url}/n.0", {"v": np.arange(3)})
    assert sorted(os.listdir(stage)) == sorted(p.name for p in (alive, foreign, other))
    stale.write_bytes(b"again")  # the sweep runs once per folder and process...
    ep.get_db_type("native").write(f"{url}/n.1", {"v": np.arange(3)})
    assert stale.exists()
    assert fsspec_store.clean_stage_dir(str(stage)) == [str(stale)]  # ... or when asked


_KILLED = """
import os, signal, sys
import numpy as np
import epochal as ep
from epochal.storage.io import tuning
from epochal.storage.io.remote import fsspec_store
opts = {"endpoint_url": sys.argv[2], "key": "test", "secret": "test", "client_kwargs": {"region_name": "us-east-1"}}
fsspec_store.set_storage_options(sys.argv[1], opts)
tuning.UPLOAD_PART = 5 << 20  # 12 MiB: a multipart upload of 3 parts
from aiobotocore.client import AioBaseClient
real = AioBaseClient._make_api_call
async def killed(self, operation, params):
    if operation == "CompleteMultipartUpload":  # killed with every part sent, before the object exists
        os.kill(os.getpid(), signal.SIGKILL)
    return await real(self, operation, params)
AioBaseClient._make_api_call = killed
ep.get_db_type("native").write(sys.argv[1] + "/trainer_0.7", {"w": np.arange(12 << 20, dtype=np.uint8)})
"""


def _pending(url: str) -> list[str]:
    fs, root = filesystem_for(url)
    bucket, prefix, _ = fs.split_path(root + "/")
    return [u["Key"] for u in fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])]


@pytest.mark.slow
def test_a_process_killed_mid_upload_leaves_nothing_after_the_next_start(
    s3: dict[str, Any], stage: Path,
) -> None:
    url = f"s3://ckpts/killed-{secrets.token_hex(4)}/run"
    set_storage_options(url, s3)
    child = subprocess.run([sys.executable, "-c", _KILLED, url, s3["endpoint_url"]], env={**os.environ})
    assert child.returncode == -9
    assert _keys(url) == []  # S3 shows an object whole or not at all: nothing to see...
    assert [k.rsplit("/", 1)[-1] for k in _pending(url)] == ["trainer_0.7"]  # ... but its parts are stored
    assert [n.startswith("epochal-stage.") for n in os.listdir(stage)] == [True]
    h = ep.DirectoryMetadataHandler(storage_options=s3)
    h.set_params(url, "native", ["trainer_0"])
    h.acquire_lock()
    h.release_lock()
    assert _keys(url) == [] and _pending(url) == []  # the lease holder aborted the upload
    fsspec_store._swept.discard(str(stage))
    ep.get_db_type("native").write(f"{url}/trainer_0.8", {"w": np.arange(3)})  # this process's first stage here
    assert os.listdir(stage) == []
