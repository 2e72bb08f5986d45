"""Compare-and-swap on GCS (fake-gcs-server on 127.0.0.1, through gcsfs): generation
preconditions checked by the store, a get in one request, a store that refuses the
preconditions falling back, and a Checkpointer's save and restore at a gs:// URL.

fake-gcs-server checks ``ifGenerationMatch`` on uploads (0 and a generation) but ignores it on
DELETE: the delete tests check the object survives a stale delete (the generation compare
before the DELETE) and, separately, that the DELETE itself carries the precondition."""

from __future__ import annotations

import logging
import secrets
import threading
from typing import Any

import numpy as np
import pytest

pytest.importorskip("gcsfs", reason="the gcs extra is not installed")

import epochal as ep  # noqa: E402
from epochal.storage.io.remote import conditional  # noqa: E402
from epochal.storage.io.remote.fsspec_store import filesystem_for  # noqa: E402


@pytest.fixture
def url(gcs: dict[str, Any]) -> str:
    return f"gs://ckpts/cas-{secrets.token_hex(4)}/lease.json"


def _objects(url: str, gcs: dict[str, Any]) -> conditional.ConditionalObjects:
    objects = conditional.conditional_for(url, gcs)
    assert objects.atomic and objects.native == "gcs"
    return objects


def _stored(url: str, gcs: dict[str, Any]) -> tuple[bytes, str] | None:
    fs, path = filesystem_for(url, gcs)
    fs.invalidate_cache()
    if not fs.exists(path):
        return None
    return bytes(fs.cat_file(path)), str(fs.info(path)["generation"])


def _calls(objects: conditional.ConditionalObjects, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    seen: list[tuple[Any, ...]] = []
    real = objects.fs.call

    def call(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        seen.append((method, path, kwargs))
        return real(method, path, *args, **kwargs)

    monkeypatch.setattr(objects.fs, "call", call)
    return seen


def test_create_writes_only_when_absent_and_get_reads_bytes_and_generation_in_one_request(
    url: str, gcs: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    objects = _objects(url, gcs)
    assert objects.get(url) is None
    first = objects.create(url, b"first")
    assert first is not None and first.isdigit()
    assert objects.create(url, b"second") is None  # exists: the store said 412
    assert _stored(url, gcs) == (b"first", first)
    calls = _calls(objects, monkeypatch)
    got = objects.get(url)
    assert got is not None and got.data == b"first" and got.version == first
    assert len(calls) == 1 and calls[0][0] == "GET"


def test_replace_with_a_stale_generation_changes_nothing(url: str, gcs: dict[str, Any]) -> None:
    objects = _objects(url, gcs)
    g1 = objects.create(url, b"one")
    assert g1 is not None
    g2 = objects.replace(url, b"two", g1)
    assert g2 is not None and g2 != g1 and _stored(url, gcs) == (b"two", g2)
    assert objects.replace(url, b"three", g1) is None  # g1 is gone: 412
    assert _stored(url, gcs) == (b"two", g2)
    # a retried upload whose first answer was lost reads as 412: the same bytes are ours
    assert objects.replace(url, b"two", g1) == g2
    fs, path = filesystem_for(url, gcs)
    fs.rm_file(path)
    assert objects.replace(url, b"four", g2) is None and _stored(url, gcs) is None  # deleted meanwhile


def test_delete_with_a_stale_generation_leaves_the_object(
    url: str, gcs: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    objects = _objects(url, gcs)
    g1 = objects.create(url, b"one")
    assert g1 is not None
    g2 = objects.replace(url, b"two", g1)
    assert g2 is not None
    assert objects.delete(url, g1) is False
    assert _stored(url, gcs) == (b"two", g2)
    calls = _calls(objects, monkeypatch)
    assert objects.delete(url, g2) is True and _stored(url, gcs) is None
    deletes = [c for c in calls if c[0] == "DELETE"]
    assert len(deletes) == 1 and deletes[0][2].get("ifGenerationMatch") == g2  # the store checks it too
    assert objects.delete(url, g2) is False  # gone


@pytest.mark.parametrize("takers", [6])
def test_of_concurrent_replaces_of_one_generation_exactly_one_lands(
    url: str, gcs: dict[str, Any], takers: int,
) -> None:
    objects = _objects(url, gcs)
    g1 = objects.create(url, b"start")
    assert g1 is not None
    start = threading.Barrier(takers)
    out: list[str | None] = [None] * takers

    def take(i: int) -> None:
        mine = _objects(url, gcs)  # each thread its own gcsfs instance
        start.wait()
        out[i] = mine.replace(url, f"taker {i}".encode(), g1)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(takers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [i for i in range(takers) if out[i] is not None]
    assert len(won) == 1, out
    assert _stored(url, gcs) == (f"taker {won[0]}".encode(), out[won[0]])


def test_a_gcs_store_that_refuses_the_preconditions_falls_back_with_a_warning(
    url: str, gcs: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    from gcsfs.retry import HttpError

    objects = _objects(url, gcs)
    real = objects.fs.call

    def call(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        if "ifGenerationMatch" in kwargs:
            raise HttpError({"code": 501, "message": "ifGenerationMatch is not implemented"})
        return real(method, path, *args, **kwargs)

    monkeypatch.setattr(objects.fs, "call", call)
    with caplog.at_level(logging.WARNING, logger="epochal"):
        version = objects.create(url, b"one")
    assert "refuses conditional requests" in caplog.text and url in caplog.text
    assert not objects.atomic and version is not None and _stored(url, gcs) is not None
    assert objects.create(url, b"two") is None  # read-compare-write from now on
    got = objects.get(url)
    assert got is not None and got.data == b"one" and got.version == version
    assert objects.delete(url, version) is True and _stored(url, gcs) is None


def test_a_checkpointer_saves_and_restores_at_a_gs_url(gcs: dict[str, Any]) -> None:
    where = f"gs://ckpts/run-{secrets.token_hex(4)}"
    rng = np.random.default_rng(5)
    states = [{"w": rng.standard_normal((64, 33)).astype(np.float32), "b": rng.integers(0, 2**31, 1000)}
              for _ in range(2)]
    with ep.Checkpointer(where, storage_options=gcs, async_save=False) as cp:
        lease = conditional.conditional_for(f"{where}/.epochal/lease.json", gcs).get(f"{where}/.epochal/lease.json")
        assert lease is not None and b'"generation": 1' in lease.data  # the lease is held on GCS
        for step, state in enumerate(states):
            cp.save(step, state)
        assert cp.steps() == [0, 1]
    fs, path = filesystem_for(where, gcs)
    fs.invalidate_cache()
    assert not fs.exists(f"{path}/.epochal/lease.json")  # released at close
    state = {"w": np.zeros((64, 33), np.float32), "b": np.zeros(1000, np.int64)}
    with ep.Checkpointer(where, storage_options=gcs, async_save=False) as cp:
        assert cp.restore(state) == 1
    assert state["w"].tobytes() == states[1]["w"].tobytes() and state["b"].tobytes() == states[1]["b"].tobytes()
    with ep.Checkpointer(where, storage_options=gcs, async_save=False) as cp:
        assert cp.restore(state, step=0) == 0
    assert state["w"].tobytes() == states[0]["w"].tobytes() and state["b"].tobytes() == states[0]["b"].tobytes()


def test_a_missing_bucket_is_an_error_naming_the_url(gcs: dict[str, Any]) -> None:
    from epochal.errors import CheckpointNotFoundError

    url = f"gs://no-such-bucket-{secrets.token_hex(3)}/run/.epochal/lease.json"
    objects = _objects(url, gcs)
    assert objects.get(url) is None
    with pytest.raises(CheckpointNotFoundError) as e:
        objects.create(url, b"one")
    assert url in str(e.value) and "does the bucket exist" in str(e.value)


def test_without_the_generation_header_get_reads_the_bytes_of_the_generation_it_reports(
    url: str, gcs: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    objects = _objects(url, gcs)
    g1 = objects.create(url, b"one")
    assert g1 is not None
    real = objects.fs.call
    seen: list[str] = []

    def call(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        out = real(method, path, *args, **kwargs)
        if method == "GET" and "alt=media" in path:
            seen.append(path)
            headers, data = out
            return {k: v for k, v in headers.items() if k.lower() != "x-goog-generation"}, data
        return out

    monkeypatch.setattr(objects.fs, "call", call)
    got = objects.get(url)
    assert got is not None and (got.data, got.version) == (b"one", g1)
    assert len(seen) == 2 and f"generation={g1}" in seen[1]  # the bytes of exactly that generation
    g2 = objects.replace(url, b"two", got.version)
    assert g2 is not None and _stored(url, gcs) == (b"two", g2)
