"""Names of db files in a checkpoint directory (``<node>.<epoch>``, at a URL with a writer's
token after it), as the commands see them: parsed by :mod:`epochal.checkpoint.location.naming`,
the one place that knows db names."""

from __future__ import annotations

import os

from ..checkpoint.location.naming import RECORDS_DIR, db_token, split_db_file
from ..errors import CheckpointError
from ..storage.io.seam import store_for

__all__ = ["RECORDS_DIR", "parse_db_name", "resolve_db_url"]


def parse_db_name(path: str) -> tuple[str, int] | None:
    """``(node, epoch)`` of a db file (a path or URL) named ``<node>.<epoch>``; None for other
    names (including the temp files of an interrupted write)."""
    return split_db_file(os.path.basename(path))


def resolve_db_url(url: str) -> str:
    """The db a user named as ``<prefix>/<node>.<epoch>`` at a URL, where each writer's db
    name carries its token (``<node>.<epoch>.<token>``): that db, as the epoch's manifest
    under ``<prefix>`` names it, when no object is at ``url`` itself; else ``url`` unchanged
    (an existing object, a name with a token, a prefix: the command's own error names it)."""
    from ..checkpoint.location.view import CheckpointDirectory
    from ..storage.io.remote.fsspec_store import storage_options_for

    head, _, name = url.rstrip("/").rpartition("/")
    parsed = split_db_file(name)
    if parsed is None or db_token(name) is not None or "://" not in head:
        return url
    try:
        if store_for(url).exists(url):
            return url
        d = CheckpointDirectory(head, storage_options=storage_options_for(url) or None)  # (the -o given)
        d.read_manifest(parsed[1])  # (not committed: CheckpointError, the name stands)
        return d.db_path(*parsed)
    except (CheckpointError, OSError):
        return url
