"""Names of db files in a checkpoint directory (``<node>.<epoch>``), as the commands see
them: parsed by :mod:`epochal.checkpoint.location.naming`, the one place that knows db names."""

from __future__ import annotations

import os

from ..checkpoint.location.naming import RECORDS_DIR, split_db_file

__all__ = ["RECORDS_DIR", "parse_db_name"]


def parse_db_name(path: str) -> tuple[str, int] | None:
    """``(node, epoch)`` of a db file (a path or URL) named ``<node>.<epoch>``; None for other
    names (including the temp files of an interrupted write)."""
    return split_db_file(os.path.basename(path))
