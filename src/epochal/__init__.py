"""epochal: epoch-by-epoch training jobs with crash-safe, checksummed, pickle-free checkpoints.

A rebuild of Caffe2's ``checkpoint.py`` system (Job, JobRunner, checkpoint managers,
metadata handlers) in plain Python. See README.md and docs/.
"""

from __future__ import annotations

from typing import Any

from .checkpoint.handler.metadata import BaseMetadataHandler, MetadataHandler
from .checkpoint.location.naming import db_name, get_ckpt_filename
from .checkpoint.tasks.manager import CheckpointManager
from .checkpoint.tasks.multi_node import MultiNodeCheckpointManager
from .checkpoint.tasks.upload import CopyUploadBuilder, UploadTaskGroupBuilder
from .errors import (
    BlobMismatchError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    MissingBlobError,
    MissingMetricError,
    NodeLostError,
    Preempted,
    UnsupportedBlobError,
)
from .execution import (
    Cluster,
    Node,
    Task,
    TaskGroup,
    TaskOutput,
    Workspace,
    WorkspaceType,
    final_output,
)
from .jobs import CheckpointEvent, Job, JobRunner, RunListener, epoch_limiter
from .sessions import LocalSession, Session
from .storage.formats.base import DbBackend, available_db_types, get_db_type, register_db_type

__version__ = "0.1.0"

_LAZY = {
    "Checkpointer": "epochal.checkpointer",
    "CheckpointDirectory": "epochal.checkpoint.location.view",
    "DirectoryMetadataHandler": "epochal.checkpoint.handler.directory",
    "RNGState": "epochal.integrations.rng",
    "export_safetensors": "epochal.integrations.safetensors_export",
}


def __getattr__(name: str) -> Any:
    # Imported on first use: keeps `import epochal` light.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'epochal' has no attribute {name!r}")


__all__ = [
    "BaseMetadataHandler", "BlobMismatchError", "Checkpointer", "CheckpointCorruptError",
    "CheckpointDirectory", "CheckpointError", "CheckpointEvent", "CheckpointLockedError",
    "CheckpointManager", "CheckpointNotFoundError", "CheckpointVersionError", "Cluster",
    "CopyUploadBuilder", "DbBackend", "DirectoryMetadataHandler", "Job", "JobRunner",
    "LocalSession", "MetadataHandler", "MissingBlobError", "MissingMetricError", "MultiNodeCheckpointManager", "Node",
    "NodeLostError", "Preempted", "RNGState", "RunListener", "Session", "Task", "TaskGroup", "TaskOutput",
    "UnsupportedBlobError", "UploadTaskGroupBuilder", "Workspace", "WorkspaceType",
    "available_db_types", "db_name", "epoch_limiter", "export_safetensors", "final_output", "get_ckpt_filename",
    "get_db_type", "register_db_type",
]
