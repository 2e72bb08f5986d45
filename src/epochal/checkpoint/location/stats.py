"""The save/load stats log, ``.epochal/stats.jsonl``: one JSON line per db saved or loaded,
appended by the handler after each checkpoint task (``report``) and read by
``CheckpointDirectory.stats`` (``epochal stats``)::

    {"time": "...", "action": "checkpoint_save", "epoch": 4, "node": "trainer_0",
     "db": "ckpt/trainer_0.4", "ns": 5530365, "bytes": 6001746}

``epoch``/``node`` are parsed from the db's name (null when it is not named as a db);
``bytes`` is null when the manager did not say.
"""

from __future__ import annotations

import builtins
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from ...errors import CheckpointCorruptError
from .naming import parse_db_file, split_db_file

__all__ = ["STATS_ACTIONS", "StatsLine", "db_node_epoch", "stats_lines"]

#: the actions the managers report
STATS_ACTIONS = ("checkpoint_save", "checkpoint_load", "checkpoint_partial_load")


@dataclass(frozen=True)
class StatsLine:
    """One line of the stats log (the schema of the module docstring, in this one place).
    Every field may be null in a line read back (older or foreign writers); ``ns`` and
    ``bytes`` are never negative."""

    time: str | None
    action: str | None
    epoch: int | None
    node: str | None
    db: str | None
    ns: int | None
    bytes: int | None

    def encode(self) -> builtins.bytes:
        """The line's JSON (compact, fields in schema order), without the newline."""
        return json.dumps(asdict(self), separators=(",", ":")).encode("utf-8")

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict (what :meth:`CheckpointDirectory.stats` returns per line)."""
        return asdict(self)

    @classmethod
    def from_json(cls, entry: Mapping[str, Any], where: str, line: int) -> StatsLine:
        """The line of a parsed JSON object; keys outside the schema are ignored, a missing
        one is null. A field of the wrong type raises
        :class:`~epochal.errors.CheckpointCorruptError` naming ``where`` (the log) and ``line``."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            v: Any = entry.get(f.name)
            want = _TYPES[f.name]
            counted = f.name in ("ns", "bytes")
            if v is not None and (not isinstance(v, want) or isinstance(v, bool)
                                  or (counted and isinstance(v, int) and v < 0)):
                kind = ("a non-negative " if counted else "a ") + want.__name__
                raise CheckpointCorruptError(where, f"line {line}: field {f.name!r} is {v!r}, not {kind}")
            values[f.name] = v
        return cls(**values)

    @classmethod
    def decode(cls, raw: builtins.bytes, where: str, line: int) -> StatsLine:
        """The line of the bytes of one log line (see :meth:`from_json`); bytes that are not
        a JSON object raise :class:`~epochal.errors.CheckpointCorruptError` too."""
        try:
            entry = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as ex:
            raise CheckpointCorruptError(where, f"line {line}: not JSON ({ex})") from None
        if not isinstance(entry, dict):
            raise CheckpointCorruptError(where, f"line {line}: not a JSON object")
        return cls.from_json(entry, where, line)


#: the JSON type of each field's non-null values
_TYPES: dict[str, type] = {"time": str, "action": str, "epoch": int, "node": str, "db": str, "ns": int, "bytes": int}


def db_node_epoch(db: str, node_names: Sequence[str], file_prefix: str = "") -> tuple[str | None, int | None]:
    """``(node, epoch)`` of a db path: one of ``node_names`` first (a node named ``a.1`` is
    not node ``a``), else any db-shaped name; (None, None) for another name."""
    base = os.path.basename(db)
    hit = parse_db_file(base, list(node_names), file_prefix) or split_db_file(base, file_prefix)
    return hit if hit is not None else (None, None)


def stats_lines(
    time: str, action: str, stats: Mapping[str, int], sizes: Mapping[str, int],
    node_names: Sequence[str], file_prefix: str = "",
) -> bytes:
    """The log lines for one report: ``stats`` is ``{db path: ns}``, ``sizes`` ``{db path:
    bytes}`` (a db may be absent); each line ends with a newline."""
    lines = []
    for db, ns in stats.items():
        node, epoch = db_node_epoch(db, node_names, file_prefix)
        nbytes = sizes.get(db)
        lines.append(StatsLine(time, action, epoch, node, db, int(ns), int(nbytes) if nbytes is not None else None).encode())
    return b"\n".join(lines) + b"\n"
