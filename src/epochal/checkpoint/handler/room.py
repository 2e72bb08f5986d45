"""Whether the next checkpoint can be written to a local checkpoint directory: the directory
exists (it is created) and is writable, and its filesystem has room for a checkpoint the size
of the newest committed one, plus a margin (``DirectoryMetadataHandler.cp_accessible``).

Each no is a warning naming the directory and the reason, so the runner's skipped save says
why. Object storage has no folder to make and no free space to measure: always yes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from ...errors import CheckpointError
from ..location.view import CheckpointDirectory

logger = logging.getLogger("epochal")

__all__ = ["fits", "space_needed", "writable"]

#: added to every estimate: the manifest and the file system's own overhead
SLACK_BYTES = 64 * 1024


def writable(d: CheckpointDirectory) -> bool:
    """Create ``d``'s records directory if needed; False (with a warning) when it cannot be
    created or ``d`` or its records directory is not writable."""
    try:
        os.makedirs(d.records_dir, exist_ok=True)
    except OSError as ex:
        logger.warning("Checkpoint directory %s cannot be created: %s", d.records_dir, ex)
        return False
    for path in (d.db_dir, d.records_dir):
        if not os.access(path, os.W_OK | os.X_OK):
            logger.warning("Checkpoint directory %s is not writable", path)
            return False
    return True


def space_needed(d: CheckpointDirectory, node_names: Sequence[str], margin: float) -> tuple[int, int]:
    """(bytes the next checkpoint of ``node_names`` needs, the epoch the estimate is based
    on: the newest committed one, its size times ``1 + margin``); (0, -1) when no committed
    checkpoint goes by."""
    for epoch in reversed(d.manifest_epochs()):
        try:
            nodes = d.read_manifest(epoch).nodes
        except CheckpointError:
            continue
        size = sum(e.size for n, e in nodes.items() if not node_names or n in node_names)
        return int(size * (1 + margin)) + SLACK_BYTES, epoch
    return 0, -1


def fits(d: CheckpointDirectory, need: int, basis: int) -> bool:
    """Whether ``d``'s filesystem has ``need`` bytes free (an estimate from epoch ``basis``);
    True when it cannot be measured."""
    if not need:
        return True
    try:
        st = os.statvfs(d.db_dir)
    except (OSError, AttributeError):
        return True
    free = st.f_bavail * st.f_frsize
    if free < need:
        logger.warning(
            "Not enough free space in %s for the next checkpoint: %d bytes free, about %d "
            "needed (the size of epoch %d)", d.db_dir, free, need, basis,
        )
        return False
    return True
