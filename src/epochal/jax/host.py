"""A save's side: each array leaf as the records torch reads, its shards never assembled.

Every ``jax.Array`` leaf is asked to ``copy_to_host_async`` first (all transfers in flight
together); then each addressable shard with ``replica_id == 0`` is taken once, as the
host view of its buffer (on CPU devices the device buffer itself: no copy), and written
from there:

* an array whose one such shard covers it (on one device, or replicated) is a
  :class:`HostTensor`: kind ``torch.tensor`` with torch's meta (dtype name, shape, device
  ``cpu``) so PyTorch restores it as a tensor, plus ``row_crc``: its rows cut in blocks of
  about :data:`BLOCK_BYTES` and a checksum of each block, so a restore reads and checks
  only the blocks the rows it needs lie in (a torch reader ignores the key; the index
  checksum covers it);
* a sharded array is a :class:`HostChunks`: kind ``torch.chunked_tensor``
  (:mod:`epochal.storage.encoding.chunks`), each shard a chunk at its offsets, cut into
  row blocks of about :data:`BLOCK_BYTES`, each block a segment with its own checksum.

So a save adds no copy of the data on CPU devices, and on an accelerator only the host
copies of the shards (each byte once). In a job of several processes (``process=(i, n)``)
each process takes only what it holds: of an array with shards in other processes, its own
replica-0 shards (a :class:`HostChunks` marked as process ``i``'s part unless they cover
the array; nothing when it holds none); every other leaf (an array one process holds
whole, a numpy array, a plain value) is process 0's alone (:mod:`.multiprocess`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..storage.encoding.chunks import KIND as CHUNKED_KIND
from ..storage.encoding.chunks import encode_chunks
from ..storage.encoding.codecs import Encoded, flat_writable, register_codec
from ..storage.io.checksum import checksum_function, default_algorithm
from .names import Leaf, dtype_name, leaf_label

__all__ = ["BLOCK_BYTES", "HostChunks", "HostTensor", "block_rows", "to_host"]

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


@dataclass(frozen=True)
class HostChunks:
    """A sharded array leaf on host as its shards (offsets in the whole array, the shard's
    C-contiguous host array), stored as a ``torch.chunked_tensor`` record."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: list[tuple[tuple[int, ...], np.ndarray]]
    label: str
    #: ``(i, n)``: the chunks are process ``i``'s part of the array (``n`` processes saved it)
    part: tuple[int, int] | None = None

    def encoded(self) -> Encoded:
        meta, segments = encode_chunks(dtype_name(self.dtype, self.label), self.shape, self.chunks, BLOCK_BYTES,
                                       self.part)
        return Encoded(CHUNKED_KIND, meta, segments)

    def transposed(self, label: str) -> HostChunks:
        """The transpose (every axis reversed), each chunk transposed in a copy."""
        return HostChunks(self.shape[::-1], self.dtype,
                          [(o[::-1], np.ascontiguousarray(a.T)) for o, a in self.chunks], label, self.part)


class HostTensorCodec:
    """Writes a :class:`HostTensor` or :class:`HostChunks` as the record torch reads; never
    read back as such (the record's kind is ``torch.tensor`` or ``torch.chunked_tensor``:
    torch reads it, the JAX door reads it by ranges)."""

    kind = "jax.host_tensor"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, (HostTensor, HostChunks))

    def encode(self, value: Any) -> Encoded:
        return value.encoded()  # type: ignore[no-any-return]

    def allocate(self, meta: dict[str, Any], sizes: Sequence[int]) -> list[memoryview]:
        raise ValueError("host tensors are stored as torch.tensor records, never as their own kind")

    def decode(self, meta: dict[str, Any], buffers: Sequence[memoryview], existing: Any = None) -> Any:
        raise ValueError("host tensors are stored as torch.tensor records, never as their own kind")


register_codec(HostTensorCodec())


def _host(x: jax.Array, label: str, copy: bool, part: tuple[int, int] | None = None
          ) -> HostTensor | HostChunks | None:
    """``x``'s addressable shards of replica 0, each taken once as its host view (copied
    only with ``copy``): one shard covering the array as a :class:`HostTensor`, else the
    chunks (``part``: marked as that process's part when they do not cover the array);
    None when this process holds none."""
    if not x.is_fully_addressable and part is None:
        raise ValueError(f"leaf {label}: an array with shards in other processes, in a save of one process")
    shards = [s for s in x.addressable_shards if s.replica_id == 0]
    if (not shards and x.size) or (x.size == 0 and part is not None and part[0]):
        return None
    if x.size == 0 or (len(shards) == 1 and tuple(shards[0].data.shape) == tuple(x.shape)):
        whole = np.asarray(shards[0].data) if x.size else np.empty(x.shape, dtype=x.dtype)
        return HostTensor(whole.copy() if copy else whole, label)
    chunks = []
    for s in shards:
        if s.data.size == 0:
            continue
        offsets = tuple(sl.indices(n)[0] for sl, n in zip(s.index, x.shape))
        host = np.asarray(s.data)
        if copy or not host.flags.c_contiguous:
            host = np.array(host, order="C", copy=True)
        chunks.append((offsets, host))
    chunks.sort(key=lambda c: c[0])
    held = sum(a.size for _, a in chunks)
    return HostChunks(tuple(x.shape), np.dtype(x.dtype), chunks, label, part if held < x.size else None)


def to_host(leaves: Sequence[Leaf], *, copy: bool = False, process: tuple[int, int] | None = None) -> list[Leaf]:
    """Each leaf as a value the Checkpointer stores: arrays as :class:`HostTensor` or
    :class:`HostChunks`, plain values (Python scalars, str, numpy scalars) as they are.
    ``copy``: no array may share memory with a live buffer (for a write that runs after the
    caller goes on). ``process``: ``(i, n)``, this process's part of a save of ``n``
    processes (see the module doc): the leaves it has nothing of are left out."""
    if process is not None and process[0] != 0:  # the rest is process 0's alone
        leaves = [(n, v) for n, v in leaves if isinstance(v, jax.Array) and not v.is_fully_addressable]
    for _, v in leaves:
        if isinstance(v, jax.Array):
            v.copy_to_host_async()
    out: list[Leaf] = []
    for names, v in leaves:
        label = leaf_label(names)
        if isinstance(v, jax.Array):
            got = _host(v, label, copy, process)
            if got is not None:
                out.append((names, got))
        elif isinstance(v, np.ndarray):
            out.append((names, HostTensor(v.copy() if copy else v, label)))
        else:
            out.append((names, v))
    return out
