"""Checkpoint names: one db per node per epoch at ``<db_prefix>/<node>.<epoch>``.

Every place that builds or parses a db name comes here: :func:`db_name` builds one,
:func:`parse_db_file` parses one for known node names, :func:`split_db_file` for any name
shaped like a db (tools, and listing a directory whose nodes are not known).
"""

from __future__ import annotations

import os

from ...storage.io.atomic import parse_temp_path
from ...storage.io.seam import is_url

#: the directory, beside the dbs, that holds a checkpoint directory's records (manifests,
#: stats, pins, the writer lock)
RECORDS_DIR = ".epochal"


def get_ckpt_filename(node_name: str, epoch: int) -> str:
    """``"<node_name>.<epoch>"``, no padding: ``("trainer_0", 5)`` -> ``"trainer_0.5"``."""
    return f"{node_name}.{epoch}"


def db_name(epoch: int, node_name: str, db_prefix: str, path_prefix: str | None = None) -> str:
    """The db path of ``node_name`` at ``epoch``.

    With a truthy ``path_prefix`` it is plain concatenation (``path_prefix + filename``),
    else ``os.path.join(db_prefix, filename)``, exactly as the seed; for a URL ``db_prefix``
    (``s3://bucket/run``) the two are joined with ``/`` (never an OS separator).
    """
    if path_prefix:
        return path_prefix + get_ckpt_filename(node_name, epoch)
    if is_url(db_prefix):
        return db_prefix.rstrip("/") + "/" + get_ckpt_filename(node_name, epoch)
    return os.path.join(db_prefix, get_ckpt_filename(node_name, epoch))


def check_node_name(node_name: str) -> str:
    """Refuse node names that cannot name a checkpoint file, naming the node."""
    name = str(node_name)
    if not name or name in (".", "..") or "/" in name or "\0" in name or os.sep in name:
        raise ValueError(f"node name {name!r} cannot name a checkpoint file")
    return name


def parse_db_file(filename: str, node_names: list[str], file_prefix: str = "") -> tuple[str, int] | None:
    """``(node, epoch)`` when ``filename`` (a base name) is exactly the db name of one of
    ``node_names`` at some epoch (``<file_prefix><node>.<epoch>``, no padding); else None.
    The longest matching node name wins (``a.b`` before ``a``)."""
    if not filename.startswith(file_prefix):
        return None
    rest = filename[len(file_prefix):]
    for node in sorted(node_names, key=len, reverse=True):
        head = f"{node}."
        ep = rest[len(head):]
        if rest.startswith(head) and _is_epoch(ep):
            return node, int(ep)
    return None


def _is_epoch(text: str) -> bool:
    """An epoch as :func:`get_ckpt_filename` writes it: ASCII digits, no padding."""
    return text.isascii() and text.isdigit() and (text == "0" or text[0] != "0")


def split_db_file(filename: str, file_prefix: str = "") -> tuple[str, int] | None:
    """``(node, epoch)`` of a file name (a base name) shaped like a db,
    ``<file_prefix><node>.<epoch>`` with a non-empty node, when the node names are not known
    (the last dot splits: ``a.b.3`` is node ``a.b``). None for any other name, among them the
    temp files of interrupted writes and uploads and the records directory."""
    if filename == RECORDS_DIR or not filename.startswith(file_prefix):
        return None
    if parse_temp_path(filename) is not None or ".tmp.upload." in filename:
        return None
    node, dot, ep = filename[len(file_prefix):].rpartition(".")
    if not dot or not node or not _is_epoch(ep):
        return None
    return node, int(ep)


def epochs_on_disk(db_prefix: str, node_names: list[str], path_prefix: str | None = None) -> list[int]:
    """Epochs for which a db file of any of ``node_names`` exists in a local directory, oldest
    first ([] for a URL or a missing directory). Only names exactly as :func:`db_name` builds
    them count; temp files of interrupted saves do not."""
    if is_url(path_prefix or db_prefix):
        return []
    if path_prefix:
        folder, prefix = os.path.dirname(path_prefix) or ".", os.path.basename(path_prefix)
    else:
        folder, prefix = db_prefix or ".", ""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = {hit[1] for n in names if (hit := parse_db_file(n, node_names, prefix)) is not None}
    return sorted(found)
