"""Bit-for-bit comparison of nested torch state (for the torch tests)."""

from __future__ import annotations

from typing import Any

import torch


def bits(t: Any) -> bytes:
    """The raw bytes of a tensor (any dtype), in C order."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same_state(a: Any, b: Any) -> bool:
    """Bit-equal nested state: tensors by dtype, shape and bytes, other leaves by type and repr
    (so floats compare by value including -0.0 and NaN spelling)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)
    return type(a) is type(b) and repr(a) == repr(b)
