"""One-pass verified resume: with ``verify="full"`` a resume through ``train()``
or the Checkpointer reads the checkpoint once: the handler checks sizes and digests, the load
checks every checksum before any live object is touched, and an epoch the load finds damaged
is skipped for the previous committed one (never a half-restored model)."""

from __future__ import annotations

import logging
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _crash_job as cj  # noqa: E402

from epochal import (  # noqa: E402
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Workspace,
)
from epochal.checkpoint.handler.directory import DirectoryMetadataHandler  # noqa: E402
from epochal.checkpoint.handler.metadata import BaseMetadataHandler, with_extensions  # noqa: E402
from epochal.errors import CheckpointCorruptError  # noqa: E402
from epochal.storage.formats.native.backend import NativeBackend  # noqa: E402

NODES = ("trainer_0", "trainer_1")


def run(directory, epochs=4, handler=None, resume=None, ws=None):
    handler = handler if handler is not None else DirectoryMetadataHandler()
    job, counts = cj.build_job(epochs, nodes=NODES, size=5000)
    manager = MultiNodeCheckpointManager(str(directory), "native", metadata_handler=handler)
    ws = ws if ws is not None else Workspace()
    last = JobRunner(job, manager, resume_from_epoch=resume, progress=False).train(LocalSession(ws))
    return last, cj.model_blobs(ws), counts


def flip_data(path):
    """Flip one byte in the middle of a db (its data): size and header stay the same."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x5A]))


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    last, blobs, _ = run(tmp_path_factory.mktemp("ref"))
    assert last == 4
    return blobs


def crashed_after(tmp_path, epoch):
    """A run killed during ``epoch + 1`` (epochs 0..epoch committed)."""
    def hook(e, ws):
        if e == epoch + 1:
            raise Stop()
    job, _ = cj.build_job(4, nodes=NODES, hook=hook, size=5000)
    manager = MultiNodeCheckpointManager(str(tmp_path), "native", metadata_handler=DirectoryMetadataHandler())
    with pytest.raises(Stop):
        JobRunner(job, manager, progress=False).train(LocalSession(Workspace()))


def no_full_verify(monkeypatch):
    """Make the separate whole-file check fail loudly: a one-pass resume never calls it."""
    calls = []

    def verify(self, path):
        calls.append(path)
        raise AssertionError(f"a separate full verify of {path} during the resume")

    monkeypatch.setattr(NativeBackend, "verify", verify)
    return calls


def test_resume_through_train_reads_the_checkpoint_once(tmp_path, monkeypatch, reference):
    crashed_after(tmp_path, 2)
    calls = no_full_verify(monkeypatch)
    read_bytes = []
    real_read = NativeBackend.read

    def read(self, path, names=None, **kw):
        read_bytes.append(os.path.basename(path))
        return real_read(self, path, names, **kw)

    monkeypatch.setattr(NativeBackend, "read", read)
    last, blobs, counts = run(tmp_path)
    assert calls == [] and last == 4 and counts.epochs == [3, 4]
    cj.assert_same_blobs(blobs, reference)
    # each node's db of epoch 2 is read by the resume (the blob list, then the blobs)
    assert {"trainer_0.2", "trainer_1.2"} <= set(read_bytes)


def test_damage_found_by_the_load_falls_back_to_the_previous_epoch(tmp_path, monkeypatch, caplog, reference):
    crashed_after(tmp_path, 3)
    flip_data(tmp_path / "trainer_1.3")  # the second node: the first one already loaded epoch 3
    no_full_verify(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="epochal"):
        last, blobs, counts = run(tmp_path)
    assert last == 4 and counts.epochs == [3, 4]  # epoch 3 retrained from epoch 2
    cj.assert_same_blobs(blobs, reference)  # node 0's epoch-3 values were replaced too
    said = [r.getMessage() for r in caplog.records]
    assert any("epoch 3 is damaged" in m and "trainer_1.3" in m for m in said), said
    assert any("Resuming from epoch 2" in m for m in said), said
    # the retrained epoch 3 replaced the damaged db
    assert run(tmp_path, resume=3)[0] == 4


def test_every_epoch_damaged_starts_from_scratch(tmp_path, reference, caplog):
    crashed_after(tmp_path, 1)
    for e in (0, 1):
        flip_data(tmp_path / f"trainer_0.{e}")
    with caplog.at_level(logging.WARNING, logger="epochal"):
        last, blobs, counts = run(tmp_path)
    assert last == 4 and counts.epochs == [1, 2, 3, 4]
    cj.assert_same_blobs(blobs, reference)
    assert any("starting from scratch" in r.getMessage() for r in caplog.records)


def test_an_explicit_damaged_epoch_raises_naming_the_db_and_touches_nothing(tmp_path):
    crashed_after(tmp_path, 2)
    flip_data(tmp_path / "trainer_0.2")
    ws = Workspace()
    ws["trainer_0/w"] = np.full(3, 7.0)
    with pytest.raises(CheckpointCorruptError, match="trainer_0.2"):
        run(tmp_path, resume=2, ws=ws)
    assert ws["trainer_0/w"].tolist() == [7.0, 7.0, 7.0]


def test_quick_keeps_its_meaning_no_fallback(tmp_path):
    crashed_after(tmp_path, 2)
    flip_data(tmp_path / "trainer_0.2")
    with pytest.raises(CheckpointCorruptError, match="trainer_0.2"):
        run(tmp_path, handler=DirectoryMetadataHandler(verify="quick"))


def test_direct_last_epoch_still_checks_every_checksum(tmp_path):
    crashed_after(tmp_path, 2)
    flip_data(tmp_path / "trainer_0.2")
    h = DirectoryMetadataHandler()
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=list(NODES), path_prefix=None, path_type=None)
    assert h.last_epoch() == 1  # a caller that does not load gets a fully verified epoch
    assert h.resume_epoch() == 2  # the loader's choice: sizes and digests (the load checks the rest)
    assert h.reject_epoch(2, "damaged") is True and h.resume_epoch() == 1


def test_a_seed_handler_without_the_extensions_keeps_the_error():
    class Seed:
        def last_epoch(self, user_epoch=None):
            return 5

    h = with_extensions(Seed())
    assert h.resume_epoch() == 5 and h.reject_epoch(5, "x") is False
    assert BaseMetadataHandler().reject_epoch(1, "x") is False


def test_checkpointer_restore_falls_back_and_never_half_restores(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from epochal import Checkpointer

    def state(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        return {"model": model, "opt": torch.optim.AdamW(model.parameters()), "n": 0}

    saved = {}
    with Checkpointer(tmp_path) as ckpt:
        s = state(0)
        for step in (1, 2):
            s["model"](torch.randn(3, 64)).sum().backward()
            s["opt"].step()
            s["n"] = step
            ckpt.save(step, s)
            saved[step] = {k: v.clone() for k, v in s["model"].state_dict().items()}
    flip_data(tmp_path / "local.2")
    no_full_verify(monkeypatch)
    s = state(1)
    model = s["model"]
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(s) == 1
    assert s["model"] is model and s["n"] == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[1][k]), k


def test_a_damaged_local_epoch_is_restored_from_the_mirror_once(tmp_path, caplog, reference):
    import secrets

    url = f"memory://one-pass-{secrets.token_hex(4)}/run"
    assert run(tmp_path, handler=DirectoryMetadataHandler(mirror=url))[0] == 4
    flip_data(tmp_path / "trainer_0.4")
    with caplog.at_level(logging.INFO, logger="epochal"):
        last, blobs, counts = run(tmp_path, handler=DirectoryMetadataHandler(mirror=url))
    assert last == 4 and counts.epochs == []  # the finished job's epoch 4, from the mirror
    cj.assert_same_blobs(blobs, reference)
    said = [r.getMessage() for r in caplog.records]
    assert any("Restored epoch 4 from" in m for m in said), said
    # damaged at both ends: restored once, then skipped for epoch 3 (which is retrained)
    from epochal.storage.formats import remote

    fs, root = remote.filesystem(url)
    flip_data(tmp_path / "trainer_0.4")
    raw = bytearray(fs.cat_file(f"{root}/trainer_0.4"))
    raw[len(raw) // 2] ^= 0x5A
    fs.pipe_file(f"{root}/trainer_0.4", bytes(raw))
    last, blobs, counts = run(tmp_path, handler=DirectoryMetadataHandler(mirror=url))
    assert last == 4 and counts.epochs == [4]
    cj.assert_same_blobs(blobs, reference)
