"""Upload builders: what JobRunner runs once training ends, to ship the final checkpoints."""

from __future__ import annotations

import os
from typing import Any

from ...execution.task import Node, Task, TaskGroup, WorkspaceType


class UploadTaskGroupBuilder:
    """Builds the TaskGroup that uploads the checkpoints of the final epoch."""

    def build(self, epoch: int, checkpoint_manager: Any) -> TaskGroup:
        raise NotImplementedError()


class _CopyFile:
    """Step: copy ``src`` to ``dst`` atomically and durably (storage.atomic: temp name that
    the temp-file cleaner knows, free-space check, fsync, rename, directory fsync)."""

    def __init__(self, src: str, dst: str) -> None:
        self.src, self.dst = src, dst

    def __call__(self, ws: Any) -> None:
        from ...storage.io import atomic

        buf = bytearray(8 << 20)
        view = memoryview(buf)
        with open(self.src, "rb", buffering=0) as f, atomic.AtomicFile(
            self.dst, size=os.path.getsize(self.src)
        ) as out:
            while n := f.readinto(buf):
                out.write(view[:n])


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


class _UploadFile:
    """Step: upload ``src`` to ``url`` with fsspec (temp key, size check, move into place)."""

    def __init__(self, src: str, url: str, storage_options: dict[str, Any]) -> None:
        self.src, self.url, self.storage_options = src, url, storage_options

    def __call__(self, ws: Any) -> None:
        from ...storage.formats.remote import upload_file

        upload_file(self.src, self.url, **self.storage_options)


class FsspecUploadBuilder(UploadTaskGroupBuilder):
    """Uploads each node's checkpoint of the final epoch to ``<url>/<node>.<epoch>`` (any fsspec
    URL: ``s3://bucket/run1``, ``gs://...``, ``memory://...``), each from its own node, and the
    epoch's manifest (when a DirectoryMetadataHandler wrote one) to ``<url>/.epochal/``.

    Needs the ``s3`` extra (fsspec; s3fs for S3). ``storage_options`` go to fsspec (e.g.
    ``{"endpoint_url": ...}``)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})

    def build(self, epoch: int, checkpoint_manager: Any) -> TaskGroup:
        from ..location.naming import get_ckpt_filename

        with TaskGroup(WorkspaceType.GLOBAL) as group:
            nodes = checkpoint_manager.node_names()
            for node in nodes:
                src = checkpoint_manager.get_ckpt_db_name(node, epoch)
                with Node(node):
                    Task(step=_UploadFile(src, f"{self.url}/{get_ckpt_filename(node, epoch)}",
                                          self.storage_options), name="upload")
            manifest = os.path.join(checkpoint_manager.db_prefix, ".epochal", f"manifest.{epoch}.json")
            if nodes and os.path.exists(manifest):
                with Node(nodes[0]):
                    Task(step=_UploadFile(manifest, f"{self.url}/.epochal/manifest.{epoch}.json",
                                          self.storage_options), name="upload_manifest")
        return group
