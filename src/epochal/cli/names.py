"""Names of db files in a checkpoint directory (``<node>.<epoch>``)."""

from __future__ import annotations

import os
import re

from ..storage.atomic import parse_temp_path

__all__ = ["RECORDS_DIR", "parse_db_name"]

RECORDS_DIR = ".epochal"
_DB_NAME_RE = re.compile(r"^(?P<node>.+)\.(?P<epoch>\d+)$")


def parse_db_name(path: str) -> tuple[str, int] | None:
    """``(node, epoch)`` of a db file named ``<node>.<epoch>``; None for other names
    (including the temp files of an interrupted write)."""
    base = os.path.basename(path)
    if base.startswith(".") or parse_temp_path(base) is not None:
        return None
    m = _DB_NAME_RE.match(base)
    if m is None:
        return None
    return m.group("node"), int(m.group("epoch"))
