"""``torch.distributed.checkpoint`` (DCP) storage that writes epochal checkpoints: one
native db per rank per step, a committed manifest, DCP's metadata as strict JSON, non-tensor
items through epochal's codecs; nothing is pickled. See :mod:`.storage` and docs/distributed.md.
"""

from __future__ import annotations

from .planners import EpochalLoadPlanner, EpochalSavePlanner, Whole
from .reader import EpochalStorageReader
from .storage import META_NODE, EpochalStorageWriter, commit_step, rank_node

__all__ = [
    "META_NODE",
    "EpochalLoadPlanner",
    "EpochalSavePlanner",
    "EpochalStorageReader",
    "EpochalStorageWriter",
    "commit_step",
    "rank_node",
    "Whole",
]
