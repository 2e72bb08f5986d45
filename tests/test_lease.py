"""The fenced writer lease at a URL (memory://, moto's S3 server and fake-gcs-server on 127.0.0.1): a job that
lost the lease writes nothing more, renewal never takes it back, release deletes only its own,
of two takers exactly one wins, background renewal, takeover of a dead holder's or an
unreadable lease, and failures injected at the store seam."""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fsspec", reason="the s3 extra is not installed")

from test_url_checkpoints import LAST, _train  # noqa: E402

import epochal as ep  # noqa: E402
from epochal.checkpoint.location.lease import Lease  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.errors import CheckpointLockedError  # noqa: E402
from epochal.storage.io import atomic  # noqa: E402
from epochal.storage.io.remote import conditional  # noqa: E402
from epochal.storage.io.remote.fsspec_store import filesystem_for, set_storage_options  # noqa: E402


@pytest.fixture(params=["memory", "s3", "gcs"])
def where(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any] | None]:
    if request.param == "memory":
        return f"memory://lease-{secrets.token_hex(4)}/run", None
    scheme = {"s3": "s3", "gcs": "gs"}[request.param]
    url, opts = f"{scheme}://ckpts/lease-{secrets.token_hex(4)}/run", request.getfixturevalue(request.param)
    set_storage_options(url, opts)  # for the test's own reads and writes too
    return url, opts


def _lease_url(url: str) -> str:
    return f"{url}/.epochal/lease.json"


def _read(url: str) -> dict[str, Any]:
    fs, path = filesystem_for(url)
    fs.invalidate_cache()
    return json.loads(bytes(fs.cat_file(path)))


def _put(url: str, data: bytes) -> None:
    fs, path = filesystem_for(url)
    fs.pipe_file(path, data)
    fs.invalidate_cache()


def _exists(url: str) -> bool:
    fs, path = filesystem_for(url)
    fs.invalidate_cache()
    return bool(fs.exists(path))


def _handler(url: str, opts: dict[str, Any] | None, seconds: float = 60) -> ep.DirectoryMetadataHandler:
    h = ep.DirectoryMetadataHandler(storage_options=opts, lease_seconds=seconds)
    h.set_params(url, "native", ["n"])
    return h


def _save_db(url: str, epoch: int) -> None:
    ep.get_db_type("native").write(f"{url}/n.{epoch}", {"v": np.arange(3) + epoch})


def _foreign(host: str = "elsewhere", pid: int = 4242, expires_in: float = 60.0, generation: int = 7) -> bytes:
    now = time.time()
    return json.dumps({"host": host, "pid": pid, "token": "f" * 16, "generation": generation,
                       "since": "then", "expires": "later", "expires_at": now + expires_in}).encode()


def test_a_writer_that_lost_the_lease_stops_before_its_next_commit(
    where: tuple[str, dict[str, Any] | None], caplog: pytest.LogCaptureFixture,
) -> None:
    url, opts = where
    a = _handler(url, opts, seconds=0.3)
    a.acquire_lock()
    _save_db(url, 0)
    a.write(0)
    assert _read(_lease_url(url))["generation"] == 1
    a._lock.stop_renewal()  # type: ignore[union-attr]  # a slow writer: stalled past its lease
    time.sleep(0.4)
    b = _handler(url, opts)
    with caplog.at_level(logging.WARNING, logger="epochal"):
        b.acquire_lock()  # takes the expired lease over
    assert "Taking over the expired checkpoint lease" in caplog.text and _lease_url(url) in caplog.text
    taken = _read(_lease_url(url))
    assert taken["generation"] == 2
    _save_db(url, 1)
    b.write(1)
    m1 = CheckpointDirectory(url).manifest(1)

    _save_db(url, 2)
    with pytest.raises(CheckpointLockedError) as e:  # A's next commit: refused, nothing written
        a.write(2)
    assert e.value.path == _lease_url(url) and e.value.holder["generation"] == 2
    assert "token" not in e.value.holder and f"pid {os.getpid()}" in str(e.value)
    assert CheckpointDirectory(url).manifest_epochs() == [0, 1]
    with pytest.raises(CheckpointLockedError):  # nor does it start another save
        a.cp_accessible()
    with pytest.raises(CheckpointLockedError):  # nor rewrite the pins
        a.pin(0)
    assert CheckpointDirectory(url).pins() == set()
    with pytest.raises(CheckpointLockedError):  # ... or overwrite B's manifest
        a.write(1)
    assert CheckpointDirectory(url).manifest(1) == m1
    a._lock.renew()  # type: ignore[union-attr]  # renewal never takes it back
    assert _read(_lease_url(url)) == _read(_lease_url(url)) and _read(_lease_url(url))["token"] == taken["token"]
    a.release_lock()  # deletes only its own lease: B's stays
    assert _read(_lease_url(url))["token"] == taken["token"]
    with pytest.raises(CheckpointLockedError):  # a third job is still refused
        _handler(url, opts).acquire_lock()
    b.write(1)  # B goes on committing
    b.release_lock()
    assert not _exists(_lease_url(url))
    a.acquire_lock()  # once B is done, A may run again (a new attempt, by the same rules)
    assert _read(_lease_url(url))["token"] == a._lock.token  # type: ignore[union-attr]
    a.write(2)
    a.release_lock()
    assert not _exists(_lease_url(url))


@pytest.mark.parametrize("rounds", [6])
def test_of_two_takers_of_an_expired_lease_exactly_one_wins(
    where: tuple[str, dict[str, Any] | None], rounds: int,
) -> None:
    url, opts = where
    lease_url = _lease_url(url)
    for r in range(rounds):
        _put(lease_url, _foreign(expires_in=-1, generation=r))
        leases = [Lease(conditional.conditional_for(lease_url), lease_url, 60) for _ in range(2)]
        start = threading.Barrier(2)
        outcome: list[Any] = [None, None]

        def take(i: int, start: threading.Barrier = start, leases: list[Lease] = leases,
                 outcome: list[Any] = outcome) -> None:
            start.wait()
            try:
                leases[i].acquire()
                outcome[i] = "won"
            except CheckpointLockedError as ex:
                outcome[i] = ex

        threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i in range(2) if outcome[i] == "won"]
        assert len(winners) == 1, outcome
        loser = outcome[1 - winners[0]]
        assert isinstance(loser, CheckpointLockedError) and loser.holder["generation"] == r + 1
        now = _read(lease_url)
        assert now["token"] == leases[winners[0]].token and now["generation"] == r + 1
        for lease in leases:
            lease.release()
        assert not _exists(lease_url)


def test_the_lease_is_renewed_in_the_background_and_released(where: tuple[str, dict[str, Any] | None]) -> None:
    url, opts = where
    h = _handler(url, opts, seconds=0.6)
    h.acquire_lock()
    first = _read(_lease_url(url))
    assert first["seconds"] == 0.6 and first["expires_at"] <= time.time() + 0.6
    time.sleep(1.5)  # more than twice the lease: only background renewals keep it alive
    later = _read(_lease_url(url))
    deadline = time.monotonic() + 5  # (a busy machine, or GCS's one write a second per object)
    while later["expires_at"] <= first["expires_at"] + 0.5 and time.monotonic() < deadline:
        time.sleep(0.1)
        later = _read(_lease_url(url))
    assert later["token"] == first["token"] and later["expires_at"] > first["expires_at"] + 0.5
    assert later["expires_at"] > time.time()
    with pytest.raises(CheckpointLockedError):
        _handler(url, opts).acquire_lock()
    thread = h._lock._thread  # type: ignore[union-attr]
    assert thread is not None and thread.is_alive() and thread.daemon
    h.release_lock()
    assert not thread.is_alive() and not _exists(_lease_url(url))


def test_the_default_lease_is_short(where: tuple[str, dict[str, Any] | None]) -> None:
    from epochal.checkpoint.location.lease import DEFAULT_LEASE_SECONDS

    url, opts = where
    assert 30 <= DEFAULT_LEASE_SECONDS <= 120
    assert ep.DirectoryMetadataHandler().lease_seconds == DEFAULT_LEASE_SECONDS
    cp = ep.Checkpointer(url, storage_options=opts)  # no hour-long lease for the Checkpointer either
    try:
        lease = _read(_lease_url(url))
        assert lease["seconds"] == DEFAULT_LEASE_SECONDS
        assert lease["expires_at"] <= time.time() + DEFAULT_LEASE_SECONDS
    finally:
        cp.close()
    assert not _exists(_lease_url(url))


@pytest.mark.parametrize("body,why", [
    (b"{not json", "not a JSON object"),
    (b'{"host": "elsewhere", "pid": 1, "token": "x"}', "no expiry"),
    (b'["a", "list"]', "not a JSON object"),
    (b'{"host": "elsewhere", "pid": 1, "expires_at": Infinity}', "no expiry"),
])
def test_an_unreadable_lease_is_treated_as_expired(
    where: tuple[str, dict[str, Any] | None], caplog: pytest.LogCaptureFixture, body: bytes, why: str,
) -> None:
    url, opts = where
    h = _handler(url, opts)
    _put(_lease_url(url), body)
    with caplog.at_level(logging.WARNING, logger="epochal"):
        h.acquire_lock()
    said = [r.getMessage() for r in caplog.records if "Taking over" in r.getMessage()]
    assert len(said) == 1 and _lease_url(url) in said[0] and why in said[0] and "treated as expired" in said[0]
    assert _read(_lease_url(url))["pid"] == os.getpid() and _read(_lease_url(url))["generation"] == 1
    h.release_lock()


def test_another_hosts_live_lease_is_refused_until_it_expires(where: tuple[str, dict[str, Any] | None]) -> None:
    url, opts = where
    _put(_lease_url(url), _foreign(host="elsewhere", pid=os.getpid() + 100000, expires_in=60))
    with pytest.raises(CheckpointLockedError) as e:
        _handler(url, opts).acquire_lock()
    assert "host elsewhere" in str(e.value) and e.value.holder["generation"] == 7
    # a dead pid means nothing on another host: only the expiry frees it
    _put(_lease_url(url), _foreign(host="elsewhere", pid=os.getpid() + 100000, expires_in=-0.5))
    h = _handler(url, opts)
    h.acquire_lock()
    assert _read(_lease_url(url))["generation"] == 8
    h.release_lock()


def test_a_dead_holder_on_this_host_is_taken_over_at_once(
    where: tuple[str, dict[str, Any] | None], caplog: pytest.LogCaptureFixture,
) -> None:
    url, opts = where
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that was ours and is gone
    _put(_lease_url(url), _foreign(host=atomic.hostname(), pid=child.pid, expires_in=3600))
    h = _handler(url, opts)
    with caplog.at_level(logging.WARNING, logger="epochal"):
        h.acquire_lock()
    assert f"pid {child.pid} of this host, is gone" in caplog.text
    h.release_lock()
    _put(_lease_url(url), _foreign(host=atomic.hostname(), pid=os.getppid(), expires_in=3600))
    with pytest.raises(CheckpointLockedError):  # a live process of this host keeps it
        _handler(url, opts).acquire_lock()


_CHILD = """
import sys, time
import epochal as ep
opts = {"endpoint_url": sys.argv[2], "key": "test", "secret": "test", "client_kwargs": {"region_name": "us-east-1"}}
h = ep.DirectoryMetadataHandler(storage_options=opts, lease_seconds=float(sys.argv[3]))
h.set_params(sys.argv[1], "native", ["n"])
h.acquire_lock()
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_killed_job_is_taken_over_at_once_on_this_host_and_after_expiry_elsewhere(
    s3: dict[str, Any], caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"s3://ckpts/lease-{secrets.token_hex(4)}/run"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, url, s3["endpoint_url"], "60"],
                             stdout=subprocess.PIPE, env={**os.environ})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"held"
        with pytest.raises(CheckpointLockedError) as e:  # alive: refused
            _handler(url, s3).acquire_lock()
        assert f"pid {child.pid}" in str(e.value)
    finally:
        child.kill()
        child.wait()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="epochal"):  # kill -9'd: the rerun goes on at once
        assert _train(url, ep.DirectoryMetadataHandler(storage_options=s3), s3) == LAST
    assert time.monotonic() - start < 60  # not after the lease's minute
    assert f"pid {child.pid} of this host, is gone" in caplog.text
    assert CheckpointDirectory(url).committed_epochs() == list(range(LAST + 1))


def test_a_job_whose_lease_is_taken_stops_with_the_new_holder_named(
    where: tuple[str, dict[str, Any] | None],
) -> None:
    url, opts = where

    class Stolen(ep.DirectoryMetadataHandler):
        def write(self, epoch: int, metrics: Any = None) -> None:
            super().write(epoch, metrics)
            if epoch == 1:  # another job takes the location over (an operator's mistake)
                _put(_lease_url(url), _foreign(host="thief", pid=99, expires_in=600))

    with pytest.raises(CheckpointLockedError) as e:
        _train(url, Stolen(storage_options=opts), opts)
    assert "host thief" in str(e.value) and "pid 99" in str(e.value)
    d = CheckpointDirectory(url)
    assert d.committed_epochs() == [0, 1]  # nothing after the loss
    assert sorted(d.scan()) == [0, 1]  # and no db of epoch 2 was written over the new holder's
    assert _read(_lease_url(url))["host"] == "thief"  # its lease was not deleted at the end


def test_store_failures_during_renewal_are_retried_and_a_failed_fence_fails_the_commit(
    where: tuple[str, dict[str, Any] | None], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    url, opts = where
    h = _handler(url, opts, seconds=0.6)
    h.acquire_lock()
    real = conditional.ConditionalObjects.replace
    fail = {"n": 0}

    def flaky(self: Any, u: str, data: bytes, version: str) -> str | None:
        if fail["n"] > 0:
            fail["n"] -= 1
            raise OSError(5, "injected: the store is unreachable")
        return real(self, u, data, version)

    monkeypatch.setattr(conditional.ConditionalObjects, "replace", flaky)
    fail["n"] = 2  # two renewals in a row fail (a failed PUT)
    with caplog.at_level(logging.WARNING, logger="epochal"):
        time.sleep(1.0)
    assert "Cannot renew the checkpoint lease" in caplog.text and "injected" in caplog.text
    assert fail["n"] == 0
    time.sleep(0.3)  # the next renewal succeeded: still ours
    assert _read(_lease_url(url))["pid"] == os.getpid() and _read(_lease_url(url))["expires_at"] > time.time()
    h._lock.stop_renewal()  # type: ignore[union-attr]
    _save_db(url, 0)
    fail["n"] = 1  # the commit's fence cannot reach the store: the commit fails, no manifest
    with pytest.raises(OSError, match="injected"):
        h.write(0)
    assert CheckpointDirectory(url).manifest_epochs() == []
    h.write(0)  # the store is back: the lease is still ours, the commit goes through
    assert CheckpointDirectory(url).committed_epochs() == [0]
    h.release_lock()
    assert not _exists(_lease_url(url))


def test_a_failed_read_of_the_lease_is_an_error_not_a_takeover(
    where: tuple[str, dict[str, Any] | None], monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, opts = where
    _put(_lease_url(url), _foreign(expires_in=60))

    def broken(self: Any, u: str) -> Any:
        raise OSError(5, "injected: GET failed")

    monkeypatch.setattr(conditional.ConditionalObjects, "get", broken)
    with pytest.raises(OSError, match="injected"):
        _handler(url, opts).acquire_lock()
    monkeypatch.undo()
    assert _read(_lease_url(url))["host"] == "elsewhere"  # untouched


def test_an_s3_store_that_refuses_conditional_requests_falls_back_with_a_warning(
    s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"s3://ckpts/lease-{secrets.token_hex(4)}/run"
    set_storage_options(url, s3)

    def refused(self: Any, path: str, data: bytes, condition: dict[str, str]) -> str | None:
        raise OSError(95, "NotImplemented: A header you provided implies functionality that is not implemented")

    monkeypatch.setattr(conditional.ConditionalObjects, "_s3_put", refused)
    fs, _ = filesystem_for(url)
    real_call = fs.call_s3

    def call_s3(method: str, *a: Any, **k: Any) -> Any:
        if "IfMatch" in k:
            raise OSError(95, "NotImplemented")
        return real_call(method, *a, **k)

    monkeypatch.setattr(fs, "call_s3", call_s3)
    h = _handler(url, s3)
    with caplog.at_level(logging.WARNING, logger="epochal"):
        h.acquire_lock()
    assert "refuses conditional requests" in caplog.text and "best effort" in caplog.text
    assert _read(_lease_url(url))["pid"] == os.getpid()
    with pytest.raises(CheckpointLockedError):  # still one writer in this process
        _handler(url, s3).acquire_lock()
    _save_db(url, 0)
    h.write(0)  # fenced by read-compare-write
    h.release_lock()
    assert not _exists(_lease_url(url))


def test_a_checkpointer_whose_lease_is_taken_raises_at_its_next_save(
    where: tuple[str, dict[str, Any] | None],
) -> None:
    url, opts = where
    with ep.Checkpointer(url, storage_options=opts) as cp:
        cp.save(0, {"w": np.arange(3)})
        _put(_lease_url(url), _foreign(host="thief", pid=99, expires_in=600))
        with pytest.raises(CheckpointLockedError) as e:
            cp.save(1, {"w": np.arange(3) + 1})
        assert "host thief" in str(e.value)
        assert cp.steps() == [0]
    assert _read(_lease_url(url))["host"] == "thief"  # close() did not delete the new holder's lease


def test_a_writer_paused_between_its_fence_and_its_manifest_never_replaces_a_commit(
    where: tuple[str, dict[str, Any] | None],
) -> None:
    """A passed its fence, then stalled past its lease (a GC pause, a frozen VM); B took the
    lease over and committed the same epoch. A's manifest write, when it wakes, is refused:
    CheckpointLockedError, and B's commit stays as it was."""
    url, opts = where
    a = _handler(url, opts, seconds=0.3)
    a.acquire_lock()
    _save_db(url, 0)
    a.write(0)
    a._lock.stop_renewal()  # type: ignore[union-attr]
    time.sleep(0.4)
    b = _handler(url, opts)
    b.acquire_lock()
    _save_db(url, 1)
    b.write(1)
    committed = CheckpointDirectory(url).manifest(1)
    fs, path = filesystem_for(f"{url}/.epochal/manifest.1.json")
    fs.invalidate_cache()
    before = bytes(fs.cat_file(path))
    a._fence = lambda: None  # type: ignore[method-assign]  # (its fence passed before the pause)
    with pytest.raises(CheckpointLockedError):
        a.write(1)
    fs.invalidate_cache()
    assert bytes(fs.cat_file(path)) == before and CheckpointDirectory(url).manifest(1) == committed
    b.write(1)  # the holder may still save the same epoch again
    b.release_lock()
    a.release_lock()
