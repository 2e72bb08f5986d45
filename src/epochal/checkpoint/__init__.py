"""Checkpoint managers, naming, metadata handlers and upload builders."""

from .manager import (
    CheckpointManager,
    InitRequiredError,
    MultiNodeCheckpointManager,
    NodeListMismatchError,
)
from .metadata import MetadataHandler
from .naming import db_name, get_ckpt_filename
from .upload import CopyUploadBuilder, UploadTaskGroupBuilder

__all__ = [
    "CheckpointManager", "CopyUploadBuilder", "InitRequiredError", "MetadataHandler",
    "MultiNodeCheckpointManager", "NodeListMismatchError", "UploadTaskGroupBuilder",
    "db_name", "get_ckpt_filename",
]
