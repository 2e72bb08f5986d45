"""The cost of a commit at a URL does not grow with the number of committed steps (requests
counted at the S3 seam, moto on 127.0.0.1), retention through the lease holder's remembered
records deletes exactly what it did before, never a step committed behind its back, and the
tools read a URL's records in parallel with the same answers."""

from __future__ import annotations

import secrets
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("s3fs", reason="s3fs is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _requests import count_requests  # noqa: E402

import epochal as ep  # noqa: E402
from epochal.checkpoint.handler.metadata import DbReport  # noqa: E402
from epochal.checkpoint.location.manifest import DbEntry, Manifest  # noqa: E402
from epochal.checkpoint.location.record_cache import CachedRecords  # noqa: E402
from epochal.checkpoint.location.records import UrlRecords  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.storage.io.remote.fsspec_store import filesystem_for, set_storage_options  # noqa: E402

NODE = "n"


def _url(s3: dict[str, Any]) -> str:
    url = f"s3://ckpts/cost-{secrets.token_hex(4)}/run"
    set_storage_options(url, s3)
    return url


def _db() -> tuple[bytes, str]:
    url = f"memory://cost-{secrets.token_hex(4)}/probe.0"
    backend = ep.get_db_type("native")
    backend.write(url, {"w": np.arange(8, dtype=np.float32)})
    fs, path = filesystem_for(url)
    return bytes(fs.cat_file(path)), str(backend.digest(url))


def _fill(url: str, steps: range, data: bytes, digest: str) -> None:
    fs, root = filesystem_for(url)
    batch = {}
    for e in steps:
        batch[f"{root}/{NODE}.{e}"] = data
        batch[f"{root}/.epochal/manifest.{e}.json"] = Manifest(
            epoch=e, db_type="native", created="2026-12-02T00:00:00.000+00:00",
            nodes={NODE: DbEntry(f"{NODE}.{e}", len(data), digest)}).encode()
    fs.pipe(batch)
    fs.invalidate_cache()


def _commit(h: ep.DirectoryMetadataHandler, url: str, step: int, data: bytes, digest: str) -> None:
    fs, root = filesystem_for(url)
    fs.pipe_file(f"{root}/{NODE}.{step}", data)  # the node's save
    h.cp_accessible()
    h.report_dbs(step, {NODE: DbReport(len(data), digest)})
    h.write(step)


def _steady_commit_requests(s3: dict[str, Any], steps: int, **policy: Any) -> tuple[int, dict[str, int]]:
    url = _url(s3)
    data, digest = _db()
    _fill(url, range(steps), data, digest)
    h = ep.DirectoryMetadataHandler(storage_options=s3, **policy)
    h.set_params(url, "native", [NODE])
    h.acquire_lock()
    try:
        assert h.resume_epoch() == steps - 1
        _commit(h, url, steps, data, digest)  # the first commit reads what it needs once
        counts = []
        for k in (1, 2):
            with count_requests(exclude=("lease.json",)) as n:  # background renewals aside
                _commit(h, url, steps + k, data, digest)
            counts.append((n.total, dict(n.by_method)))
    finally:
        h.release_lock()
    assert counts[0][0] == counts[1][0], counts
    return counts[1]


def test_requests_per_commit_do_not_grow_with_the_steps(s3: dict[str, Any]) -> None:
    # keep_every=1: retention runs at every commit and keeps every step, so it looks at all
    few, few_by = _steady_commit_requests(s3, 5, keep_last=2, keep_every=1)
    many, many_by = _steady_commit_requests(s3, 200, keep_last=2, keep_every=1)
    assert few == many, (few_by, many_by)
    # the node's PUT, the manifest PUT, one pins GET (the fences are lease.json: excluded)
    assert many_by == {"put_object": 2, "get_object": 1}, many_by


def _parses_per_commit(s3: dict[str, Any], steps: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """(manifests parsed, db names split) by a steady commit at ``steps`` steps, retention
    looking at every step (keep_every=1)."""
    from epochal.checkpoint.location import view

    parsed, split = [0], [0]
    real_decode, real_split = view.decode_manifest, view.split_db_file

    def decode(*a: Any, **k: Any) -> Any:
        parsed[0] += 1
        return real_decode(*a, **k)

    def split_name(*a: Any, **k: Any) -> Any:
        split[0] += 1
        return real_split(*a, **k)

    monkeypatch.setattr(view, "decode_manifest", decode)
    monkeypatch.setattr(view, "split_db_file", split_name)
    url = _url(s3)
    data, digest = _db()
    _fill(url, range(steps), data, digest)
    h = ep.DirectoryMetadataHandler(storage_options=s3, keep_last=2, keep_every=1)
    h.set_params(url, "native", [NODE])
    h.acquire_lock()
    try:
        h.resume_epoch()
        _commit(h, url, steps, data, digest)  # the first commit parses every manifest once
        counts = []
        for k in (1, 2):
            parsed[0] = split[0] = 0
            _commit(h, url, steps + k, data, digest)
            counts.append((parsed[0], split[0]))
    finally:
        h.release_lock()
        monkeypatch.undo()
    assert counts[0] == counts[1], counts
    return counts[1]


def test_retention_cpu_per_commit_does_not_grow_with_the_steps(
    s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each manifest is parsed once per handler and each db name split once (the bytes of a
    manifest read again unchanged are not parsed again), so a commit's work is the same at N
    and 2N steps: counted, not timed."""
    few = _parses_per_commit(s3, 40, monkeypatch)
    many = _parses_per_commit(s3, 80, monkeypatch)
    assert few == many, (few, many)
    parsed, split = many
    assert parsed <= 1 and split <= 2, many  # the new step's manifest; its db's name


def test_a_dropping_policy_costs_its_deletes_only(s3: dict[str, Any]) -> None:
    total, by = _steady_commit_requests(s3, 100, keep_last=3)
    # one step dropped per commit: its manifest and its db deleted, nothing listed or re-read
    assert by == {"put_object": 2, "get_object": 1, "delete_object": 2}, by


def test_retention_through_remembered_records_deletes_what_it_did_before(s3: dict[str, Any]) -> None:
    url = _url(s3)
    data, digest = _db()
    _fill(url, range(6), data, digest)
    fs, root = filesystem_for(url)
    fs.pipe_file(f"{root}/{NODE}.2", data)  # (already there) and an uncommitted older db:
    fs.rm_file(f"{root}/.epochal/manifest.3.json")  # step 3's save never committed
    h = ep.DirectoryMetadataHandler(storage_options=s3, keep_last=2, keep_every=4)
    h.set_params(url, "native", [NODE])
    h.acquire_lock()
    try:
        assert isinstance(h.directory.records, CachedRecords)  # type: ignore[union-attr]
        assert h.resume_epoch() == 5
        for step in (6, 7, 8):
            _commit(h, url, step, data, digest)
        # a step committed behind the cache's back (a foreign writer: never trusted to be absent)
        fs.pipe_file(f"{root}/.epochal/manifest.3.json", Manifest(
            epoch=3, db_type="native", nodes={NODE: DbEntry(f"{NODE}.3", len(data), digest)}).encode())
        fs.pipe_file(f"{root}/{NODE}.3", data)
        _commit(h, url, 9, data, digest)
    finally:
        h.release_lock()
    assert not isinstance(h.directory.records, CachedRecords)  # type: ignore[union-attr]
    fs.invalidate_cache()
    d = CheckpointDirectory(url)
    assert d.committed_epochs() == [0, 3, 4, 8, 9]  # keep_every=4, the last 2, and the foreign 3
    assert sorted(d.scan()) == [0, 3, 4, 8, 9]  # dbs of dropped steps gone, step 3's kept


def test_an_uncommitted_db_listed_earlier_is_kept_once_its_manifest_exists(s3: dict[str, Any]) -> None:
    url = _url(s3)
    data, digest = _db()
    _fill(url, range(3), data, digest)
    fs, root = filesystem_for(url)
    fs.pipe_file(f"{root}/{NODE}.3", data)  # listed as an uncommitted db of step 3 ...
    h = ep.DirectoryMetadataHandler(storage_options=s3, keep_last=10)
    h.set_params(url, "native", [NODE])
    h.acquire_lock()
    try:
        assert h.resume_epoch() == 2
        h.directory.scan()  # type: ignore[union-attr]  # the listing is remembered now
        fs.pipe_file(f"{root}/.epochal/manifest.3.json", Manifest(  # ... then committed elsewhere
            epoch=3, db_type="native", nodes={NODE: DbEntry(f"{NODE}.3", len(data), digest)}).encode())
        _commit(h, url, 4, data, digest)
    finally:
        h.release_lock()
    fs.invalidate_cache()
    assert fs.exists(f"{root}/{NODE}.3")  # asked afresh before deleting: kept


def test_tools_read_a_urls_records_in_parallel_with_the_same_answers(s3: dict[str, Any]) -> None:
    from epochal.cli.records import list_prefix, stats_prefix, verify_target

    url = _url(s3)
    data, digest = _db()
    _fill(url, range(40), data, digest)
    d = CheckpointDirectory(url)
    for e in range(3):
        d.records.add_stats(d.records_dir, b'{"action": "checkpoint_save", "epoch": %d, "node": "n", "ns": 5}\n' % e)
    fs, root = filesystem_for(url)
    fs.pipe_file(f"{root}/.epochal/manifest.40.json", b"{damaged")
    threads: set[str] = set()
    real = UrlRecords.read

    def read(self: Any, path: str) -> bytes:
        threads.add(threading.current_thread().name)
        return real(self, path)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(UrlRecords, "read", read)
        with count_requests() as n:
            listing = list_prefix(url)
    assert [e["epoch"] for e in listing["epochs"]] == list(range(40))
    assert all(f["present"] and f["size"] == len(data) == f["recorded_size"]
               for e in listing["epochs"] for f in e["files"].values())
    assert len(threads) > 1  # in parallel
    # a listing of each folder, each manifest read once (41) and the pins; no request per db
    assert n.by_method == {"list_objects_v2": 2, "get_object": 42}, n.by_method
    stats = stats_prefix(url)
    assert sorted(r["epoch"] for r in stats["records"]) == [0, 1, 2]
    fs.pipe_file(f"{root}/{NODE}.7", data[:-1])  # truncated
    result = verify_target(url)
    assert result["ok"] is False
    bad = {e["epoch"]: e["problems"] for e in result["epochs"] if not e["ok"]}
    assert sorted(bad) == [7, 40] and f"{url}/{NODE}.7" in bad[7][0] and "damaged" in bad[40][0]
    assert [f["path"] for f in result["files"] if not f["ok"]] == [f"{url}/{NODE}.7"]


def test_a_record_is_one_get_and_an_empty_one_reads_as_empty(s3: dict[str, Any]) -> None:
    url = _url(s3)
    fs, root = filesystem_for(url)
    fs.pipe_file(f"{root}/.epochal/manifest.0.json", b"")
    fs.pipe_file(f"{root}/.epochal/pins.json", b'{"epochs": [3]}')
    records = UrlRecords()
    with count_requests() as n:
        assert records.read(f"{url}/.epochal/pins.json") == b'{"epochs": [3]}'
    assert dict(n.by_method) == {"get_object": 1}
    assert records.read(f"{url}/.epochal/manifest.0.json") == b""
    with pytest.raises(ep.CheckpointCorruptError, match="not valid JSON"):
        CheckpointDirectory(url).manifest(0)
    with pytest.raises(FileNotFoundError):
        records.read(f"{url}/.epochal/manifest.1.json")


@pytest.mark.system  # (hundreds of objects on the moto server; the CLI)
def test_opening_and_restoring_costs_the_same_requests_whatever_the_history(s3: dict[str, Any]) -> None:
    """A Checkpointer at a URL of 20 or 200 committed steps: its construction reads the newest
    manifest only (not every one), and the restore of the newest step costs the same too."""
    data, digest = _db()
    counts = []
    for steps in (20, 200):
        url = _url(s3)
        fs, root = filesystem_for(url)
        batch = {}
        for e in range(steps):
            batch[f"{root}/local.{e}"] = data
            batch[f"{root}/.epochal/manifest.{e}.json"] = Manifest(
                epoch=e, db_type="native", created="2026-12-02T00:00:00.000+00:00",
                nodes={"local": DbEntry(f"local.{e}", len(data), digest)}).encode()
        fs.pipe(batch)
        fs.invalidate_cache()
        with count_requests() as n:
            ck = ep.Checkpointer(url, storage_options=s3)
            opened = n.total
            state = {"w": np.zeros(8, dtype=np.float32)}
            assert ck.restore(state) == steps - 1
            counts.append((opened, n.total - opened))
        ck.close()
        assert state["w"].tolist() == list(range(8))
    assert counts[0] == counts[1], counts
    assert counts[0][0] <= 12, counts  # listing pages, the newest manifest, the lease


@pytest.mark.system  # (hundreds of objects on the moto server; the CLI)
def test_the_first_commit_reads_what_retention_decides_on_not_the_history(s3: dict[str, Any]) -> None:
    """keep_last=3, keep_every=1 (every step kept): the first commit of a job over 20 or 200
    committed steps makes the same requests (the newest manifests keep_last counts, none of
    the older ones keep_every keeps anyway)."""
    data, digest = _db()
    counts = []
    for steps in (20, 200):
        url = _url(s3)
        _fill(url, range(steps), data, digest)
        h = ep.DirectoryMetadataHandler(keep_last=3, keep_every=1, storage_options=s3)
        h.set_params(url, "native", [NODE])
        h.acquire_lock()
        assert h.resume_epoch() == steps - 1
        with count_requests() as n:
            _commit(h, url, steps, data, digest)
        counts.append(n.total)
        h.release_lock()
        assert CheckpointDirectory(url).committed_epochs() == list(range(steps + 1))
    assert counts[0] == counts[1] and counts[0] <= 12, counts


@pytest.mark.system  # (hundreds of objects on the moto server; the CLI)
def test_ls_shows_the_newest_epochs_reading_their_records_only(s3: dict[str, Any]) -> None:
    import json
    import subprocess

    data, digest = _db()
    url = _url(s3)
    _fill(url, range(60), data, digest)
    from epochal.cli.records import list_prefix

    with count_requests() as n:
        got = list_prefix(url, 20)
    assert [e["epoch"] for e in got["epochs"]] == list(range(40, 60)) and got["older"] == 40
    assert all(e["state"] == "committed" for e in got["epochs"])
    assert n.by_method.get("get_object", 0) <= 21  # the shown epochs' manifests and the pins, not all 60
    opts = [a for k, v in s3.items() if isinstance(v, str) for a in ("-o", f"{k}={v}")]
    out = subprocess.run([sys.executable, "-m", "epochal", "ls", *opts, url, "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["older"] == 40
    out = subprocess.run([sys.executable, "-m", "epochal", "ls", *opts, url, "--all", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert len(json.loads(out.stdout)["epochs"]) == 60 and json.loads(out.stdout)["older"] == 0
