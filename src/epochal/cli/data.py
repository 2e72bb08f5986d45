"""What the ``epochal`` commands compute, as plain JSON-able dicts (no click, no rich).

Every function either returns a dict (what ``--json`` prints, and what the tables show) or
raises :class:`Problem` with one line naming the file or blob at fault. The code lives in one
module per idea; this module re-exports it under its old name:
:mod:`.problems` (the error), :mod:`.values` (summaries of decoded values), :mod:`.names`
(db file names), :mod:`.dbs` (one db: detect, inspect, read, verify), :mod:`.records` (a
checkpoint directory: ls, verify, stats), :mod:`.diff` and :mod:`.export`.
"""

from __future__ import annotations

from .dbs import (
    backend_for,
    blob_record,
    describe_db,
    detect_db_type,
    inspect_blob,
    inspect_db,
    read_blobs,
    verify_file,
)
from .diff import diff_dbs
from .export import export_db
from .names import RECORDS_DIR, parse_db_name
from .problems import Problem
from .records import Records, list_prefix, stats_prefix, verify_target
from .values import array_stats, flatten, iso_time, json_float, jsonable, summarize, to_numpy

__all__ = [
    "RECORDS_DIR",
    "Problem",
    "Records",
    "array_stats",
    "backend_for",
    "blob_record",
    "describe_db",
    "detect_db_type",
    "diff_dbs",
    "export_db",
    "flatten",
    "inspect_blob",
    "inspect_db",
    "iso_time",
    "json_float",
    "jsonable",
    "list_prefix",
    "parse_db_name",
    "read_blobs",
    "stats_prefix",
    "summarize",
    "to_numpy",
    "verify_file",
    "verify_target",
]
