"""The fsspec byte store: URLs behind the seam (ranged reads, staged writes, options)."""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fsspec", reason="the s3 extra is not installed")

from epochal.errors import CheckpointNotFoundError  # noqa: E402
from epochal.storage.formats.base import get_db_type  # noqa: E402
from epochal.storage.io import tuning  # noqa: E402
from epochal.storage.io.remote import fsspec_store  # noqa: E402
from epochal.storage.io.seam import store_for  # noqa: E402


def _url(name: str = "db.0") -> str:
    return f"memory://store-{secrets.token_hex(4)}/run/{name}"


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every byte range any fsspec source asked of its store, as lengths (those fetched
    ahead by an open included)."""
    asked: list[int] = []
    real = fsspec_store.FsspecSource._fetch

    def fetch(self: Any, starts: list[int], ends: list[int]) -> list[bytes]:
        got = real(self, starts, ends)
        asked.extend(len(b) for b in got)
        return got

    monkeypatch.setattr(fsspec_store.FsspecSource, "_fetch", fetch)
    return asked


@pytest.mark.parametrize("db_type", ["native", "safetensors"])
def test_partial_load_reads_only_the_index_and_its_ranges(db_type: str, counted: list[int]) -> None:
    backend = get_db_type(db_type)
    url = _url()
    big = np.random.default_rng(1).standard_normal(1_000_000)  # 8 MB
    small = np.arange(16, dtype=np.int32)
    size = backend.write(url, {"big": big, "small": small, "step": 7})
    counted.clear()
    got = backend.read(url, ["small", "step"])
    assert got["small"].tobytes() == small.tobytes() and got["step"] == 7
    # the header, the tail fetched with it (the index), two tiny ranges: not the 8 MB
    assert 0 < sum(counted) < tuning.REMOTE_TAIL + 64 * 1024, counted
    counted.clear()
    full = backend.read(url)
    assert full["big"].tobytes() == big.tobytes()
    assert size <= sum(counted) < size + 64 * 1024


def test_staged_write_leaves_no_temp_keys_and_abort_keeps_the_old_object() -> None:
    url = _url()
    store = store_for(url)
    assert isinstance(store, fsspec_store.FsspecStore)
    backend = get_db_type("native")
    backend.write(url, {"v": np.arange(3)})
    before = store.open_read(url).read(1 << 20, 0)
    sink = store.create(url, 10)
    sink.write(b"0123456789")
    sink.abort()
    fs, path = fsspec_store.filesystem_for(url)
    folder = path.rsplit("/", 1)[0]
    assert [k.rsplit("/", 1)[-1] for k in fs.find(folder)] == ["db.0"]
    assert bytes(fs.cat_file(path)) == before
    sink = store.create(url)
    sink.write([b"abc", b"defg"])
    sink.patch(0, b"X")
    sink.commit()
    assert bytes(fs.cat_file(path)) == b"Xbcdefg"
    assert [k.rsplit("/", 1)[-1] for k in fs.find(folder)] == ["db.0"]


def test_missing_object_is_named() -> None:
    url = _url("absent.3")
    with pytest.raises(CheckpointNotFoundError) as e:
        get_db_type("native").read(url)
    assert url in str(e.value)
    assert not store_for(url).exists(url)


def test_options_by_longest_prefix() -> None:
    fsspec_store.set_storage_options("s3://b", {"key": "a"})
    fsspec_store.set_storage_options("s3://b/run", {"key": "b"})
    try:
        assert fsspec_store.storage_options_for("s3://b/run/x.0") == {"key": "b"}
        assert fsspec_store.storage_options_for("s3://b/other/x.0") == {"key": "a"}
        assert fsspec_store.storage_options_for("s3://b2/x.0") == {}
        assert fsspec_store.storage_options_for("s3://b/runner/x.0") == {"key": "a"}
    finally:
        fsspec_store.set_storage_options("s3://b", None)
        fsspec_store.set_storage_options("s3://b/run", None)
    assert fsspec_store.storage_options_for("s3://b/run/x.0") == {}


def test_s3_through_fsspec_environment(s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """No storage_options at all: fsspec's own configuration (env vars) reaches the server."""
    for prefix in list(fsspec_store._options):  # none recorded for this URL by earlier tests
        monkeypatch.delitem(fsspec_store._options, prefix)
    monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", s3["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    import fsspec.config

    monkeypatch.setattr(fsspec.config, "conf", {})
    fsspec.config.set_conf_env(fsspec.config.conf)
    url = f"s3://ckpts/env-{secrets.token_hex(4)}/n.0"
    get_db_type("native").write(url, {"w": np.arange(5.0)})
    assert get_db_type("native").read(url)["w"].tolist() == [0, 1, 2, 3, 4]
