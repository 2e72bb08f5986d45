"""One Location for local paths and URLs: location_for, its store and records,
and storage options that travel with the Location (steps, threads) instead of leaking
through a process-wide dict."""

from __future__ import annotations

import dataclasses
import os
import pickle
import secrets
import threading
from typing import Any

import numpy as np
import pytest

from epochal.checkpoint.location.records import LocalRecords, UrlRecords, records_for
from epochal.checkpoint.tasks.background import BackgroundSaver
from epochal.checkpoint.tasks.steps import DbExists, JoinSave, LoadBlobs, SaveBlobs, SnapshotAndSave
from epochal.execution.workspace import Workspace
from epochal.storage.io import seam
from epochal.storage.io.location import Location, location_for


def test_a_local_path_is_local(tmp_path: Any) -> None:
    loc = location_for(str(tmp_path / "run"), {"key": "ignored locally"})
    assert loc.is_local and not loc.is_url and loc.scheme == ""
    assert loc.root == str(tmp_path / "run")
    assert loc.storage_options == {}
    assert loc.join("a", "n.0") == os.path.join(str(tmp_path / "run"), "a", "n.0")
    assert loc.store() is seam.store_for(str(tmp_path))  # the process's local store
    assert isinstance(records_for(loc), LocalRecords)
    assert location_for("").root == "."
    with pytest.raises(ValueError, match="local path"):
        loc.filesystem()


@pytest.mark.parametrize("url, root", [
    ("file:///tmp/run", "/tmp/run"),
    ("file://localhost/tmp/run", "/tmp/run"),
    ("file://rel/run", "rel/run"),
])
def test_a_file_url_is_its_local_path(url: str, root: str) -> None:
    loc = location_for(url, {"anon": True})
    assert loc.is_local and loc.scheme == "" and loc.root == root and loc.storage_options == {}
    assert loc.join("n.0") == os.path.join(root, "n.0")
    assert not seam.is_url(url) and seam.url_scheme(url) == ""


def test_an_s3_url_carries_its_scheme_root_and_a_copy_of_its_options() -> None:
    opts: dict[str, Any] = {"endpoint_url": "http://127.0.0.1:9", "client_kwargs": {"region_name": "x"}}
    loc = location_for("s3://bucket/run/", opts)
    opts["endpoint_url"] = "changed later"
    assert loc.is_url and not loc.is_local and loc.scheme == "s3"
    assert loc.root == "s3://bucket/run"
    assert loc.storage_options["endpoint_url"] == "http://127.0.0.1:9"
    assert loc.join("trainer_0.3") == "s3://bucket/run/trainer_0.3"
    assert loc.join(".epochal/", "/manifest.3.json") == "s3://bucket/run/.epochal/manifest.3.json"
    assert loc.join() == "s3://bucket/run"
    assert seam.url_scheme("s3://bucket/run") == "s3" and seam.is_url("s3://bucket")
    with pytest.raises(dataclasses.FrozenInstanceError):
        loc.root = "s3://other"  # type: ignore[misc]
    back = pickle.loads(pickle.dumps(loc))  # steps carry it to a node's process
    assert back == loc and back.storage_options == loc.storage_options
    assert location_for(loc) is loc  # a Location given is taken as it is
    assert location_for(Location("s3://b", "s3"), {"k": 1}).storage_options == {"k": 1}


def test_a_memory_url_store_writes_and_reads_with_its_options() -> None:
    pytest.importorskip("fsspec")
    from epochal.storage.io.remote.fsspec_store import FsspecStore

    assert location_for("memory://").root == "memory://"
    assert location_for("memory://").join("a", "b") == "memory://a/b"
    loc = location_for(f"memory://loc-{secrets.token_hex(4)}/run", {"tag": "mine"})
    store = loc.store()
    assert isinstance(store, FsspecStore) and store.storage_options == {"tag": "mine"}
    path = loc.join("n.0")
    with seam.committed(store.create(path, 5)) as sink:
        sink.write(b"hello")
    assert store.exists(path)
    src = store.open_read(path)
    assert src.read(5, 0) == b"hello"
    assert src.fs.storage_options == {"tag": "mine"}  # type: ignore[attr-defined]
    fs, inner = loc.filesystem(path)
    assert fs.storage_options == {"tag": "mine"} and bytes(fs.cat_file(inner)) == b"hello"


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every (url, storage options) fsspec is asked to open, in order."""
    fsspec = pytest.importorskip("fsspec")
    calls: list[tuple[str, dict[str, Any]]] = []
    real = fsspec.core.url_to_fs

    def url_to_fs(url: str, **options: Any) -> Any:
        calls.append((url, dict(options)))
        return real(url, **options)

    monkeypatch.setattr(fsspec.core, "url_to_fs", url_to_fs)
    return calls


def _tags(calls: list[tuple[str, dict[str, Any]]]) -> set[Any]:
    return {o.get("tag") for _, o in calls}


def test_two_steps_with_different_options_at_one_url_do_not_leak(seen: list[tuple[str, dict[str, Any]]]) -> None:
    """Steps carry their options: a save with options A, then steps at the same URL with
    none and with options B, each reach the store with their own (a process-wide dict, as
    before, handed A to the step that had none)."""
    run = f"memory://leak-{secrets.token_hex(4)}/run"
    db = f"{run}/trainer.0"
    ws = Workspace()
    ws["w"] = np.arange(6, dtype=np.float32)
    result = SaveBlobs(db, "native", ["w"], node="trainer", epoch=0, storage_options={"tag": "a"}).run(ws)
    assert result.nbytes > 0 and result.digest
    assert seen and _tags(seen) == {"a"}

    seen.clear()
    out = Workspace()
    DbExists(db, "native", "there")(out)  # no options: fsspec's own, not A's
    assert bool(out["there"]) is True
    assert seen and _tags(seen) == {None}
    assert all(o == {} for _, o in seen)

    seen.clear()
    out["w"] = np.zeros(6, dtype=np.float32)
    LoadBlobs(db, "native", ["w"], node="trainer", epoch=0, storage_options={"tag": "b"})(out)
    assert np.array_equal(out["w"], ws["w"])
    assert seen and _tags(seen) == {"b"}


def test_a_background_save_writes_with_its_steps_options(seen: list[tuple[str, dict[str, Any]]]) -> None:
    db = f"memory://bg-{secrets.token_hex(4)}/run/trainer.0"
    ws = Workspace()
    ws["w"] = np.arange(1000, dtype=np.int64)
    saver = BackgroundSaver()
    try:
        SnapshotAndSave(db, "native", ["w"], node="trainer", epoch=0, storage_options={"tag": "bg"},
                        saver=saver).run(ws)
        done = JoinSave(db, "", "", saver=saver, storage_options={"tag": "bg"}).join()
    finally:
        saver.close()
    assert done.nbytes > 0 and done.digest
    writes = [o for url, o in seen if url.startswith(db)]
    assert writes and all(o == {"tag": "bg"} for o in writes)  # the saver's thread too


def test_active_locations_in_two_threads_keep_their_own_options() -> None:
    pytest.importorskip("fsspec")
    from epochal.storage.io.remote.fsspec_store import storage_options_for

    url = f"memory://threads-{secrets.token_hex(4)}/run"
    both = threading.Barrier(2)
    got: dict[str, Any] = {}

    def use(tag: str) -> None:
        with location_for(url, {"tag": tag}).active():
            both.wait(timeout=10)
            src_store = seam.store_for(f"{url}/x")
            got[tag] = (storage_options_for(f"{url}/x"), getattr(src_store, "storage_options", "?"))
            both.wait(timeout=10)

    threads = [threading.Thread(target=use, args=(t,)) for t in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got["a"][0] == {"tag": "a"} and got["b"][0] == {"tag": "b"}
    assert storage_options_for(f"{url}/x") == {}  # nothing left behind for the process


def test_url_records_carry_their_locations_options(seen: list[tuple[str, dict[str, Any]]]) -> None:
    loc = location_for(f"memory://rec-{secrets.token_hex(4)}/run", {"tag": "rec"})
    records = records_for(loc)
    assert isinstance(records, UrlRecords) and records.remote
    path = loc.join(".epochal", "pins.json")
    records.write(path, b"[]")
    assert records.read(path) == b"[]"
    assert seen and all(o == {"tag": "rec"} for _, o in seen)
