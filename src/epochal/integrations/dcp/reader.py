"""The DCP storage reader of epochal checkpoints: a step's manifest and its metadata db
(verified), then, per rank, only the saved chunks (row blocks of a big chunk) its live shards
overlap, every one checked by checksum before any live tensor is written (:mod:`.reads`).
The writer and the layout: :mod:`.storage`."""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ...checkpoint.location.naming import split_db_file
from ...checkpoint.location.view import CheckpointDirectory
from ...errors import CheckpointCorruptError, CheckpointNotFoundError
from ...storage.formats.native.reader import NativeFile
from ...storage.io.seam import local_path
from .metadata_json import ItemLocation, metadata_from_json
from .reads import read_items
from .storage import META_BLOB, META_NODE, AtPath, _done, _located

__all__ = ["EpochalStorageReader"]


class EpochalStorageReader(AtPath, StorageReader):
    """A DCP storage reader of epochal checkpoints (see the module doc). ``step``: the step
    to load; None: the newest committed step written by :class:`EpochalStorageWriter`."""

    def __init__(self, path: str | os.PathLike[str], step: int | None = None, *,
                 storage_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.path = _located(path, storage_options)
        self.step = None if step is None else int(step)
        self.storage_data: dict[MetadataIndex, ItemLocation] = {}
        #: (FQN, chunk offsets) -> the saved chunk's rows (where its row blocks end)
        self.chunk_rows: dict[tuple[str, tuple[int, ...]], int] = {}
        #: after read_metadata: the step being loaded
        self.loaded_step: int | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = local_path(checkpoint_id)
        self.storage_data = {}

    def _choose_step(self, d: CheckpointDirectory) -> int:
        if self.step is not None:
            if not d.is_committed(self.step):
                raise CheckpointNotFoundError(f"{self.path}: step {self.step} is not committed")
            return self.step
        for step in reversed(d.manifest_epochs()):  # from the newest down
            if d.is_committed(step) and META_NODE in d.read_manifest(step).nodes:
                return step
        raise CheckpointNotFoundError(f"{self.path}: no committed DCP checkpoint")

    def read_metadata(self) -> Metadata:  # (no **kwargs: DCP's rank-local metadata is not ours)
        d = CheckpointDirectory(self.path)
        step = self._choose_step(d)
        manifest = d.read_manifest(step)
        if META_NODE not in manifest.nodes:
            raise CheckpointNotFoundError(f"{d.manifest_path(step)}: step {step} was not written by DCP")
        db = d.db_path(META_NODE, step)
        d.require_intact(step, nodes=[META_NODE], word="step")  # before it is read
        with NativeFile(db, mmap=False) as f:
            text = f.read([META_BLOB])[META_BLOB]
        if not isinstance(text, str):
            raise CheckpointCorruptError(db, "the DCP metadata is not a str", META_BLOB)
        md = metadata_from_json(text, db)
        for loc in md.storage_data.values():
            split = split_db_file(loc.db) if os.path.basename(loc.db) == loc.db else None
            if split is None or split[1] != step or split[0] not in manifest.nodes \
                    or manifest.nodes[split[0]].file != loc.db:
                raise CheckpointCorruptError(db, f"DCP metadata names db {loc.db!r}, not one of step {step}'s",
                                             META_BLOB)
        self.loaded_step = step
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = dict(metadata.storage_data or {})
        self.chunk_rows = {
            (fqn, tuple(int(o) for o in c.offsets)): int(c.sizes[0]) if len(c.sizes) else 1
            for fqn, sm in metadata.state_dict_metadata.items() if isinstance(sm, TensorStorageMetadata)
            for c in sm.chunks
        }

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the blobs of the saved chunks (of a chunk stored as row blocks, the blocks) that
        ``plan``'s items overlap, each once and every one checksum-verified before any live
        tensor is written, then copy each item's region (see :mod:`.reads`)."""
        by_step: dict[int, set[str]] = {}
        for item in plan.items:
            loc = self.storage_data.get(item.storage_index)
            split = split_db_file(loc.db) if loc is not None else None
            if split is not None:
                by_step.setdefault(split[1], set()).add(split[0])
        d = CheckpointDirectory(self.path)
        for step, nodes in by_step.items():  # before any byte reaches a live tensor
            d.require_intact(step, nodes=sorted(nodes), word="step")
        read_items(self.path, self.storage_data, self.chunk_rows, plan, planner)
        return _done(None)
