"""DirectoryMetadataHandler and CheckpointDirectory: commits, resume, fallback, stats, temp files."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _crash_job as cj  # noqa: E402

import epochal  # noqa: E402
from epochal import (  # noqa: E402
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Workspace,
)
from epochal.checkpoint.handler.directory import DirectoryMetadataHandler  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory
from epochal.errors import (  # noqa: E402
    CheckpointCorruptError,
    CheckpointNotFoundError,
)
from epochal.storage.io import atomic  # noqa: E402

NODES = ("trainer_0", "trainer_1")


def run(directory, epochs=4, handler=None, nodes=NODES, resume=None, hook=None, size=1000):
    """Train the small job; return (last epoch, blobs, counts, handler)."""
    handler = handler if handler is not None else DirectoryMetadataHandler()
    job, counts = cj.build_job(epochs, nodes=nodes, hook=hook, size=size)
    manager = MultiNodeCheckpointManager(str(directory), "native", metadata_handler=handler)
    ws = Workspace()
    last = JobRunner(job, manager, resume_from_epoch=resume, progress=False).train(LocalSession(ws))
    return last, cj.model_blobs(ws), counts, handler


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final blobs of an uninterrupted 4-epoch run."""
    last, blobs, _, _ = run(tmp_path_factory.mktemp("ref"))
    assert last == 4
    return blobs


def flip_byte(path, offset_from_end=None):
    """Flip one byte in the data region (the middle of the file)."""
    size = os.path.getsize(path)
    pos = size // 2 if offset_from_end is None else size - offset_from_end
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x5A]))


class Interrupt(Exception):
    pass


def crash_at(epoch):
    def hook(e, ws):
        if e == epoch:
            raise Interrupt(f"crash in epoch {e}")
    return hook


# ----------------------------------------------------------------------------- commits

def test_fresh_run_commits_every_epoch_with_contract_manifests(tmp_path):
    last, _, counts, handler = run(tmp_path)
    assert last == 4 and counts.epochs == [1, 2, 3, 4]
    assert handler.committed_epochs() == [0, 1, 2, 3, 4]
    d = CheckpointDirectory(str(tmp_path))
    assert d.records_dir == os.path.join(str(tmp_path), ".epochal")
    m = d.manifest(4)
    assert set(m) == {"format", "version", "epoch", "db_type", "created", "final", "nodes", "checksum"}
    assert m["format"] == "epochal-manifest" and m["version"] == 2 and m["epoch"] == 4
    from epochal.checkpoint.location.manifest import content_checksum

    assert m["checksum"] == content_checksum(m) and m["checksum"].startswith("crc32c:")
    assert m["db_type"] == "native" and m["final"] is True and d.manifest(3)["final"] is False
    assert m["created"].endswith("+00:00")
    assert set(m["nodes"]) == set(NODES)
    backend = epochal.get_db_type("native")
    for node, entry in m["nodes"].items():
        path = os.path.join(str(tmp_path), f"{node}.4")
        assert entry == {"file": f"{node}.4", "size": os.path.getsize(path), "digest": backend.digest(path)}
    assert d.scan() == {e: {n: os.path.join(str(tmp_path), f"{n}.{e}") for n in NODES} for e in range(5)}
    for e in range(5):
        assert d.verify_epoch(e) == []


def test_an_epoch_without_manifest_does_not_exist(tmp_path):
    run(tmp_path, epochs=3)
    os.unlink(os.path.join(str(tmp_path), ".epochal", "manifest.3.json"))
    h = DirectoryMetadataHandler()
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=list(NODES), path_prefix=None, path_type=None)
    assert h.committed_epochs() == [0, 1, 2]
    assert h.last_epoch() == 2
    with pytest.raises(CheckpointNotFoundError, match="manifest.3.json"):
        h.last_epoch(user_epoch=3)
    assert h.last_epoch(user_epoch=1) == 1


def test_stats_log_records_saves_loads_and_partial_loads(tmp_path):
    run(tmp_path, epochs=2)
    last, _, _, handler = run(tmp_path, epochs=2)  # finished job: a load, no save
    assert last == 2
    job, _ = cj.build_job(2, nodes=NODES)
    manager = MultiNodeCheckpointManager(str(tmp_path), "native", metadata_handler=handler)
    runner = JobRunner(job, manager, progress=False)
    session = LocalSession(Workspace())
    assert runner.load_blobs_from_checkpoints(["w", "step"], 1, session)
    assert int(session.ws["step"]) == 1
    stats = CheckpointDirectory(str(tmp_path)).stats()
    saves = [s for s in stats if s["action"] == "checkpoint_save"]
    loads = [s for s in stats if s["action"] == "checkpoint_load"]
    partial = [s for s in stats if s["action"] == "checkpoint_partial_load"]
    assert [(s["epoch"], s["node"]) for s in saves] == [(e, n) for e in range(3) for n in NODES]
    assert [(s["epoch"], s["node"]) for s in loads] == [(2, n) for n in NODES]
    assert [(s["epoch"], s["node"]) for s in partial] == [(1, n) for n in NODES]
    for s in stats:
        assert set(s) == {"time", "action", "epoch", "node", "db", "ns", "bytes"}
        assert s["db"] == os.path.join(str(tmp_path), f"{s['node']}.{s['epoch']}")
        assert isinstance(s["ns"], int) and s["ns"] >= 0
        assert isinstance(s["bytes"], int) and s["bytes"] > 0
    for s in saves:
        assert s["bytes"] == os.path.getsize(s["db"])


def test_stats_without_report_bytes_and_torn_last_line(tmp_path):
    h = DirectoryMetadataHandler()
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=["n"], path_prefix=None, path_type=None)
    h.report("checkpoint_save", {os.path.join(str(tmp_path), "n.3"): 12})
    with open(os.path.join(str(tmp_path), ".epochal", "stats.jsonl"), "ab") as f:
        f.write(b'{"time": "2024-01-01T00:00:00+00:00", "act')  # a write torn by a crash
    d = CheckpointDirectory(str(tmp_path))
    assert [s["epoch"] for s in d.stats()] == [3]
    h.report("checkpoint_load", {os.path.join(str(tmp_path), "n.3"): 5})
    stats = d.stats()
    assert [(s["action"], s["node"], s["epoch"], s["ns"], s["bytes"]) for s in stats] == [
        ("checkpoint_save", "n", 3, 12, None), ("checkpoint_load", "n", 3, 5, None)]


def test_node_names_with_dots_are_parsed_with_the_known_names(tmp_path):
    h = DirectoryMetadataHandler()
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=["a.1", "a"], path_prefix=None, path_type=None)
    h.report_bytes("checkpoint_save", {os.path.join(str(tmp_path), "a.1.7"): 99})
    h.report("checkpoint_save", {os.path.join(str(tmp_path), "a.1.7"): 1, os.path.join(str(tmp_path), "a.2"): 2})
    got = [(s["node"], s["epoch"], s["bytes"]) for s in CheckpointDirectory(str(tmp_path)).stats()]
    assert got == [("a.1", 7, 99), ("a", 2, None)]


# ----------------------------------------------------------------------------- resume

def test_rerunning_an_interrupted_job_resumes_and_matches(tmp_path, reference):
    with pytest.raises(Interrupt):
        run(tmp_path, hook=crash_at(3))
    assert DirectoryMetadataHandler().committed_epochs() == []  # no set_params: nothing known
    last, blobs, counts, handler = run(tmp_path)
    assert last == 4 and counts.epochs == [3, 4]
    cj.assert_same_blobs(blobs, reference)
    assert handler.committed_epochs() == [0, 1, 2, 3, 4]


def test_rerunning_a_finished_job_runs_no_epoch(tmp_path, reference):
    run(tmp_path)
    last, blobs, counts, _ = run(tmp_path)
    assert last == 4 and counts.epochs == [] and counts.downloads == 1 and counts.exits == 1
    cj.assert_same_blobs(blobs, reference)
    assert not os.path.exists(os.path.join(str(tmp_path), "trainer_0.5"))
    # an explicit resume epoch is obeyed even on a finished job (the seed's behaviour)
    last, _, counts, _ = run(tmp_path, resume=4)
    assert last == 5 and counts.epochs == [5]


def test_a_legacy_mark_final_only_path_works(tmp_path):
    """Without expect_final, mark_final after the commit still marks the manifest."""
    run(tmp_path, epochs=2)
    d = CheckpointDirectory(str(tmp_path))
    m = d.manifest(2)
    m["final"] = False
    from epochal.checkpoint.location.manifest import encode_manifest

    atomic.atomic_write_bytes(d.manifest_path(2), encode_manifest(m))  # re-checksummed: valid
    h = DirectoryMetadataHandler()
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=list(NODES), path_prefix=None, path_type=None)
    assert not h.is_final(2)
    h.mark_final(2)
    assert h.is_final(2) and d.manifest(2)["final"] is True
    assert not h.is_final(1) and not h.is_final(99)
    h.mark_final(99)  # never raises: a warning


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest_json", "manifest_digest", "manifest_edit"])
def test_damaged_newest_epoch_falls_back_to_the_previous_one(tmp_path, reference, caplog, damage):
    with pytest.raises(Interrupt):
        run(tmp_path, hook=crash_at(4))  # epochs 0..3 committed
    victim = os.path.join(str(tmp_path), "trainer_1.3")
    manifest = os.path.join(str(tmp_path), ".epochal", "manifest.3.json")
    named = victim
    if damage == "flip":
        flip_byte(victim)
    elif damage == "truncate":
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) - 100)
    elif damage == "delete":
        os.unlink(victim)
    elif damage == "manifest_json":
        with open(manifest, "r+b") as f:
            f.truncate(20)
        named = manifest
    elif damage == "manifest_digest":  # a consistent manifest whose digest does not match
        from epochal.checkpoint.location.manifest import encode_manifest

        m = json.load(open(manifest))
        m["nodes"]["trainer_1"]["digest"] = "native1:crc32c:00000000:1"
        open(manifest, "wb").write(encode_manifest(m))
    else:  # an edit that leaves the manifest's own checksum stale
        m = json.load(open(manifest))
        m["nodes"]["trainer_1"]["size"] += 1
        open(manifest, "w").write(json.dumps(m))
        named = manifest
    with caplog.at_level(logging.WARNING, logger="epochal"):
        last, blobs, counts, _ = run(tmp_path)
    assert counts.epochs == [3, 4] and last == 4
    cj.assert_same_blobs(blobs, reference)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("epoch 3" in w and named in w for w in warnings), warnings


def test_quick_verify_misses_data_flips_but_load_still_refuses_them(tmp_path):
    """verify="quick" trusts size+digest; the load's own checksums still refuse the damage."""
    with pytest.raises(Interrupt):
        run(tmp_path, hook=crash_at(3))
    flip_byte(os.path.join(str(tmp_path), "trainer_0.2"))
    h = DirectoryMetadataHandler(verify="quick")
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=list(NODES), path_prefix=None, path_type=None)
    assert h.last_epoch() == 2
    with pytest.raises(CheckpointCorruptError, match="trainer_0.2"):
        run(tmp_path, handler=DirectoryMetadataHandler(verify="quick"))
    # the full verify (default) falls back instead
    last, _, counts, _ = run(tmp_path)
    assert counts.epochs == [2, 3, 4] and last == 4


def test_user_epoch_must_be_committed_and_intact(tmp_path):
    run(tmp_path, epochs=3)
    flip_byte(os.path.join(str(tmp_path), "trainer_0.1"))
    h = DirectoryMetadataHandler()
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=list(NODES), path_prefix=None, path_type=None)
    assert h.last_epoch(user_epoch=2) == 2
    with pytest.raises(CheckpointCorruptError, match="trainer_0.1"):
        h.last_epoch(user_epoch=1)
    with pytest.raises(CheckpointNotFoundError):
        h.last_epoch(user_epoch=7)


def test_every_epoch_damaged_starts_from_scratch(tmp_path, reference, caplog):
    with pytest.raises(Interrupt):
        run(tmp_path, hook=crash_at(2))  # epochs 0, 1
    for e in (0, 1):
        flip_byte(os.path.join(str(tmp_path), f"trainer_0.{e}"))
    with caplog.at_level(logging.WARNING, logger="epochal"):
        last, blobs, counts, _ = run(tmp_path)
    assert counts.epochs == [1, 2, 3, 4]
    cj.assert_same_blobs(blobs, reference)
    assert any("starting from scratch" in r.getMessage() for r in caplog.records)


def test_changed_node_list_is_not_resumed(tmp_path):
    run(tmp_path, epochs=2, nodes=("trainer_0",))
    h = DirectoryMetadataHandler()
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=list(NODES), path_prefix=None, path_type=None)
    assert h.last_epoch() is None  # no epoch has every node's db


def test_verify_none_trusts_the_manifest(tmp_path):
    run(tmp_path, epochs=2)
    h = DirectoryMetadataHandler(verify="none")
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=list(NODES), path_prefix=None, path_type=None)
    flip_byte(os.path.join(str(tmp_path), "trainer_0.2"))
    assert h.last_epoch() == 2
    os.unlink(os.path.join(str(tmp_path), "trainer_0.2"))
    assert h.last_epoch() == 1  # a missing file is still noticed
    with pytest.raises(ValueError):
        DirectoryMetadataHandler(verify="sometimes")


def test_a_handler_with_only_the_five_methods_still_works(tmp_path, reference):
    class Five:
        def __init__(self):
            self.calls = []

        def set_params(self, db_prefix, db_type, node_names, path_prefix, path_type):
            self.calls.append("set_params")

        def last_epoch(self, user_epoch=None):
            return user_epoch

        def write(self, epoch):
            self.calls.append(f"write{epoch}")

        def report(self, action_name, stats):
            self.calls.append(action_name)

        def cp_accessible(self, epoch=None):
            return True

    h = Five()
    last, blobs, _, _ = run(tmp_path, handler=h)
    assert last == 4
    cj.assert_same_blobs(blobs, reference)
    assert h.calls.count("checkpoint_save") == 5 and "write4" in h.calls


# ----------------------------------------------------------------------------- cp_accessible

def test_cp_accessible_creates_the_directory(tmp_path):
    target = tmp_path / "new" / "ckpt"
    h = DirectoryMetadataHandler()
    h.set_params(db_prefix=str(target), db_type="native", node_names=["n"], path_prefix=None, path_type=None)
    assert h.cp_accessible() is True
    assert (target / ".epochal").is_dir()
    last, _, _, _ = run(tmp_path / "fresh" / "dir", epochs=1)
    assert last == 1


def test_cp_accessible_estimates_room_from_the_previous_checkpoint(tmp_path, monkeypatch, caplog):
    run(tmp_path, epochs=1, size=20000)
    h = DirectoryMetadataHandler()
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=list(NODES), path_prefix=None, path_type=None)
    need = sum(e["size"] for e in CheckpointDirectory(str(tmp_path)).manifest(1)["nodes"].values())
    real = os.statvfs

    class Fake:
        def __init__(self, free):
            self.f_bavail, self.f_frsize = free, 1

    monkeypatch.setattr(os, "statvfs", lambda p: Fake(need // 2))
    with caplog.at_level(logging.WARNING, logger="epochal"):
        assert h.cp_accessible() is False
    assert any("free space" in r.getMessage() and str(need // 2) in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(os, "statvfs", lambda p: Fake(need * 2))
    assert h.cp_accessible() is True
    monkeypatch.setattr(os, "statvfs", real)


def test_cp_accessible_refuses_an_unwritable_directory(tmp_path, monkeypatch, caplog):
    h = DirectoryMetadataHandler()
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=["n"], path_prefix=None, path_type=None)
    monkeypatch.setattr(os, "access", lambda p, mode: False)  # root can write anywhere: fake it
    with caplog.at_level(logging.WARNING, logger="epochal"):
        assert h.cp_accessible() is False
    assert any("not writable" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- temp files

def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftover_temp_files_of_dead_local_processes_are_cleaned_on_start(tmp_path):
    run(tmp_path, epochs=1)
    host, dead = atomic.hostname(), _dead_pid()
    mine = [
        tmp_path / f"trainer_0.2.tmp.{host}.{dead}.0badc0de",
        tmp_path / ".epochal" / f"manifest.2.json.tmp.{host}.{dead}.12345678",
    ]
    keep = [
        tmp_path / f"trainer_0.2.tmp.otherhost.{dead}.0badc0de",  # another host: never touched
        tmp_path / f"trainer_0.2.tmp.{host}.{os.getppid()}.00000001",  # a live process
    ]
    for p in mine + keep:
        p.write_bytes(b"partial")
    d = CheckpointDirectory(str(tmp_path))
    assert 2 not in d.scan()  # temp files are never taken for dbs
    last, _, counts, h = run(tmp_path, epochs=1)
    assert counts.epochs == [] and last == 1
    assert not any(p.exists() for p in mine)
    assert all(p.exists() for p in keep)
    assert h.clean_temp_files() == []
    h2 = DirectoryMetadataHandler(clean_temp=False)
    (tmp_path / f"x.1.tmp.{host}.{dead}.abcdef01").write_bytes(b"")
    h2.set_params(db_prefix=str(tmp_path), db_type="native", node_names=["x"], path_prefix=None, path_type=None)
    assert (tmp_path / f"x.1.tmp.{host}.{dead}.abcdef01").exists()


# ----------------------------------------------------------------------------- the reader

def test_checkpoint_directory_reports_damage_naming_file_and_blob(tmp_path):
    run(tmp_path, epochs=1, size=50000)
    d = CheckpointDirectory(str(tmp_path))
    assert d.committed_epochs() == [0, 1]
    flip_byte(os.path.join(str(tmp_path), "trainer_0.1"))
    problems = d.verify_epoch(1)
    assert len(problems) == 1 and os.path.join(str(tmp_path), "trainer_0.1") in problems[0]
    assert "blob" in problems[0]
    assert d.verify_epoch(1, full=False) == []  # data flips need the full check
    with pytest.raises(CheckpointNotFoundError):
        d.manifest(5)
    (tmp_path / ".epochal" / "manifest.7.json").write_text('{"format": "epochal-manifest"')
    with pytest.raises(CheckpointCorruptError, match="manifest.7.json"):
        d.manifest(7)
    (tmp_path / ".epochal" / "manifest.8.json").write_text(json.dumps({**d.manifest(0), "epoch": 0}))
    with pytest.raises(CheckpointCorruptError, match="epoch is 0"):
        d.manifest(8)
    evil = {**d.manifest(0), "epoch": 9, "nodes": {"trainer_0": {"file": "../x", "size": 1, "digest": None}}}
    from epochal.checkpoint.location.manifest import encode_manifest

    (tmp_path / ".epochal" / "manifest.9.json").write_bytes(encode_manifest(evil))  # checksum valid
    with pytest.raises(CheckpointCorruptError, match="'../x' is not the name of its db of epoch 9"):
        d.manifest(9)
    assert d.committed_epochs() == [0, 1]
    assert d.pins() == set()


def test_scan_sees_uncommitted_dbs_and_skips_other_files(tmp_path):
    run(tmp_path, epochs=1)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "trainer_0.x").write_text("x")
    (tmp_path / "sub.3").mkdir()
    os.unlink(tmp_path / ".epochal" / "manifest.1.json")
    d = CheckpointDirectory(str(tmp_path))
    assert sorted(d.scan()) == [0, 1] and d.committed_epochs() == [0]
    assert CheckpointDirectory(str(tmp_path / "missing")).scan() == {}
    assert CheckpointDirectory(str(tmp_path / "missing")).committed_epochs() == []
    assert CheckpointDirectory(str(tmp_path / "missing")).stats() == []


def test_lazy_export():
    assert epochal.DirectoryMetadataHandler is DirectoryMetadataHandler
    h = DirectoryMetadataHandler()
    assert h  # truthy, so the seed's `if handler:` calls happen
    assert h.committed_epochs() == [] and np.isscalar(len(repr(h)))


def test_a_reused_handler_forgets_the_previous_runs_final_epoch(tmp_path):
    h = DirectoryMetadataHandler()
    run(tmp_path, epochs=2, handler=h)
    assert h.is_final(2) and not h.is_final(1)
    h.expect_final(1)  # a run that ended at 1 ... then a new run starts with the same handler
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=list(NODES), path_prefix=None, path_type=None)
    h.write(1)  # rewritten on the way to a later stop: not final
    assert not h.is_final(1)
    h.expect_final(1)
    h.write(1)
    assert h.is_final(1)


def test_a_step_written_by_other_nodes_is_refused_naming_them_not_skipped(tmp_path):
    """A step whose manifest lists none of this job's nodes (here: two JAX processes' dbs) is
    not a damaged step to skip for an older one: the resume is refused, naming both node sets,
    and nothing is restored."""
    from epochal import Checkpointer

    d = str(tmp_path / "ck")
    with Checkpointer(d, progress=False) as ck:
        ck.save(4, {"w": np.arange(4.0)})
    mdir = os.path.join(d, ".epochal")
    manifest = json.load(open(os.path.join(mdir, "manifest.4.json")))
    entry = manifest["nodes"].pop("local")
    for i in (0, 1):  # the same bytes under two process nodes, as a multi-process JAX save names them
        with open(os.path.join(d, "local.4"), "rb") as src, open(os.path.join(d, f"proc{i}.5"), "wb") as dst:
            dst.write(src.read())
        manifest["nodes"][f"proc{i}"] = dict(entry, file=f"proc{i}.5")
    manifest["epoch"] = 5
    from epochal.checkpoint.location.manifest import encode_manifest

    with open(os.path.join(mdir, "manifest.5.json"), "wb") as f:
        f.write(encode_manifest(manifest))
    live = {"w": np.zeros(4)}
    with Checkpointer(d, progress=False) as ck, pytest.raises(epochal.CheckpointError) as err:
        ck.restore(live)
    text = str(err.value)
    assert "manifest.5.json" in text and "proc0" in text and "proc1" in text and "local" in text
    assert not live["w"].any()  # nothing restored, and not the older step 4 either
