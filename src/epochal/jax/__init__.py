"""JAX pytrees in epochal checkpoints: ``save(path_or_checkpointer, step, pytree)`` and
``restore(path_or_checkpointer, abstract_pytree, step=None)`` (docs/jax.md).

One checkpoint for both frameworks: a pytree of nested dicts is stored under the same names
as a torch state of the same nested dicts, and its arrays as records torch reads (bf16 and
the float8s too, same bits; a sharded array as its shards, each written once from its own
buffer), so a PyTorch :class:`~epochal.Checkpointer` restores what JAX saved and the
reverse, without a mapping. A restore reads only the byte ranges of
the shards each device needs (resharding freely), checks every range's checksum before use,
and bounds its scratch memory by ``chunk_bytes``. In a job of several processes each
writes its own shards into a db of its own and one step is committed for all
(:mod:`.multiprocess`). ``epochal.jax.orbax`` holds
an Orbax ``CheckpointManager`` handler, ``epochal.jax.orbax_v1`` an Orbax v1 one. Needs ``pip install 'epochal[jax]'``.
"""

from __future__ import annotations

from .api import DEFAULT_CHUNK, restore, save, wait
from .background import PendingSave
from .host import BLOCK_BYTES
from .mapping import NameMap, Transposed, transposed

__all__ = ["BLOCK_BYTES", "DEFAULT_CHUNK", "NameMap", "PendingSave", "Transposed", "restore", "save", "transposed",
           "wait"]
