"""Host memory for a rank's async-save snapshot, reused from save to save.

:class:`HostStaging` holds one host buffer (pinned when the state has CUDA tensors, so the
device-to-host copies run at full speed) sized for the rank's tensors, and hands it out again
at the next save when their sizes are the same (a training state's are, from step to step),
as :class:`~epochal.checkpoint.tasks.background.SnapshotPool` does for one process: fresh
memory costs a page fault per page on first touch, and pinning it costs more. The buffer is
leased to the write that uses it and comes back when that write ended (writes of the same
snapshot to two places each hold it: :meth:`HostStaging.hold`). ``max_host_bytes``
bounds what is kept between saves (None: one state's worth); a snapshot larger than the
bound gets memory of its own, freed once written.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

__all__ = ["HostStaging"]

_ALIGN = 64  # each tensor starts at a multiple of this in the buffer


def _padded(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class HostStaging:
    """Snapshots of a rank's items into one reused host buffer (see the module doc).
    Counters for tests: :attr:`allocated` (buffers made), :attr:`reused`."""

    def __init__(self, max_host_bytes: int | None = None) -> None:
        self.max_host_bytes = max_host_bytes
        self._buffer: torch.Tensor | None = None
        self._layout: tuple[Any, ...] = ()
        self._holders = 0  # writes that still read the pooled buffer
        self._lock = threading.Lock()
        self.allocated = 0
        self.reused = 0

    def _lease(self, layout: tuple[Any, ...], nbytes: int, pinned: bool) -> tuple[torch.Tensor, bool]:
        """A buffer of ``nbytes`` and whether it is the pooled one (to release after)."""
        with self._lock:
            buf = self._buffer
            if buf is not None and not self._holders and self._layout == layout:
                self._holders = 1
                self.reused += 1
                return buf, True
            self.allocated += 1
            fresh = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            keep = not self._holders and (self.max_host_bytes is None or nbytes <= self.max_host_bytes)
            if keep:
                self._buffer, self._layout, self._holders = fresh, layout, 1
            return fresh, keep

    def hold(self) -> None:
        """One more write reads the pooled snapshot (a second place it goes to): the buffer is
        handed out again only after a :meth:`release` for each."""
        with self._lock:
            self._holders += 1

    def release(self) -> None:
        """A write of the pooled buffer ended: once every one has, it may be handed out again."""
        with self._lock:
            self._holders = max(0, self._holders - 1)

    def snapshot(self, blobs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """A copy of ``blobs`` in host memory the live objects can change after: tensors
        (CPU or CUDA) copied into the buffer, other values deep-copied. Returns the copy and
        whether it lives in the pooled buffer (then :meth:`release` once it is written)."""
        tensors = {k: v.detach() for k, v in blobs.items() if isinstance(v, torch.Tensor)}
        layout = tuple((k, tuple(t.shape), t.dtype, t.device.type) for k, t in tensors.items())
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        total = sum(_padded(n) for n in sizes)
        cuda = any(t.is_cuda for t in tensors.values())
        out: dict[str, Any] = {k: copy.deepcopy(v) for k, v in blobs.items() if k not in tensors}
        if not tensors:
            return out, False
        buf, pooled = self._lease(layout, max(total, 1), pinned=cuda and torch.cuda.is_available())
        at = 0
        for (name, t), n in zip(tensors.items(), sizes):
            host = buf[at:at + n].view(t.dtype).view(t.shape) if n else torch.empty(t.shape, dtype=t.dtype)
            host.copy_(t, non_blocking=t.is_cuda)
            out[name] = host
            at += _padded(n)
        if cuda:
            torch.cuda.synchronize()  # every device-to-host copy has landed
        return out, pooled

    #: a CUDA tensor's snapshot is a host copy in the (pinned) buffer, a DTensor's one around
    #: the host copy of its local shard with its spec unchanged (mesh, placements, global
    #: shape), which DCP plans and writes off the device. False: a state holding a CUDA tensor
    #: gets no snapshot (its caller plans it on the training thread and stages it as written)
    OFF_DEVICE = True

    def snapshot_state(self, state_dict: dict[str, Any]) -> tuple[dict[str, Any], bool] | None:
        """A copy of a whole DCP state dict that DCP can save later, from another thread,
        while the live one changes: each tensor's (each DTensor's local shard's) bytes copied
        into the buffer, from the CPU or a CUDA device (a DTensor comes back as one on its mesh
        and placements, around the host copy, with no communication), other values
        deep-copied, nested dicts and lists as they were. Returns the copy and whether it is
        pooled (as :meth:`snapshot`); None when the state holds a tensor of another device
        (or a CUDA one, without :attr:`OFF_DEVICE`): the caller stages those through
        :meth:`snapshot` of what it writes."""
        from torch.distributed.checkpoint._nested_dict import (
            flatten_state_dict,
            unflatten_state_dict,
        )
        from torch.distributed.tensor import DTensor

        flat, mappings = flatten_state_dict(state_dict)
        # (the private fields: from_local and to_local go through autograd functions, ~0.15 ms a
        # tensor, and a training state has thousands; a snapshot needs no gradient)
        local = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in flat.items()}
        kept = ("cpu", "cuda") if self.OFF_DEVICE else ("cpu",)
        if any(isinstance(v, torch.Tensor) and v.device.type not in kept for v in local.values()):
            return None
        copied, pooled = self.snapshot(local)
        for k, v in flat.items():
            if isinstance(v, DTensor):  # its spec (mesh, placements, global shape) around the copy
                copied[k] = DTensor.__new__(DTensor, copied[k], v._spec, requires_grad=False)
        return unflatten_state_dict(copied, mappings), pooled
