"""Which Checkpointer a process needs, decided without importing torch.

:class:`epochal.Checkpointer` asks :func:`use_distributed`: a process of a ``torch.distributed``
group of more than one rank, or one process opening a directory whose newest step was written
by ranks (``epochal.integrations.dcp``'s layout: ``rank<r>.<step>`` and ``dcp.<step>``), gets
:class:`~epochal.integrations.distributed.DistributedCheckpointer`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..checkpoint.location.view import CheckpointDirectory
from ..errors import CheckpointError
from ..storage.io.seam import is_url

__all__ = ["distributed_world", "use_distributed", "written_by_ranks"]

#: the node of a ranks-written step's DCP metadata db (epochal.integrations.dcp.META_NODE)
META_NODE = "dcp"


def distributed_world() -> int:
    """The world size of an initialized default process group; 1 without one (torch is
    looked at only when the process already imported ``torch.distributed``)."""
    td = sys.modules.get("torch.distributed")
    if td is None or not td.is_available() or not td.is_initialized():
        return 1
    return int(td.get_world_size())


def written_by_ranks(directory: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the newest committed step of ``directory`` (a local one, or a URL reached with
    ``storage_options``) was written by ranks."""
    path = os.fspath(directory)
    if not is_url(path) and not os.path.isdir(path):
        return False
    try:
        d = CheckpointDirectory(path, storage_options=storage_options)
        newest = d.newest_committed()  # the newest manifest alone, not the whole history
        return newest is not None and META_NODE in newest[1].nodes
    except (CheckpointError, OSError, ValueError):
        return False
    except Exception:  # a URL's store failing some other way: the Checkpointer says so itself
        if is_url(path):
            return False
        raise


def use_distributed(directory: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """A DistributedCheckpointer is needed for ``directory`` in this process."""
    return distributed_world() > 1 or written_by_ranks(directory, storage_options)
