"""Db names at a URL that no other writer can produce (moto's S3 server on 127.0.0.1).

At a URL each save names its db ``<node>.<epoch>.<token>`` and the manifest records that name:
a writer paused inside its db upload past its lease (SIGSTOP, a long GC pause) lands its
bytes under its own key when it wakes, never over the new holder's committed db of the same
step; its commit then fails with CheckpointLockedError, and its orphan object is removed by
the next lease holder's cleanup. Older URL checkpoints, whose dbs are ``<node>.<epoch>``,
still restore; retention deletes the token dbs of the steps it drops and never a kept one's.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("s3fs", reason="the s3 extra is not installed")

import epochal as ep  # noqa: E402
from epochal.checkpoint.location.naming import (  # noqa: E402
    db_name,
    db_token,
    names_db_of,
    new_token,
    parse_db_file,
    split_db_file,
)
from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.errors import CheckpointLockedError  # noqa: E402
from epochal.storage.io.remote import fsspec_store  # noqa: E402
from epochal.storage.io.remote.fsspec_store import filesystem_for, set_storage_options  # noqa: E402

pytestmark = pytest.mark.system  # a moto server and fresh processes

#: restores the newest step of a URL in a fresh process; prints the step and each array's
#: SHA-256 (of its bytes)
RESTORE = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    import epochal as ep
    url, opts = sys.argv[1], json.loads(sys.argv[2])
    step = None if sys.argv[3] == "newest" else int(sys.argv[3])
    state = {"w": np.zeros(4096, np.float32), "b": np.zeros(7, np.int64)}
    with ep.Checkpointer(url, storage_options=opts, progress=False) as ck:
        got = ck.restore(state, step)
    print(json.dumps({"step": got, **{k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in state.items()}}))
""")


def _state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(4096).astype(np.float32), "b": rng.integers(0, 1 << 40, 7)}


def _digests(state: dict[str, Any]) -> dict[str, str]:
    return {k: hashlib.sha256(np.asarray(v).tobytes()).hexdigest() for k, v in state.items()}


def _restore_fresh(url: str, opts: dict[str, Any], step: int | None = None) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-c", RESTORE, url, json.dumps(opts), "newest" if step is None else str(step)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def _keys(url: str) -> dict[str, bytes]:
    """Every db object at ``url`` (the records aside): {name: bytes}."""
    fs, root = filesystem_for(url)
    fs.invalidate_cache()
    return {k[len(root) + 1:]: bytes(fs.cat_file(k)) for k in fs.find(root) if "/.epochal/" not in k}


def _url(opts: dict[str, Any]) -> str:
    """A fresh run URL; the test's own reads and writes there reach it with ``opts``."""
    url = f"s3://ckpts/tokens-{secrets.token_hex(4)}/run"
    set_storage_options(url, opts)
    return url


@pytest.mark.unit
def test_token_names_parse_and_a_manifest_may_name_only_its_own_node_and_epoch() -> None:
    token = new_token()
    assert db_token(f"local.3.{token}") == token and db_token("local.3") is None
    assert db_name(3, "local", "s3://b/run", token=token) == f"s3://b/run/local.3.{token}"
    assert split_db_file(f"a.b.3.{token}") == ("a.b", 3) and split_db_file("a.b.3") == ("a.b", 3)
    assert parse_db_file(f"pre_n.12.{token}", ["n"], "pre_") == ("n", 12)
    assert split_db_file("n.3.w0000") is None  # not a token: not a db name either
    assert names_db_of(f"n.3.{token}", "n", 3) and names_db_of("n.3", "n", 3)
    assert not names_db_of(f"n.4.{token}", "n", 3) and not names_db_of(f"m.3.{token}", "n", 3)
    assert not names_db_of(f"../n.3.{token}", "n", 3)
    with pytest.raises(ValueError, match="not a writer token"):
        db_name(3, "n", "s3://b/run", token="123")


def test_a_writer_paused_inside_its_upload_never_overwrites_the_new_holders_commit(
    s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A's save of step 1 stalls inside its db upload past its lease; B takes the lease over
    and commits step 1. A wakes: its bytes land under its own key, B's db is untouched, A's
    commit fails with CheckpointLockedError naming the holder, and B's step restores bit for
    bit in a fresh process; the next holder's cleanup removes A's orphan object."""
    url = _url(s3)
    a = ep.Checkpointer(url, storage_options=s3, progress=False)
    a.save(0, _state(0))
    inside, wake = threading.Event(), threading.Event()
    real = fsspec_store.upload_to_key
    paused: list[str] = []

    def upload(fs: Any, path: str, local: str, size: int, name: str) -> None:
        if not paused and "/local.1" in name:  # A's upload of step 1: stalls (SIGSTOP, a GC pause)
            paused.append(name)
            inside.set()
            assert wake.wait(60)
        real(fs, path, local, size, name)

    monkeypatch.setattr(fsspec_store, "upload_to_key", upload)
    lease = a.handler._lock
    assert lease is not None
    lease.stop_renewal()  # (A is about to stall: nobody renews its lease)
    lease.seconds = 0.5  # type: ignore[attr-defined]
    errors: list[BaseException] = []

    def save_a() -> None:
        try:
            a.save(1, _state(100))  # its fence renews for 0.5 s, then it stalls in the upload
        except BaseException as ex:  # noqa: BLE001 (the test looks at it)
            errors.append(ex)

    thread = threading.Thread(target=save_a)
    thread.start()
    assert inside.wait(60)
    time.sleep(0.7)  # A's lease expires while it is paused
    b = ep.Checkpointer(url, storage_options=s3, progress=False)  # takes the expired lease over
    b.save(1, _state(1))
    committed = _keys(url)
    b_file = CheckpointDirectory(url).read_manifest(1).nodes["local"].file
    assert db_token(b_file) is not None
    wake.set()  # A wakes: its upload finishes, then its commit is refused
    thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], CheckpointLockedError), errors
    assert f"pid {os.getpid()}" in str(errors[0]) and "lease.json" in str(errors[0])  # the holder named
    after = _keys(url)
    a_file = paused[0].rsplit("/", 1)[-1]
    assert a_file != b_file and a_file in after  # A's bytes under A's own key
    assert after[b_file] == committed[b_file]  # B's committed db untouched
    assert CheckpointDirectory(url).read_manifest(1).nodes["local"].file == b_file
    b.close()
    a.close()
    monkeypatch.undo()
    got = _restore_fresh(url, s3)  # a fresh process; it takes the lease: its cleanup runs
    assert got == {"step": 1, **_digests(_state(1))}
    left = _keys(url)
    assert a_file not in left  # the orphan is gone
    assert left[b_file] == committed[b_file]
    assert sorted(left) == sorted(CheckpointDirectory(url).db_path("local", s).rsplit("/", 1)[-1] for s in (0, 1))
    v = subprocess.run([sys.executable, "-m", "epochal", "verify", url, "--json",
                        *[a for k in ("endpoint_url", "key", "secret") for a in ("-o", f"{k}={s3[k]}")]],
                       capture_output=True, text=True, timeout=120)
    assert v.returncode == 0 and json.loads(v.stdout)["ok"] is True, v.stdout + v.stderr


def test_an_older_url_checkpoint_named_node_dot_epoch_still_restores_beside_token_names(
    s3: dict[str, Any],
) -> None:
    """Step 3 written as before writer tokens (``local.3``, the manifest naming it so); a new
    save of step 4 beside it is ``local.4.<token>``. A fresh process restores either, bit for
    bit, and ``epochal ls`` / ``verify`` read both."""
    url = _url(s3)
    old = _state(3)
    ep.get_db_type("native").write(f"{url}/local.3", old)  # the older layout's name
    h = ep.DirectoryMetadataHandler(storage_options=s3)
    h.set_params(url, "native", ["local"])
    h.acquire_lock()
    h.write(3)  # no node report: the manifest names local.3, size and digest from the store
    h.release_lock()
    assert CheckpointDirectory(url).read_manifest(3).nodes["local"].file == "local.3"
    with ep.Checkpointer(url, storage_options=s3, progress=False) as ck:
        ck.save(4, _state(4))
    new = CheckpointDirectory(url).read_manifest(4).nodes["local"].file
    assert new.startswith("local.4.") and db_token(new) is not None
    assert sorted(_keys(url)) == ["local.3", new]
    assert _restore_fresh(url, s3, 3) == {"step": 3, **_digests(old)}
    assert _restore_fresh(url, s3) == {"step": 4, **_digests(_state(4))}
    o = [a for k in ("endpoint_url", "key", "secret") for a in ("-o", f"{k}={s3[k]}")]
    listing = subprocess.run([sys.executable, "-m", "epochal", "ls", url, "--json", *o],
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    files = {e["epoch"]: e["files"]["local"] for e in json.loads(listing.stdout)["epochs"]}
    assert files[3]["path"].endswith("/local.3") and files[4]["path"].endswith("/" + new)
    assert all(f["present"] and f["size"] == f["recorded_size"] for f in files.values())
    v = subprocess.run([sys.executable, "-m", "epochal", "verify", f"{url}/local.4", "--json", *o],
                       capture_output=True, text=True, timeout=120)  # the name without its token
    assert v.returncode == 0 and json.loads(v.stdout)["files"][0]["path"].endswith(new), v.stdout + v.stderr


def test_retention_at_a_url_deletes_the_token_dbs_of_dropped_steps_never_a_kept_ones(
    s3: dict[str, Any],
) -> None:
    """keep_last=2: the dbs of dropped steps go, whatever their token; the kept steps' dbs (as
    their manifests name them) stay bit for bit. Dead writers' dbs: of a kept committed step
    (another token than its manifest's) removed as the next holder takes the lease; of an
    uncommitted older step removed by retention; of a step newer than the newest commit kept."""
    url = _url(s3)
    with ep.Checkpointer(url, storage_options=s3, keep_last=2, progress=False) as ck:
        for s in range(5):
            ck.save(s, _state(s))
    d = CheckpointDirectory(url)
    kept = {s: d.read_manifest(s).nodes["local"].file for s in (3, 4)}
    assert d.committed_epochs() == [3, 4] and all(db_token(f) is not None for f in kept.values())
    before = _keys(url)
    assert sorted(before) == sorted(kept.values())  # steps 0..2: every db gone
    fs, root = filesystem_for(url)
    stray = {name: f"{root}/{name}" for name in (f"local.4.{new_token()}", f"local.1.{new_token()}",
                                                 f"local.9.{new_token()}")}
    for key in stray.values():  # dead writers' uploads (their commits failed)
        fs.pipe_file(key, b"a dead writer's db")
    with ep.Checkpointer(url, storage_options=s3, keep_last=2, progress=False) as ck:
        left = _keys(url)
        assert sorted(left) == sorted([*kept.values(), *[n for n in stray if not n.startswith("local.4.")],
                                       ]), left  # the kept step's orphan: gone as the lease was taken
        ck.save(5, _state(5))
    d = CheckpointDirectory(url)
    assert d.committed_epochs() == [4, 5]
    after = _keys(url)
    newest = d.read_manifest(5).nodes["local"].file
    nine = [n for n in stray if n.startswith("local.9.")]
    assert sorted(after) == sorted([kept[4], newest, *nine]), after  # step 3's db and step 1's stray gone
    assert after[kept[4]] == before[kept[4]]
    assert _restore_fresh(url, s3, 4) == {"step": 4, **_digests(_state(4))}


def test_the_holder_saving_a_step_again_never_writes_over_its_committed_db(s3: dict[str, Any]) -> None:
    """The lease holder saves step 2 again (a run resumed from an earlier step): the new db
    goes to a new key while the committed one stands, the manifest is replaced to name it,
    and the db it no longer names is deleted; a fresh process restores the new values."""
    url = _url(s3)
    with ep.Checkpointer(url, storage_options=s3, progress=False) as ck:
        ck.save(2, _state(2))
        first = CheckpointDirectory(url).read_manifest(2).nodes["local"].file
        ck.save(2, _state(22))
    second = CheckpointDirectory(url).read_manifest(2).nodes["local"].file
    assert second != first and db_token(second) is not None
    assert sorted(_keys(url)) == [second]
    assert _restore_fresh(url, s3) == {"step": 2, **_digests(_state(22))}
