"""The save/load stats log, ``.epochal/stats.jsonl``: one JSON line per db saved or loaded,
appended by the handler after each checkpoint task (``report``) and read by
``CheckpointDirectory.stats`` (``epochal stats``)::

    {"time": "...", "action": "checkpoint_save", "epoch": 4, "node": "trainer_0",
     "db": "ckpt/trainer_0.4", "ns": 5530365, "bytes": 6001746}

``epoch``/``node`` are parsed from the db's name (null when it is not named as a db);
``bytes`` is null when the manager did not say.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from .naming import parse_db_file, split_db_file

__all__ = ["STATS_ACTIONS", "db_node_epoch", "stats_lines"]

#: the actions the managers report
STATS_ACTIONS = ("checkpoint_save", "checkpoint_load", "checkpoint_partial_load")


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
        lines.append(json.dumps({
            "time": time, "action": action, "epoch": epoch, "node": node, "db": db,
            "ns": int(ns), "bytes": int(nbytes) if nbytes is not None else None,
        }, separators=(",", ":")))
    return ("\n".join(lines) + "\n").encode("utf-8")
