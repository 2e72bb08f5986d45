"""Checkpoint managers, naming, metadata handlers and upload builders."""

from .handler.metadata import MetadataHandler
from .location.naming import db_name, get_ckpt_filename
from .tasks.manager import CheckpointManager, InitRequiredError, NodeListMismatchError
from .tasks.multi_node import MultiNodeCheckpointManager
from .tasks.upload import CopyUploadBuilder, UploadTaskGroupBuilder

__all__ = [
    "CheckpointManager", "CopyUploadBuilder", "InitRequiredError", "MetadataHandler",
    "MultiNodeCheckpointManager", "NodeListMismatchError", "UploadTaskGroupBuilder",
    "db_name", "get_ckpt_filename",
]
