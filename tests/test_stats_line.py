"""StatsLine: the one schema of the lines of .epochal/stats.jsonl (encode/decode, refusal of a
malformed line naming the file and the line)."""

from __future__ import annotations

import json
import os

import pytest

from epochal import CheckpointDirectory, DirectoryMetadataHandler
from epochal.checkpoint.location.stats import StatsLine, stats_lines
from epochal.errors import CheckpointCorruptError

LINE = StatsLine("2026-01-01T00:00:00+00:00", "checkpoint_save", 4, "trainer_0", "ckpt/trainer_0.4", 5530365, 6001746)


def test_round_trip_and_the_bytes_of_a_line():
    raw = LINE.encode()
    assert raw == (b'{"time":"2026-01-01T00:00:00+00:00","action":"checkpoint_save","epoch":4,'
                   b'"node":"trainer_0","db":"ckpt/trainer_0.4","ns":5530365,"bytes":6001746}')
    assert StatsLine.decode(raw, "log", 1) == LINE
    nulls = StatsLine("t", "checkpoint_load", None, None, "other", 7, None)
    assert StatsLine.decode(nulls.encode(), "log", 1) == nulls
    assert LINE.as_dict() == json.loads(raw)


def test_the_handlers_lines_are_stats_lines():
    raw = stats_lines("T", "checkpoint_save", {"d/a.3": 6, "d/x": 7}, {"d/a.3": 100}, ["a"])
    got = [StatsLine.decode(x, "log", i) for i, x in enumerate(raw.splitlines(), 1)]
    assert got == [StatsLine("T", "checkpoint_save", 3, "a", "d/a.3", 6, 100),
                   StatsLine("T", "checkpoint_save", None, None, "d/x", 7, None)]


def test_missing_and_extra_keys():
    line = StatsLine.from_json({"action": "checkpoint_save", "ns": 3, "future": [1]}, "log", 1)
    assert line == StatsLine(None, "checkpoint_save", None, None, None, 3, None)


@pytest.mark.parametrize("field,value,want", [
    ("ns", "q", "a non-negative int"), ("ns", -3, "a non-negative int"), ("bytes", {}, "a non-negative int"),
    ("epoch", "zz", "a int"), ("epoch", True, "a int"), ("action", 5, "a str"), ("node", [1], "a str"),
])
def test_a_malformed_line_is_refused_naming_file_and_line(field, value, want):
    entry = LINE.as_dict() | {field: value}
    with pytest.raises(CheckpointCorruptError) as e:
        StatsLine.decode(json.dumps(entry).encode(), "/x/.epochal/stats.jsonl", 12)
    assert e.value.path == "/x/.epochal/stats.jsonl"
    assert e.value.message == f"line 12: field {field!r} is {value!r}, not {want}"


def test_bytes_that_are_not_a_json_object_are_refused():
    for raw in (b'{"time": "t", "act', b"[1, 2]", b"\xff"):
        with pytest.raises(CheckpointCorruptError, match="stats.jsonl: line 3: not"):
            StatsLine.decode(raw, "stats.jsonl", 3)


def test_the_directory_reads_typed_lines_and_names_the_bad_line(tmp_path):
    h = DirectoryMetadataHandler()
    h.set_params(db_prefix=str(tmp_path), db_type="native", node_names=["n"], path_prefix=None, path_type=None)
    h.report("checkpoint_save", {os.path.join(str(tmp_path), "n.3"): 12})
    log = tmp_path / ".epochal" / "stats.jsonl"
    with open(log, "ab") as f:
        f.write(b'{"time": "t", "act\n')  # torn by a crash: skipped
    d = CheckpointDirectory(str(tmp_path))
    [line] = d.stats_lines()
    assert (line.action, line.node, line.epoch, line.ns, line.bytes) == ("checkpoint_save", "n", 3, 12, None)
    assert d.stats() == [line.as_dict()]
    with open(log, "ab") as f:
        f.write(json.dumps(line.as_dict() | {"ns": "slow"}).encode() + b"\n")
    with pytest.raises(CheckpointCorruptError, match=r"stats\.jsonl: line 3: field 'ns' is 'slow'"):
        d.stats_lines()
