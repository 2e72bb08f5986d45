"""The typed Manifest across the handler, the mirror and the tools: exactly the bytes epochal
has always written (golden files), v1 and foreign manifests still read, unknown keys kept on
a rewrite, a NaN metric (null) is a valid record; db names parsed in naming.py only."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import numpy as np
import pytest

import epochal.checkpoint.handler.directory as directory_mod
from epochal.checkpoint.handler.directory import DirectoryMetadataHandler
from epochal.checkpoint.handler.metadata import DbReport
from epochal.checkpoint.location.best import best_of
from epochal.checkpoint.location.manifest import (
    MANIFEST_FORMAT,
    DbEntry,
    KeepBest,
    Manifest,
    decode_manifest,
    encode_manifest,
)
from epochal.checkpoint.location.naming import parse_db_file, split_db_file
from epochal.checkpoint.location.view import CheckpointDirectory
from epochal.cli.names import parse_db_name
from epochal.errors import CheckpointCorruptError
from epochal.storage.formats.base import get_db_type

CREATED = "2026-01-02T03:04:05.678+00:00"

# what epochal wrote before the Manifest dataclass carried these records (same handler calls)
GOLDEN_2 = (
    b'{\n "format": "epochal-manifest",\n "version": 2,\n "epoch": 2,\n "db_type": "native",\n'
    b' "created": "2026-01-02T03:04:05.678+00:00",\n "final": false,\n "nodes": {\n  "n0": {\n'
    b'   "file": "n0.2",\n   "size": 12,\n   "digest": "crc32c:0000abcd"\n  },\n  "n1": {\n'
    b'   "file": "n1.2",\n   "size": 12,\n   "digest": null\n  }\n },\n "metrics": {\n'
    b'  "loss": 1.5,\n  "step": 7\n },\n "keep_best": {\n  "k": 2,\n  "metric": "loss",\n'
    b'  "mode": "max"\n },\n "checksum": "crc32c:83d5321e"\n}\n'
)
GOLDEN_3 = (
    b'{\n "format": "epochal-manifest",\n "version": 2,\n "epoch": 3,\n "db_type": "native",\n'
    b' "created": "2026-01-02T03:04:05.678+00:00",\n "final": true,\n "nodes": {\n  "n0": {\n'
    b'   "file": "n0.3",\n   "size": 13,\n   "digest": "crc32c:0000abce"\n  },\n  "n1": {\n'
    b'   "file": "n1.3",\n   "size": 13,\n   "digest": null\n  }\n },\n "metrics": {\n'
    b'  "loss": null\n },\n "keep_best": {\n  "k": 2,\n  "metric": "loss",\n  "mode": "max"\n },\n'
    b' "checksum": "crc32c:81d7dd16"\n}\n'
)
GOLDEN_2_FINAL = GOLDEN_2.replace(b'"final": false', b'"final": true').replace(
    b"crc32c:83d5321e", b"crc32c:c8079b89")
GOLDEN_PLAIN = (
    b'{\n "format": "epochal-manifest",\n "version": 2,\n "epoch": 0,\n "db_type": "native",\n'
    b' "created": "2026-01-02T03:04:05.678+00:00",\n "final": false,\n "nodes": {\n'
    b'  "trainer_0": {\n   "file": "trainer_0.0",\n   "size": 262,\n'
    b'   "digest": "native1:crc32c:08a557a2:262"\n  }\n },\n "checksum": "crc32c:91246c91"\n}\n'
)


def _manifest_bytes(root: Path, epoch: int) -> bytes:
    return (root / ".epochal" / f"manifest.{epoch}.json").read_bytes()


@pytest.fixture
def fixed_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(directory_mod, "_utcnow", lambda: CREATED)


def _best_k_handler(root: Path, **kw: object) -> DirectoryMetadataHandler:
    """Commits epoch 2 (metrics int and float) and the final epoch 3 (a NaN metric)."""
    h = DirectoryMetadataHandler(keep_best=2, metric="loss", mode="max", **kw)  # type: ignore[arg-type]
    h.set_params(str(root), "native", ["n0", "n1"])
    for e in (2, 3):
        for n in ("n0", "n1"):
            (root / f"{n}.{e}").write_bytes(b"x" * (10 + e))
    h.report_dbs(2, {"n0": DbReport(12, "crc32c:0000abcd"), "n1": DbReport(12, None)})
    h.write(2, metrics={"loss": 1.5, "step": 7})
    h.expect_final(3)
    h.report_dbs(3, {"n0": DbReport(13, "crc32c:0000abce"), "n1": DbReport(13, None)})
    h.write(3, metrics={"loss": float("nan")})
    return h


def test_handler_writes_exactly_the_bytes_it_always_wrote(tmp_path: Path, fixed_time: None) -> None:
    h = _best_k_handler(tmp_path)
    assert _manifest_bytes(tmp_path, 2) == GOLDEN_2
    assert _manifest_bytes(tmp_path, 3) == GOLDEN_3
    h.mark_final(2)
    assert _manifest_bytes(tmp_path, 2) == GOLDEN_2_FINAL
    plain = tmp_path / "plain"
    h2 = DirectoryMetadataHandler()
    h2.set_params(str(plain), "native", ["trainer_0"])
    get_db_type("native").write(str(plain / "trainer_0.0"), {"w": np.arange(3, dtype=np.int64)})
    h2.write(0)
    assert _manifest_bytes(plain, 0) == GOLDEN_PLAIN


def test_typed_manifest_reads_what_the_handler_wrote(tmp_path: Path, fixed_time: None) -> None:
    _best_k_handler(tmp_path)
    d = CheckpointDirectory(str(tmp_path))
    m = d.read_manifest(2)
    assert m == Manifest(
        epoch=2, db_type="native", created=CREATED, final=False,
        nodes={"n0": DbEntry("n0.2", 12, "crc32c:0000abcd"), "n1": DbEntry("n1.2", 12, None)},
        metrics={"loss": 1.5, "step": 7}, keep_best=KeepBest(2, "loss", "max"),
    )
    assert isinstance(m.metrics["step"], int) and m.size == 24
    assert m.encode() == GOLDEN_2 and Manifest.decode(GOLDEN_2, "x", 2) == m
    assert d.manifest(2) == json.loads(GOLDEN_2)  # the dict view stays the JSON, for users
    # a NaN metric is recorded as null: the epoch is committed (it was refused as damaged)
    assert d.committed_epochs() == [2, 3] and d.read_manifest(3).metrics == {"loss": None}
    assert d.check_epoch(3, "none") == [] and d.read_manifest(3).final is True
    best = best_of(d)
    assert best is not None and (best.metric, best.mode, best.k, best.epochs) == ("loss", "max", 2, [2])


def test_version_1_and_foreign_keys(tmp_path: Path) -> None:
    v1 = {"format": MANIFEST_FORMAT, "version": 1, "epoch": 5, "db_type": "native",
          "nodes": {"a": {"file": "a.5", "size": 3}}, "note": {"by": "another tool"},
          "keep_best": {"metric": "loss"}}
    raw = (json.dumps(v1, indent=1) + "\n").encode()
    m = Manifest.decode(raw, "v1", 5)
    assert m.version == 1 and m.created is None and m.final is False and m.nodes["a"] == DbEntry("a.5", 3, None)
    assert m.keep_best is None  # not the shape epochal writes: kept, never read
    assert m.extra == {"note": {"by": "another tool"}, "keep_best": {"metric": "loss"}}
    again = decode_manifest(m.encode(), "v2", 5)
    assert again["version"] == 2 and again["note"] == v1["note"] and again["keep_best"] == v1["keep_best"]
    assert "created" not in again and again["nodes"]["a"] == {"file": "a.5", "size": 3, "digest": None}
    with pytest.raises(CheckpointCorruptError):
        Manifest.decode(raw.replace(b'"a.5"', b'"b.5"'), "v1", 5)  # not its db


def test_mark_final_keeps_keys_it_does_not_know(tmp_path: Path) -> None:
    h = DirectoryMetadataHandler()
    h.set_params(str(tmp_path), "native", ["n"])
    get_db_type("native").write(str(tmp_path / "n.1"), {"w": np.ones(2)})
    h.write(1)
    d = CheckpointDirectory(str(tmp_path))
    data = {**d.manifest(1), "from_a_newer_writer": [1, 2]}
    (tmp_path / ".epochal" / "manifest.1.json").write_bytes(encode_manifest(data))
    h.mark_final(1)
    got = d.manifest(1)
    assert got["final"] is True and got["from_a_newer_writer"] == [1, 2]


def test_mirror_gets_the_local_bytes_and_pull_returns_a_manifest(tmp_path: Path, fixed_time: None) -> None:
    pytest.importorskip("fsspec", reason="the s3 extra is not installed")
    from epochal.checkpoint.mirroring.mirror import RemoteMirror

    url = f"memory://manifest-{secrets.token_hex(4)}/run"
    h = DirectoryMetadataHandler(mirror=url, mirror_background=False)
    h.set_params(str(tmp_path / "a"), "native", ["n"])
    for e in (0, 1):
        get_db_type("native").write(str(tmp_path / "a" / f"n.{e}"), {"w": np.full(3, e)})
        h.write(e)
    h.mark_final(1)
    mirror = RemoteMirror(url)
    for e in (0, 1):
        assert mirror.fs.cat_file(mirror._key(mirror.manifest_name(e))) == _manifest_bytes(tmp_path / "a", e)
    got = mirror.pull(str(tmp_path / "b"), str(tmp_path / "b" / ".epochal"), 1, None, None)
    assert isinstance(got, Manifest) and got.final and got == mirror.read_manifest(1)
    assert _manifest_bytes(tmp_path / "b", 1) == _manifest_bytes(tmp_path / "a", 1)
    assert (tmp_path / "b" / "n.1").read_bytes() == (tmp_path / "a" / "n.1").read_bytes()


def test_db_names_are_parsed_in_one_place(tmp_path: Path) -> None:
    assert split_db_file("trainer_0.12") == ("trainer_0", 12)
    assert split_db_file("a.b.3") == ("a.b", 3)
    assert split_db_file("run-a.b.3", "run-") == ("a.b", 3)
    for name in ("a.01", "a.", ".3", "a.3x", "a.٣", "README", ".epochal", "a.3.tmp.host.12.0a1b2c3d",
                 "a.3.tmp.upload.0a1b2c3d"):
        assert split_db_file(name) is None, name
    assert split_db_file("a.3", "run-") is None
    assert parse_db_file("a.b.3", ["a", "a.b"]) == ("a.b", 3) and parse_db_file("a.03", ["a"]) is None
    assert parse_db_name(str(tmp_path / "n.4")) == ("n", 4) and parse_db_name("s3://b/run/n.4") == ("n", 4)
    # the directory listing and `epochal ls` see the same names
    for name in ("n.0", "n.1", "n.01", "n.2.tmp.upload.0a1b2c3d", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    os.makedirs(tmp_path / ".epochal")
    assert CheckpointDirectory(str(tmp_path)).scan() == {0: {"n": str(tmp_path / "n.0")},
                                                          1: {"n": str(tmp_path / "n.1")}}


def test_stats_lines_name_node_and_epoch_through_naming() -> None:
    from epochal.checkpoint.location.stats import stats_lines

    raw = stats_lines("T", "checkpoint_save", {"d/run-a.1.2": 5, "d/run-a.3": 6, "d/other": 7},
                      {"d/run-a.3": 100}, ["a", "a.1"], "run-")
    lines = [json.loads(x) for x in raw.decode().splitlines()]
    assert raw.endswith(b"\n") and len(lines) == 3
    assert [(x["node"], x["epoch"], x["ns"], x["bytes"]) for x in lines] == [
        ("a.1", 2, 5, None), ("a", 3, 6, 100), (None, None, 7, None)]
    assert lines[0] == {"time": "T", "action": "checkpoint_save", "epoch": 2, "node": "a.1", "db": "d/run-a.1.2",
                        "ns": 5, "bytes": None}
