"""Checkpoint names: one db per node per epoch at ``<db_prefix>/<node>.<epoch>``.

At a URL a writer adds a token of its own, ``<node>.<epoch>.<token>`` (:func:`new_token`: a
fresh one per save), so that no other writer can produce the key of a committed db: a writer
paused past its lease inside its upload (SIGSTOP, a long GC pause) lands its bytes under its
own key when it wakes, never over the new holder's db of the same step. The manifest records
each db's file name (``DbEntry.file``), and readers take it from there; a local directory's
writer lock is a real OS lock, so local names stay ``<node>.<epoch>`` (and older URL
checkpoints, named so, still read).

Every place that builds or parses a db name comes here: :func:`db_name` builds one,
:func:`parse_db_file` parses one for known node names, :func:`split_db_file` for any name
shaped like a db (tools, and listing a directory whose nodes are not known), both with or
without a token; :func:`db_token` gives a name's token.
"""

from __future__ import annotations

import os
import re
import secrets

from ...storage.io.atomic import parse_temp_path
from ...storage.io.seam import is_url

#: the directory, beside the dbs, that holds a checkpoint directory's records (manifests,
#: stats, pins, the writer lock)
RECORDS_DIR = ".epochal"


#: a writer token as it ends a db name: ``w`` and 12 hex digits (never all digits, so that
#: ``a.3.w…`` cannot be read as node ``a.3`` at some epoch)
TOKEN_RE = re.compile(r"w[0-9a-f]{12}")


def new_token() -> str:
    """A fresh writer token (48 random bits): the one save that draws it names its db with it."""
    return "w" + secrets.token_hex(6)


def get_ckpt_filename(node_name: str, epoch: int, token: str | None = None) -> str:
    """``"<node_name>.<epoch>"``, no padding: ``("trainer_0", 5)`` -> ``"trainer_0.5"``; with
    a ``token``, ``"trainer_0.5.<token>"``."""
    if token is not None:
        if TOKEN_RE.fullmatch(token) is None:
            raise ValueError(f"{token!r} is not a writer token (w and 12 hex digits)")
        return f"{node_name}.{epoch}.{token}"
    return f"{node_name}.{epoch}"


def db_name(epoch: int, node_name: str, db_prefix: str, path_prefix: str | None = None,
            token: str | None = None) -> str:
    """The db path of ``node_name`` at ``epoch`` (with ``token``: a writer's own, see the
    module doc).

    With a truthy ``path_prefix`` it is plain concatenation (``path_prefix + filename``),
    else ``os.path.join(db_prefix, filename)``, exactly as the seed; for a URL ``db_prefix``
    (``s3://bucket/run``) the two are joined with ``/`` (never an OS separator).
    """
    filename = get_ckpt_filename(node_name, epoch, token)
    if path_prefix:
        return path_prefix + filename
    if is_url(db_prefix):
        return db_prefix.rstrip("/") + "/" + filename
    return os.path.join(db_prefix, filename)


def _untokened(name: str) -> tuple[str, str | None]:
    """``(name without its writer token, the token)``; ``(name, None)`` when it has none."""
    head, dot, tail = name.rpartition(".")
    if dot and TOKEN_RE.fullmatch(tail) is not None:
        return head, tail
    return name, None


def without_token(filename: str) -> str:
    """``filename`` without the writer token it ends with (unchanged when it has none)."""
    return _untokened(filename)[0]


def db_token(filename: str) -> str | None:
    """The writer token a db name ends with (None: a name without one)."""
    return _untokened(filename)[1]


def check_node_name(node_name: str) -> str:
    """Refuse node names that cannot name a checkpoint file, naming the node."""
    name = str(node_name)
    if not name or name in (".", "..") or "/" in name or "\0" in name or os.sep in name:
        raise ValueError(f"node name {name!r} cannot name a checkpoint file")
    return name


def parse_db_file(filename: str, node_names: list[str], file_prefix: str = "") -> tuple[str, int] | None:
    """``(node, epoch)`` when ``filename`` (a base name) is exactly the db name of one of
    ``node_names`` at some epoch (``<file_prefix><node>.<epoch>``, no padding, with or
    without a writer token); else None. The longest matching node name wins (``a.b``
    before ``a``)."""
    if not filename.startswith(file_prefix):
        return None
    rest = _untokened(filename[len(file_prefix):])[0]
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
    ``<file_prefix><node>.<epoch>`` with a non-empty node (and perhaps a writer token), when
    the node names are not known (the last dot before the epoch splits: ``a.b.3`` is node
    ``a.b``). None for any other name, among them the temp files of interrupted writes and
    uploads and the records directory."""
    if filename == RECORDS_DIR or not filename.startswith(file_prefix):
        return None
    if parse_temp_path(filename) is not None or ".tmp.upload." in filename:
        return None
    node, dot, ep = _untokened(filename[len(file_prefix):])[0].rpartition(".")
    if not dot or not node or not _is_epoch(ep):
        return None
    return node, int(ep)


def names_db_of(filename: str, node: str, epoch: int, file_prefix: str = "") -> bool:
    """Whether ``filename`` (a base name, as a manifest's ``DbEntry.file``) is a db name of
    ``node`` at ``epoch``, with or without a writer token: what a manifest may name (never a
    path, another node's or another epoch's file)."""
    if "/" in filename or os.sep in filename or "\0" in filename:
        return False
    return parse_db_file(filename, [node], file_prefix) == (node, int(epoch))


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
