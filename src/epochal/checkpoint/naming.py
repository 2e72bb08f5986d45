"""Checkpoint names: one db per node per epoch at ``<db_prefix>/<node>.<epoch>``."""

from __future__ import annotations

import os


def get_ckpt_filename(node_name: str, epoch: int) -> str:
    """``"<node_name>.<epoch>"``, no padding: ``("trainer_0", 5)`` -> ``"trainer_0.5"``."""
    return f"{node_name}.{epoch}"


def db_name(epoch: int, node_name: str, db_prefix: str, path_prefix: str | None = None) -> str:
    """The db path of ``node_name`` at ``epoch``.

    With a truthy ``path_prefix`` it is plain concatenation (``path_prefix + filename``),
    else ``os.path.join(db_prefix, filename)``, exactly as the seed.
    """
    if path_prefix:
        return path_prefix + get_ckpt_filename(node_name, epoch)
    return os.path.join(db_prefix, get_ckpt_filename(node_name, epoch))


def check_node_name(node_name: str) -> str:
    """Refuse node names that cannot name a checkpoint file, naming the node."""
    name = str(node_name)
    if not name or name in (".", "..") or "/" in name or "\0" in name or os.sep in name:
        raise ValueError(f"node name {name!r} cannot name a checkpoint file")
    return name
