"""The full (unsharded) tensors of one state dict of a step written by ranks, in one process.

A step written through :mod:`epochal.integrations.dcp` (the DistributedCheckpointer's, or
``dcp.save`` with :class:`EpochalStorageWriter`) holds each tensor as chunks in the ranks' dbs.
:func:`gather_state_dict` allocates each tensor of ``<name>.*`` at its global shape and loads
every chunk into it with DCP's planner (no process group), each byte checked by checksum:
``epochal export --blob model`` writes that as one safetensors file.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...errors import MissingBlobError
from .reader import EpochalStorageReader

__all__ = ["gather_state_dict"]


def gather_state_dict(directory: str | os.PathLike[str], name: str, step: int | None = None
                      ) -> tuple[int, dict[str, torch.Tensor]]:
    """``(step, {key: full CPU tensor})`` of ``state[name]`` (a module's state dict, say) in
    ``step`` of ``directory`` (None: the newest committed one). Raises MissingBlobError naming
    the step when it saved no tensor under ``name``."""
    import warnings

    reader = EpochalStorageReader(directory, step=step)
    meta = reader.read_metadata()
    prefix = name + "."
    full: dict[str, torch.Tensor] = {}
    for fqn, md in meta.state_dict_metadata.items():
        if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            full[fqn[len(prefix):]] = torch.empty(md.size, dtype=md.properties.dtype)
    chosen = reader.loaded_step if reader.loaded_step is not None else -1
    if not full:
        raise MissingBlobError(f"{os.fspath(directory)}: step {chosen} holds no tensor of {name!r} "
                               f"(its entries: {sorted({k.split('.', 1)[0] for k in meta.state_dict_metadata})})")
    with warnings.catch_warnings():  # one process without a process group: the intent
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp_load({name: full}, storage_reader=EpochalStorageReader(directory, step=chosen), no_dist=True)
    return chosen, full
