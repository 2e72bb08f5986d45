"""A save's side: each array leaf on host once, as the tensor record torch writes.

Every ``jax.Array`` leaf is asked to ``copy_to_host_async`` first (all transfers in flight
together), then each is put on host as one C-contiguous numpy array built from its
addressable shards, each shard with ``replica_id == 0`` copied once into its place (a
single shard that covers the array is used as it is, no copy). So a save holds the pytree
on host once; a process must address every shard of an array (one process: always; several
processes are not supported yet and raise).

:class:`HostTensor` wraps such an array for the Checkpointer; its codec writes kind
``torch.tensor`` with torch's meta (dtype name, shape, device ``cpu``) so PyTorch restores
it as a tensor, plus ``row_crc``: the array's rows cut in blocks of about
:data:`BLOCK_BYTES` and a checksum of each block, so a restore reads and checks only the
blocks the rows it needs lie in (a torch reader ignores the key; the index checksum covers it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..storage.encoding.codecs import Encoded, flat_writable, register_codec
from ..storage.io.checksum import checksum_function, default_algorithm
from .names import Leaf, dtype_name, leaf_label

__all__ = ["BLOCK_BYTES", "HostTensor", "block_rows", "to_host"]

#: the bytes of a checksummed row block (at least one row): the unit a restore reads
BLOCK_BYTES = 4 << 20


def block_rows(shape: Sequence[int], itemsize: int, block_bytes: int | None = None) -> int:
    """Rows of a block of an array of ``shape``: whole rows of about ``block_bytes``
    (default :data:`BLOCK_BYTES`, read at each call)."""
    block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
    row = math.prod(shape[1:]) * itemsize if shape else itemsize
    return max(1, block_bytes // max(1, row))


@dataclass(frozen=True)
class HostTensor:
    """An array leaf on host, stored as a torch tensor record with row-block checksums."""

    array: np.ndarray
    label: str

    def encoded(self) -> Encoded:
        arr = self.array
        name = dtype_name(arr.dtype, self.label)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        flat = arr.reshape(-1).view(np.uint8)
        meta: dict[str, Any] = {"dtype": name, "shape": list(arr.shape), "device": "cpu"}
        rows = block_rows(arr.shape, arr.dtype.itemsize)
        step = rows * (flat.nbytes // arr.shape[0]) if arr.ndim and arr.shape[0] else 0
        if step and flat.nbytes > step:  # more than one block: a checksum per block
            algo = default_algorithm()
            fn = checksum_function(algo)
            crcs = [fn(flat[i : i + step], 0) for i in range(0, flat.nbytes, step)]
            meta["row_crc"] = {"rows": rows, "algorithm": algo, "crcs": crcs}
        return Encoded("torch.tensor", meta, [flat_writable(flat) if flat.nbytes else memoryview(b"")])


class HostTensorCodec:
    """Writes a :class:`HostTensor` as a torch tensor record; never read back as such (the
    record's kind is ``torch.tensor``: torch reads it, the JAX door reads it by ranges)."""

    kind = "jax.host_tensor"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, HostTensor)

    def encode(self, value: Any) -> Encoded:
        return value.encoded()  # type: ignore[no-any-return]

    def allocate(self, meta: dict[str, Any], sizes: Sequence[int]) -> list[memoryview]:
        raise ValueError("host tensors are stored as torch.tensor records, never as their own kind")

    def decode(self, meta: dict[str, Any], buffers: Sequence[memoryview], existing: Any = None) -> Any:
        raise ValueError("host tensors are stored as torch.tensor records, never as their own kind")


register_codec(HostTensorCodec())


def _whole(x: jax.Array, label: str, copy: bool) -> np.ndarray:
    """``x`` on host as one array, each shard of replica 0 copied once into place (one shard
    covering the array: its host view, copied only with ``copy``)."""
    if not x.is_fully_addressable:
        raise NotImplementedError(f"leaf {label}: an array with shards in other processes "
                                  "(multi-process saves are not supported yet)")
    shards = [s for s in x.addressable_shards if s.replica_id == 0]
    if len(shards) == 1 and tuple(shards[0].data.shape) == tuple(x.shape):
        whole = np.asarray(shards[0].data)
        return whole.copy() if copy else whole
    out = np.empty(x.shape, dtype=x.dtype)
    for s in shards:
        out[s.index] = np.asarray(s.data)
    return out


def to_host(leaves: Sequence[Leaf], *, copy: bool = False) -> list[Leaf]:
    """Each leaf as a value the Checkpointer stores: arrays as :class:`HostTensor`, plain
    values (Python scalars, str, numpy scalars) as they are. ``copy``: no array may share
    memory with a live buffer (for a write that runs after the caller goes on)."""
    for _, v in leaves:
        if isinstance(v, jax.Array):
            v.copy_to_host_async()
    out: list[Leaf] = []
    for names, v in leaves:
        label = leaf_label(names)
        if isinstance(v, jax.Array):
            out.append((names, HostTensor(_whole(v, label, copy), label)))
        elif isinstance(v, np.ndarray):
            out.append((names, HostTensor(v.copy() if copy else v, label)))
        else:
            out.append((names, v))
    return out
