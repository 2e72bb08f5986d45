"""A long history costs a restart nothing: opening a location, restoring its newest step and
the first commit (retention with ``keep_last``, ``keep_every`` and ``keep_best``) make the same
requests at 50 and at 500 committed steps, on S3 (moto on 127.0.0.1, requests counted at the
S3 seam) and on a local disk (record-store calls counted); the metrics index that
``keep_best`` ranks by is a cache the manifests rebuild; ``epochal ls`` shows the newest 20
steps and reads only their manifests."""

from __future__ import annotations

import json
import secrets
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import epochal as ep  # noqa: E402
from epochal.checkpoint.handler.metadata import DbReport  # noqa: E402
from epochal.checkpoint.location.manifest import DbEntry, KeepBest, Manifest  # noqa: E402
from epochal.checkpoint.location.records import LocalRecords  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.storage.io.remote.fsspec_store import filesystem_for, set_storage_options  # noqa: E402

NODE = "local"  # the Checkpointer's node
POLICY: dict[str, Any] = {"keep_last": 3, "keep_every": 10, "keep_best": 3, "metric": "loss"}
W = np.arange(8, dtype=np.float32)
INDEX_FILE = "index.json"  # .epochal/index.json: the metrics index


def _db() -> tuple[bytes, str]:
    url = f"memory://history-{secrets.token_hex(4)}/probe.0"
    backend = ep.get_db_type("native")
    backend.write(url, {"w": W})
    fs, path = filesystem_for(url)
    return bytes(fs.cat_file(path)), str(backend.digest(url))


def _loss(e: int) -> float:
    """Scattered values: the best steps are old ones, spread over the history."""
    return round((e * 7919 % 997) / 997, 6)


def _history(steps: int) -> list[int]:
    """``steps`` committed steps as a job with ``POLICY`` leaves them: every 10th, then the
    last three (never among the best: a loss of 9)."""
    last = 10 * (steps - 4)
    return [*range(0, last + 1, 10), last + 1, last + 2, last + 3]


def _fill(root: str, put: Callable[[dict[str, bytes]], None], steps: int) -> tuple[bytes, str, int]:
    """Lay out ``_history(steps)`` under ``root`` (no metrics index: a location an older
    epochal wrote); the db bytes, digest and the newest step."""
    data, digest = _db()
    batch = {}
    epochs = _history(steps)
    for e in epochs:
        loss = 9.0 if e > epochs[-4] else _loss(e)
        batch[f"{root}/{NODE}.{e}"] = data
        batch[f"{root}/.epochal/manifest.{e}.json"] = Manifest(
            epoch=e, db_type="native", created="2026-12-02T00:00:00.000+00:00",
            nodes={NODE: DbEntry(f"{NODE}.{e}", len(data), digest)}, metrics={"loss": loss},
            keep_best=KeepBest(3, "loss", "min")).encode()
    put(batch)
    return data, digest, epochs[-1]


def _commit(h: ep.DirectoryMetadataHandler, put: Callable[[dict[str, bytes]], None], root: str, step: int,
            data: bytes, digest: str) -> None:
    put({f"{root}/{NODE}.{step}": data})  # the node's save
    h.cp_accessible()
    h.report_dbs(step, {NODE: DbReport(len(data), digest)})
    h.write(step, metrics={"loss": 9.0})


def _costs(where: str, opts: dict[str, Any] | None, put: Callable[[dict[str, bytes]], None], root: str,
           steps: int, counting: Callable[[], Any]) -> dict[str, Any]:
    """What open, restore and the first commit cost at ``steps`` committed steps, after a
    first run wrote the metrics index (its first commit reads every manifest once)."""
    data, digest, newest = _fill(root, put, steps)
    h = ep.DirectoryMetadataHandler(storage_options=opts, **POLICY)
    h.set_params(where, "native", [NODE])
    h.acquire_lock()
    _commit(h, put, root, newest + 1, data, digest)  # the index is built here, once
    h.release_lock()
    got: dict[str, Any] = {}
    with counting() as n:
        ck = ep.Checkpointer(where, storage_options=opts)
    got["open"] = dict(n)
    try:
        state = {"w": np.zeros(8, dtype=np.float32)}
        with counting() as n:
            assert ck.restore(state) == newest + 1
        got["restore"] = dict(n)
        assert state["w"].tobytes() == W.tobytes()
    finally:
        ck.close()
    h = ep.DirectoryMetadataHandler(storage_options=opts, **POLICY)
    h.set_params(where, "native", [NODE])
    h.acquire_lock()
    try:
        assert h.resume_epoch() == newest + 1
        with counting() as n:
            _commit(h, put, root, newest + 2, data, digest)
        got["first commit"] = dict(n)
    finally:
        h.release_lock()
    kept = CheckpointDirectory(where, storage_options=opts).committed_epochs()
    epochs = _history(steps)
    # every 10th (the best three among them) and the last three: newest - 2 and newest - 1
    # (a loss of 9) went, one at each commit
    assert kept == sorted({*epochs[:-3], newest, newest + 1, newest + 2}), kept[-6:]
    return got


# -- on S3


@contextmanager
def _s3_requests() -> Iterator[Counter[str]]:
    from _requests import count_requests

    with count_requests(exclude=("lease.json",)) as n:  # (a lease renewal's timing aside)
        counts: Counter[str] = Counter()
        yield counts
    counts.update(n.by_method)


def _s3_location(s3: dict[str, Any]) -> tuple[str, str, Callable[[dict[str, bytes]], None]]:
    url = f"s3://ckpts/history-{secrets.token_hex(4)}/run"
    set_storage_options(url, s3)
    fs, root = filesystem_for(url)

    def put(batch: dict[str, bytes]) -> None:
        fs.pipe(batch)
        fs.invalidate_cache()

    return url, root, put


@pytest.mark.system
def test_open_restore_and_first_commit_cost_the_same_requests_at_50_and_500_steps_on_s3(s3: dict[str, Any]) -> None:
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    costs = {}
    for steps in (50, 500):
        url, root, put = _s3_location(s3)
        costs[steps] = _costs(url, s3, put, root, steps, _s3_requests)
    assert costs[50] == costs[500], costs
    few = costs[50]
    # open: no manifest but the newest is read (the lease and a listing of each folder aside)
    assert few["open"].get("get_object", 0) <= 3, few
    assert sum(few["open"].values()) <= 12 and sum(few["restore"].values()) <= 12, few
    # first commit: the newest three, the best three, the one dropped, the pins and the index
    assert few["first commit"].get("get_object", 0) <= 9, few
    assert few["first commit"].get("delete_object") == 2, few  # newest - 1: its manifest and db


# -- on a local disk


@contextmanager
def _record_calls() -> Iterator[Counter[str]]:
    """Count every call to the local record store (reads, writes, listings, sizes)."""
    counts: Counter[str] = Counter()
    names = ("read", "write", "delete", "exists", "size", "files", "add_stats", "read_stats")
    real = {name: getattr(LocalRecords, name) for name in names}

    def counted(name: str) -> Callable[..., Any]:
        def call(self: Any, *a: Any, **k: Any) -> Any:
            counts[name] += 1
            return real[name](self, *a, **k)
        return call

    with pytest.MonkeyPatch.context() as m:
        for name in names:
            m.setattr(LocalRecords, name, counted(name))
        yield counts


def _local_location(tmp_path: Path) -> tuple[str, str, Callable[[dict[str, bytes]], None]]:
    root = tmp_path / "run"
    (root / ".epochal").mkdir(parents=True)

    def put(batch: dict[str, bytes]) -> None:
        for path, data in batch.items():
            Path(path).write_bytes(data)

    return str(root), str(root), put


def test_open_restore_and_first_commit_cost_the_same_store_calls_at_50_and_500_steps_on_disk(tmp_path: Path) -> None:
    costs = {}
    for steps in (50, 500):
        where, root, put = _local_location(tmp_path / str(steps))
        costs[steps] = _costs(where, None, put, root, steps, _record_calls)
    assert costs[50] == costs[500], costs
    few = costs[50]
    assert few["open"].get("read", 0) <= 3 and few["first commit"].get("read", 0) <= 10, few


# -- the metrics index


def _ranked_location(tmp_path: Path) -> tuple[ep.DirectoryMetadataHandler, str, bytes, str]:
    where, root, put = _local_location(tmp_path)
    data, digest, newest = _fill(root, put, 30)
    h = ep.DirectoryMetadataHandler(**POLICY)
    h.set_params(where, "native", [NODE])
    h.acquire_lock()
    _commit(h, put, root, newest + 1, data, digest)
    return h, root, data, digest


def _index(root: str) -> dict[int, dict[str, Any]] | None:
    from epochal.checkpoint.location.index import decode_index

    return decode_index((Path(root) / ".epochal" / INDEX_FILE).read_bytes())


def _expected_index(root: str) -> dict[int, dict[str, Any]]:
    d = CheckpointDirectory(root)
    return {e: d.read_manifest(e).metrics for e in d.committed_epochs()}


def test_keep_best_commits_keep_the_index_equal_to_the_manifests(tmp_path: Path) -> None:
    h, root, data, digest = _ranked_location(tmp_path)
    try:
        assert _index(root) == _expected_index(root)
        step = _next_commit(h, root, data, digest, 0.0)  # a new best
        assert _index(root) == _expected_index(root)
        assert _index(root)[step] == {"loss": 0.0}  # type: ignore[index]
    finally:
        h.release_lock()


def _next_commit(h: ep.DirectoryMetadataHandler, root: str, data: bytes, digest: str, loss: float) -> int:
    step = max(CheckpointDirectory(root).manifest_epochs()) + 1
    Path(f"{root}/{NODE}.{step}").write_bytes(data)
    h.report_dbs(step, {NODE: DbReport(len(data), digest)})
    h.write(step, metrics={"loss": loss})
    return step


def _best_three(root: str) -> list[int]:
    d = CheckpointDirectory(root)
    ranked = sorted(d.committed_epochs(), key=lambda e: (d.read_manifest(e).metrics["loss"], e))
    return ranked[:3]


@pytest.mark.parametrize("damage", [b"{not json", b"", b'{"format": "epochal-index", "version": 1, "epochs": [1]}',
                                    b'{"format": "other", "version": 1, "epochs": {}}'])
def test_a_damaged_index_is_rebuilt_from_the_manifests(tmp_path: Path, damage: bytes) -> None:
    h, root, data, digest = _ranked_location(tmp_path)
    try:
        best = _best_three(root)
        h.release_lock()
        (Path(root) / ".epochal" / INDEX_FILE).write_bytes(damage)
        h.acquire_lock()  # a restart: the index is read again
        _next_commit(h, root, data, digest, 9.0)
        assert _best_three(root) == best
        assert set(best) <= set(CheckpointDirectory(root).committed_epochs())  # no best one deleted
        assert _index(root) == _expected_index(root)  # rewritten whole
    finally:
        h.release_lock()


def test_a_step_missing_from_the_index_is_read_and_an_entry_without_manifest_dropped(tmp_path: Path) -> None:
    """As a crash between a manifest and the index write, or between a delete and it, leaves
    them: the step committed last is missing (and is the new best), and a deleted step is
    still in the index with the best value of all."""
    h, root, data, digest = _ranked_location(tmp_path)
    try:
        step = _next_commit(h, root, data, digest, -1.0)
        h.release_lock()
        path = Path(root) / ".epochal" / INDEX_FILE
        entries = json.loads(path.read_bytes())
        del entries["epochs"][str(step)]
        entries["epochs"]["5"] = {"loss": -100.0}  # step 5 was never committed here
        path.write_text(json.dumps(entries))
        h.acquire_lock()  # a restart
        d = CheckpointDirectory(root)
        before = d.committed_epochs()
        losses = {e: d.read_manifest(e).metrics["loss"] for e in before}
        last = _next_commit(h, root, data, digest, 9.0)
        committed = d.committed_epochs()
        ranked = sorted({**losses, last: 9.0}.items(), key=lambda el: (el[1], el[0]))
        ranked = [e for e, _ in ranked]
        assert ranked[0] == step  # ranked by its manifest, the stale entry of 5 not at all
        expected = {e for e in before if e % 10 == 0} | set(ranked[:3]) | {*before[-2:], last}
        assert committed == sorted(expected), (committed, sorted(expected))
        assert _index(root) == {e: d.read_manifest(e).metrics for e in committed}
    finally:
        h.release_lock()


# -- epochal ls


def _ls(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from epochal.cli.main import run as cli_run

    capsys.readouterr()
    rc = cli_run(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_ls_shows_the_newest_20_steps_and_all_with_all(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    where, root, put = _local_location(tmp_path)
    _fill(root, put, 33)  # 33 steps: 0, 10, ..., 290, 291, 292, 293
    epochs = _history(33)
    rc, out, err = _ls(["ls", where, "--json"], capsys)
    assert rc == 0, err
    got = json.loads(out)
    assert [e["epoch"] for e in got["epochs"]] == epochs[-20:] and got["older"] == 13
    best = {e["epoch"]: e["best"] for e in got["epochs"] if e["best"]}  # ranked over all 33
    d = CheckpointDirectory(where)
    ranked = sorted(epochs, key=lambda e: (d.read_manifest(e).metrics["loss"], e))[:3]
    assert best == {e: i + 1 for i, e in enumerate(ranked) if e in epochs[-20:]}
    rc, out, err = _ls(["ls", where], capsys)
    assert rc == 0 and "13 older epoch(s) not shown" in err and f"epochal ls --all {where}" in err, err
    assert str(epochs[-1]) in out
    rc, out, err = _ls(["ls", where, "--all", "--json"], capsys)
    got = json.loads(out)
    assert rc == 0 and [e["epoch"] for e in got["epochs"]] == epochs and got["older"] == 0
    rc, out, err = _ls(["ls", where, "--all"], capsys)
    assert rc == 0 and "older" not in err


def test_ls_reads_the_manifests_of_the_steps_it_shows(tmp_path: Path) -> None:
    from epochal.cli.records import LS_NEWEST, ls_prefix

    calls = {}
    for steps in (50, 500):
        where, root, put = _local_location(tmp_path / str(steps))
        _fill(root, put, steps)
        with _record_calls() as n:
            listing, best = ls_prefix(where, LS_NEWEST)
        calls[steps] = dict(n)
        assert len(listing["epochs"]) == 20 and listing["older"] == steps - 20
        assert best is not None and best.metric == "loss"
    # no index yet (an older epochal's location): every manifest is read once for the ranking
    assert calls[50]["read"] < calls[500]["read"]
    for steps in (50, 500):  # a commit with keep_best writes the index
        where = str(tmp_path / str(steps) / "run")
        h = ep.DirectoryMetadataHandler(**POLICY)
        h.set_params(where, "native", [NODE])
        h.acquire_lock()
        data, digest = _db()
        _next_commit(h, where, data, digest, 9.0)
        h.release_lock()
        with _record_calls() as n:
            ls_prefix(where, LS_NEWEST)
        calls[steps] = dict(n)
    assert calls[50] == calls[500], calls
    assert calls[50]["read"] <= 20 + 2, calls  # the 20 shown, the pins, the index


def test_the_newest_committed_step_is_read_from_the_newest_down(tmp_path: Path) -> None:
    where, root, put = _local_location(tmp_path)
    _fill(root, put, 100)
    epochs = _history(100)
    newest = Path(root) / ".epochal" / f"manifest.{epochs[-1]}.json"
    newest.write_bytes(newest.read_bytes().replace(b'"loss"', b'"lass"'))  # damaged: its checksum fails
    d = CheckpointDirectory(where)
    with _record_calls() as n:
        got = d.newest_committed()
        assert got is not None and got[0] == epochs[-2] and got[1].epoch == epochs[-2]
        assert d.is_committed(epochs[-2]) and not d.is_committed(epochs[-1]) and not d.is_committed(epochs[-1] + 1)
    assert n == {"files": 1, "read": 5}, n  # the listing; the two newest; then one read each


@pytest.mark.system
def test_a_damaged_newest_step_costs_one_more_manifest_not_the_history_on_s3(s3: dict[str, Any]) -> None:
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    costs = {}
    for steps in (30, 300):
        url, root, put = _s3_location(s3)
        _fill(root, put, steps)
        newest = _history(steps)[-1]
        put({f"{root}/.epochal/manifest.{newest}.json": b"{damaged"})
        h = ep.DirectoryMetadataHandler(storage_options=s3)
        h.set_params(url, "native", [NODE])
        h.acquire_lock()
        try:
            with _s3_requests() as n:
                assert h.resume_epoch() == newest - 1
            costs[steps] = dict(n)
        finally:
            h.release_lock()
    assert costs[30] == costs[300], costs
