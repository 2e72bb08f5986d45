"""Retention: the pure policy function, and the handler applying it across resumes."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _crash_job as cj  # noqa: E402

from epochal import JobRunner, LocalSession, MultiNodeCheckpointManager, Workspace  # noqa: E402
from epochal.checkpoint.handler.directory import DirectoryMetadataHandler  # noqa: E402
from epochal.checkpoint.location.retention import RetentionPolicy, epochs_to_delete  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory

NODES = ("trainer_0", "trainer_1")


class Interrupt(Exception):
    pass


def run(directory, epochs, crash_at=None, **handler_kw):
    def hook(e, ws):
        if e == crash_at:
            raise Interrupt(e)

    handler = handler_kw.pop("handler", None) or DirectoryMetadataHandler(**handler_kw)
    job, counts = cj.build_job(epochs, nodes=NODES, hook=hook)
    manager = MultiNodeCheckpointManager(str(directory), "native", metadata_handler=handler)
    ws = Workspace()
    try:
        last = JobRunner(job, manager, progress=False).train(LocalSession(ws))
    except Interrupt:
        last = None
    return last, counts, handler, cj.model_blobs(ws) if "blob_names" in ws else None


def on_disk(directory):
    """(committed epochs, epochs with any db file)"""
    d = CheckpointDirectory(str(directory))
    return d.committed_epochs(), sorted(d.scan())


# ----------------------------------------------------------------------------- pure function

def test_default_policy_keeps_everything():
    assert epochs_to_delete(range(10), 9, (), RetentionPolicy()) == []
    assert RetentionPolicy().keeps_everything


@pytest.mark.parametrize(
    "committed, newest, pins, policy, protect, expected",
    [
        (range(6), 5, (), RetentionPolicy(keep_last=2), (), [0, 1, 2, 3]),
        (range(6), 5, (), RetentionPolicy(keep_last=1), (), [0, 1, 2, 3, 4]),
        (range(6), 5, (), RetentionPolicy(keep_last=10), (), []),
        (range(11), 10, (), RetentionPolicy(keep_last=2, keep_every=4), (), [1, 2, 3, 5, 6, 7]),
        (range(11), 10, (), RetentionPolicy(keep_every=4), (), [1, 2, 3, 5, 6, 7, 9]),
        (range(7), 6, (), RetentionPolicy(keep_every=4), (), [1, 2, 3, 5]),  # newest always kept
        (range(6), 5, (1, 3), RetentionPolicy(keep_last=1), (), [0, 2, 4]),
        ([0, 1, 2, 3, 7], 3, (), RetentionPolicy(keep_last=1), (7,), [0, 1, 2]),  # 7 protected
        ([], None, (), RetentionPolicy(keep_last=1), (), []),
        ([4, 2, 2, 9], None, (), RetentionPolicy(keep_last=1), (), [2, 4]),
    ],
)
def test_epochs_to_delete(committed, newest, pins, policy, protect, expected):
    assert epochs_to_delete(committed, newest, pins, policy, protect) == expected


def test_policy_validates_its_numbers():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError):
            RetentionPolicy(keep_last=bad)
        with pytest.raises(ValueError):
            DirectoryMetadataHandler(keep_every=bad)


# ----------------------------------------------------------------------------- in the handler

def test_keep_last_keeps_exactly_n_across_resumes(tmp_path):
    ref_last, _, _, ref = run(tmp_path / "ref", 6)
    last, counts, _, _ = run(tmp_path / "d", 6, crash_at=4, keep_last=2)
    assert last is None and on_disk(tmp_path / "d") == ([2, 3], [2, 3])
    last, counts, _, blobs = run(tmp_path / "d", 6, keep_last=2)
    assert last == 6 and counts.epochs == [4, 5, 6]
    assert on_disk(tmp_path / "d") == ([5, 6], [5, 6])
    cj.assert_same_blobs(blobs, ref)
    # a rerun of the finished job loads epoch 6 and deletes nothing more
    last, counts, _, _ = run(tmp_path / "d", 6, keep_last=2)
    assert last == 6 and counts.epochs == [] and on_disk(tmp_path / "d") == ([5, 6], [5, 6])


def test_keep_every_keeps_multiples_forever(tmp_path):
    run(tmp_path, 7, crash_at=5, keep_every=3, keep_last=1)
    assert on_disk(tmp_path) == ([0, 3, 4], [0, 3, 4])
    run(tmp_path, 7, keep_every=3, keep_last=1)
    assert on_disk(tmp_path) == ([0, 3, 6, 7], [0, 3, 6, 7])


def test_keep_every_alone_keeps_multiples_and_the_newest(tmp_path):
    run(tmp_path, 5, keep_every=2)
    assert on_disk(tmp_path) == ([0, 2, 4, 5], [0, 2, 4, 5])


def test_pinned_epochs_survive_across_resumes_until_unpinned(tmp_path):
    h = DirectoryMetadataHandler(keep_last=1)
    h.pin(1)  # before set_params: written when the directory is known
    run(tmp_path, 6, crash_at=4, handler=h)
    assert on_disk(tmp_path)[0] == [1, 3]
    assert CheckpointDirectory(str(tmp_path)).pins() == {1}
    h2 = DirectoryMetadataHandler(keep_last=1)
    last, _, h2, _ = run(tmp_path, 6, handler=h2)
    assert last == 6 and on_disk(tmp_path) == ([1, 6], [1, 6])
    h2.pin(6)
    h2.unpin(1)
    assert h2.pins() == {6}
    h2.apply_retention(6)
    assert on_disk(tmp_path) == ([6], [6])
    with pytest.raises(ValueError):
        h2.pin(-1)


def test_retention_never_deletes_the_newest_or_newer_epochs(tmp_path):
    run(tmp_path, 5)
    h = DirectoryMetadataHandler(keep_last=1)
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=list(NODES), path_prefix=None, path_type=None)
    # as after an explicit resume from 2 whose commit of 3 just happened: 4 and 5 will be rewritten
    assert h.apply_retention(3) == [0, 1, 2]
    assert on_disk(tmp_path) == ([3, 4, 5], [3, 4, 5])


def test_an_interrupted_delete_never_leaves_a_manifest_without_dbs(tmp_path, monkeypatch):
    run(tmp_path, 4)
    h = DirectoryMetadataHandler(keep_last=1)
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=list(NODES), path_prefix=None, path_type=None)
    real_unlink = os.unlink
    calls = []

    def dying_unlink(path, *a, **k):
        calls.append(os.path.basename(path))
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies right after deleting one manifest
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(os, "unlink", dying_unlink)
    with pytest.raises(KeyboardInterrupt):
        h.apply_retention(4)
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert calls[0] == "manifest.0.json"  # the manifest goes first
    d = CheckpointDirectory(str(tmp_path))
    for e in d.committed_epochs():
        assert d.verify_epoch(e) == []  # every remaining manifest names files that exist
    assert 0 not in d.committed_epochs() and 0 in d.scan()  # leftover dbs, not an epoch
    h.apply_retention(4)
    assert on_disk(tmp_path) == ([4], [4])


def test_uncommitted_dbs_of_failed_saves_are_removed_by_retention(tmp_path):
    run(tmp_path, 3)
    os.unlink(tmp_path / ".epochal" / "manifest.1.json")  # as if epoch 1's commit had failed
    h = DirectoryMetadataHandler(keep_last=3)
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=list(NODES), path_prefix=None, path_type=None)
    assert h.apply_retention(3) == []
    assert on_disk(tmp_path) == ([0, 2, 3], [0, 2, 3])
