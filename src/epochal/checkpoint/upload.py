"""Upload builders: what JobRunner runs once training ends, to ship the final checkpoints."""

from __future__ import annotations

import os
import shutil
from typing import Any

from ..execution.task import Node, Task, TaskGroup, WorkspaceType


class UploadTaskGroupBuilder:
    """Builds the TaskGroup that uploads the checkpoints of the final epoch."""

    def build(self, epoch: int, checkpoint_manager: Any) -> TaskGroup:
        raise NotImplementedError()


class _CopyFile:
    """Step: copy ``src`` to ``dst`` through a temp file and an atomic rename."""

    def __init__(self, src: str, dst: str) -> None:
        self.src, self.dst = src, dst

    def __call__(self, ws: Any) -> None:
        tmp = f"{self.dst}.tmp.upload.{os.getpid()}"
        try:
            shutil.copyfile(self.src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.dst)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


class CopyUploadBuilder(UploadTaskGroupBuilder):
    """Copies each node's checkpoint of the final epoch to ``<upload_dir>/<node>``, on that node."""

    def __init__(self, upload_dir: str) -> None:
        self.upload_dir = upload_dir

    def build(self, epoch: int, checkpoint_manager: Any) -> TaskGroup:
        os.makedirs(self.upload_dir, exist_ok=True)
        with TaskGroup(WorkspaceType.GLOBAL) as group:
            for node in checkpoint_manager.node_names():
                src = checkpoint_manager.get_ckpt_db_name(node, epoch)
                with Node(node):
                    Task(step=_CopyFile(src, os.path.join(self.upload_dir, node)), name="upload")
        return group
