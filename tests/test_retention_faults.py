"""Issue 23 item 1: retention and leftover cleanup delete only what they know they may delete.

Faults are injected at the record-store seam (:class:`~epochal.checkpoint.location.records.RecordStore`):
a manifest that exists but cannot be read at that moment (EMFILE, EIO, a failed GET at a URL)
or parsed (one flipped bit) keeps its epoch, named in a warning; a resume retries a transient
read error on the newest manifest instead of rolling back.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
from typing import Any

import numpy as np
import pytest

from epochal.checkpoint.handler.directory import DirectoryMetadataHandler
from epochal.checkpoint.location.view import CheckpointDirectory
from epochal.storage.formats.base import get_db_type

NODES = ("trainer_0", "trainer_1")


class FlakyRecords:
    """A RecordStore whose reads of paths ending in ``suffix`` fail with ``err`` (``times``
    times; None: every time). Everything else goes to the real store."""

    def __init__(self, inner: Any, suffix: str, err: int = errno.EMFILE, times: int | None = None) -> None:
        self.inner, self.suffix, self.err, self.left = inner, suffix, err, times
        self.failed = 0

    def read(self, path: str) -> bytes:
        if path.endswith(self.suffix) and (self.left is None or self.left > 0):
            if self.left is not None:
                self.left -= 1
            self.failed += 1
            raise OSError(self.err, os.strerror(self.err), path)
        return self.inner.read(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def handler(where: str, **kw: Any) -> DirectoryMetadataHandler:
    h = DirectoryMetadataHandler(**kw)
    h.set_params(db_prefix=where, db_type="native", node_names=list(NODES), path_prefix=None, path_type=None)
    return h


def commit(h: DirectoryMetadataHandler, epoch: int, loss: float | None = None) -> None:
    d = h.directory
    assert d is not None
    for n in NODES:
        get_db_type("native").write(d.db_path(n, epoch), {"w": np.full(8, epoch, np.float32)})
    h.write(epoch, metrics=None if loss is None else {"loss": loss})


def dbs_of(d: CheckpointDirectory) -> list[int]:
    return sorted(e for e, dbs in d.scan().items() if set(dbs) == set(NODES))


def manifests_of(d: CheckpointDirectory) -> list[int]:
    return d.manifest_epochs()


def inject(h: DirectoryMetadataHandler, epoch: int, **kw: Any) -> FlakyRecords:
    d = h.directory
    assert d is not None
    flaky = FlakyRecords(d.records, f"manifest.{epoch}.json", **kw)
    d.records = flaky  # type: ignore[assignment]
    return flaky


def heal(h: DirectoryMetadataHandler) -> None:
    d = h.directory
    assert d is not None and isinstance(d.records, FlakyRecords)
    d.records = d.records.inner


@pytest.mark.parametrize("err", [errno.EMFILE, errno.EIO])
def test_keep_best_never_deletes_the_best_epoch_whose_manifest_cannot_be_read(tmp_path, caplog, err):
    h = handler(str(tmp_path), keep_best=1, metric="loss")
    for epoch, loss in enumerate([5.0, 1.0, 3.0]):
        commit(h, epoch, loss)
    d = h.directory
    assert d is not None and d.committed_epochs() == [1, 2]
    flaky = inject(h, 1, err=err)  # epoch 1 (the best) cannot be read during the next commit
    with caplog.at_level(logging.WARNING, logger="epochal"):
        commit(h, 3, 4.0)
    assert flaky.failed >= 3  # retried before giving up
    heal(h)
    # the best kept (2 too: the best of those it could rank, while 1 could not be ranked)
    assert d.committed_epochs() == [1, 2, 3]
    assert dbs_of(d) == [1, 2, 3] and d.verify_epoch(1) == []
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("keeps epoch(s) 1" in m and "manifest.1.json" in m for m in warned), warned
    commit(h, 4, 6.0)  # readable again: exactly the best and the newest
    assert d.committed_epochs() == [1, 4] and dbs_of(d) == [1, 4]


def test_keep_last_keeps_the_second_newest_whose_manifest_cannot_be_read(tmp_path, caplog):
    h = handler(str(tmp_path), keep_last=3)
    for epoch in range(5):
        commit(h, epoch)
    d = h.directory
    assert d is not None and d.committed_epochs() == [2, 3, 4]
    inject(h, 4)  # the second-newest once 5 is committed
    with caplog.at_level(logging.WARNING, logger="epochal"):
        commit(h, 5)
    heal(h)
    assert d.committed_epochs() == [2, 3, 4, 5] and dbs_of(d) == [2, 3, 4, 5]
    assert d.verify_epoch(4) == []
    assert any("keeps epoch(s) 4" in r.getMessage() for r in caplog.records)
    commit(h, 6)  # readable again: the policy applies as usual
    assert d.committed_epochs() == [4, 5, 6] and dbs_of(d) == [4, 5, 6]


def test_keep_every_epoch_with_a_flipped_bit_in_its_manifest_is_kept_not_a_leftover(tmp_path, caplog):
    h = handler(str(tmp_path), keep_last=1, keep_every=2)
    for epoch in range(4):
        commit(h, epoch)
    d = h.directory
    assert d is not None and d.committed_epochs() == [0, 2, 3]
    path = d.manifest_path(2)
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x04
    open(path, "wb").write(bytes(raw))
    assert d.committed_epochs() == [0, 3]
    with caplog.at_level(logging.WARNING, logger="epochal"):
        commit(h, 4)
    assert os.path.exists(path) and open(path, "rb").read() == bytes(raw)  # the manifest stays
    assert dbs_of(d) == [0, 2, 4]  # epoch 2's intact dbs stay; 3 dropped by keep_last
    # keep_every keeps it by its number, unread (retention's reads do not grow with the
    # history): the tools name it
    assert any("manifest.2.json" in p.path for p in d.epoch_problems(2, "none"))


def test_leftovers_are_only_dbs_without_any_manifest_file_older_than_the_newest(tmp_path):
    h = handler(str(tmp_path), keep_last=1)
    for epoch in range(3):
        commit(h, epoch)
    d = h.directory
    assert d is not None
    for n in NODES:  # dbs of a killed save (no manifest) at 3, and of one newer than the commit
        get_db_type("native").write(d.db_path(n, 3), {"w": np.zeros(2)})
        get_db_type("native").write(d.db_path(n, 9), {"w": np.zeros(2)})
    commit(h, 4)
    assert dbs_of(d) == [4, 9]  # 3 had no manifest and is older than 4: a leftover


def test_url_location_a_failed_get_keeps_the_epoch(caplog):
    pytest.importorskip("fsspec")
    url = f"memory://retention-{secrets.token_hex(4)}/run"
    h = handler(url, keep_last=2)
    for epoch in range(3):
        commit(h, epoch)
    d = h.directory
    assert d is not None and d.committed_epochs() == [1, 2]
    inject(h, 2, err=errno.ECONNRESET)
    with caplog.at_level(logging.WARNING, logger="epochal"):
        commit(h, 3)
    heal(h)
    assert d.committed_epochs() == [1, 2, 3]
    assert any("keeps epoch(s) 2" in r.getMessage() for r in caplog.records)


def test_resume_retries_a_transient_read_error_on_the_newest_manifest(tmp_path):
    h = handler(str(tmp_path))
    for epoch in range(3):
        commit(h, epoch)
    flaky = inject(h, 2, err=errno.EIO, times=1)
    assert h.resume_epoch() == 2  # not rolled back to 1
    assert h.last_epoch() == 2
    assert flaky.failed == 1
    flaky = inject(h, 2, err=errno.EIO)  # an error that lasts: then it is skipped, named
    assert h.resume_epoch() == 1
    assert flaky.failed == 3
