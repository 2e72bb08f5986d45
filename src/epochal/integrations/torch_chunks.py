"""PyTorch reads a tensor stored as chunks (kind ``torch.chunked_tensor``: a sharded JAX
array saved shard by shard, :mod:`epochal.storage.encoding.chunks`) as one whole tensor.

Each segment (a row block of a chunk, checked by the format before decode sees it) is
copied into its place: into the live tensor of the load when there is one (a state dict
held in the state: restored in place, any device), else into a new CPU tensor moved where
the saved device resolves to (:func:`~.torch.resolve_device`). Registers its codec when
imported: the codec registry imports it for its kind (``storage/encoding/codecs.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..storage.encoding.chunks import KIND, Chunk, chunk_layout
from ..storage.encoding.codecs import Encoded, register_codec
from .torch import TensorCodec, _bytes_of, dtype_from_name, resolve_device

__all__ = ["ChunkedTensorCodec"]


class ChunkedTensorCodec:
    """Reads a ``torch.chunked_tensor`` record into one tensor (torch never writes one)."""

    kind = KIND
    #: a leaf of a state dict held in the state is copied into its live tensor
    inplace_leaf = True

    def accepts(self, value: Any) -> bool:
        return False

    def encode(self, value: Any) -> Encoded:
        raise ValueError("torch.chunked_tensor records are written by the JAX door, never from a torch value")

    @staticmethod
    def _layout(meta: dict[str, Any], sizes: Sequence[int]) -> tuple[torch.dtype, tuple[int, ...], list[Chunk]]:
        dt = dtype_from_name(meta.get("dtype"))
        shape, chunks = chunk_layout(meta, sizes, dt.itemsize)
        return dt, shape, chunks

    def allocate(self, meta: dict[str, Any], sizes: Sequence[int]) -> list[memoryview]:
        self._layout(meta, sizes)
        return [_bytes_of(torch.empty(int(n), dtype=torch.uint8)) for n in sizes]

    def check(self, meta: dict[str, Any], existing: Any) -> None:
        """BlobMismatchError when a live tensor has another shape or dtype than the record."""
        if isinstance(existing, torch.Tensor):
            dt = dtype_from_name(meta.get("dtype"))
            TensorCodec._check_live(existing, dt, tuple(int(n) for n in meta.get("shape") or ()))

    def decode(self, meta: dict[str, Any], buffers: Sequence[memoryview], existing: Any = None) -> Any:
        dt, shape, chunks = self._layout(meta, [b.nbytes for b in buffers])
        live = isinstance(existing, torch.Tensor)
        if live:
            TensorCodec._check_live(existing, dt, shape)
        out = existing if live else torch.empty(shape, dtype=dt)
        with torch.no_grad():
            for c in chunks:
                for k, (r0, r1) in enumerate(c.blocks()):
                    buf = buffers[c.first + k]
                    if buf.readonly:
                        buf = memoryview(bytearray(buf))
                    part = torch.frombuffer(buf, dtype=torch.uint8).view(dt).reshape(r1 - r0, *c.shape[1:])
                    at = (slice(c.offsets[0] + r0, c.offsets[0] + r1),
                          *(slice(o, o + n) for o, n in zip(c.offsets[1:], c.shape[1:])))
                    out[at].copy_(part)
        if live:
            return existing
        dev = resolve_device(str(meta.get("device", "cpu")))
        return out if dev.type == "cpu" or math.prod(shape) == 0 else out.to(dev)


register_codec(ChunkedTensorCodec())
