"""Whether a saved state dict fits a live module, from the saved keys and shapes alone.

The framework doors (the Hugging Face Trainer's resume, Lightning's) hand a whole state dict
to ``load_state_dict``, which copies every key that fits before it raises on the first that
does not (or, with ``strict=False``, drops the others without a word). The check here runs
first, from the checkpoint's header or index: missing keys, unexpected keys and shapes, all
named at once in a :class:`~epochal.errors.BlobMismatchError`, with nothing written.

Tied weights (``lm_head.weight`` sharing the embedding's storage, saved once) are not
missing; keys a model declares it may lack or ignore (transformers'
``_keys_to_ignore_on_load_missing`` / ``_keys_to_ignore_on_load_unexpected``, regexes) are
not counted. Dtypes are not compared: ``load_state_dict`` converts them.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import BlobMismatchError, CheckpointCorruptError

__all__ = ["StateFit", "check_weights_fit", "keys_of", "safetensors_header", "state_fit"]

#: the most a safetensors header may claim (the format's own limit is 100 MB)
_MAX_HEADER = 100 << 20


@dataclass
class StateFit:
    """What differs between a saved state dict (keys and shapes) and a live module's."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.shapes)

    def message(self, where: str, what: str = "the live model") -> str:
        parts = []
        if self.missing:
            parts.append(f"keys missing from the checkpoint: {_names(self.missing)}")
        if self.unexpected:
            parts.append(f"keys {what} lacks: {_names(self.unexpected)}")
        for key, saved, live in self.shapes[:8]:
            parts.append(f"{key}: checkpoint shape {saved}, live shape {live}")
        if len(self.shapes) > 8:
            parts.append(f"and {len(self.shapes) - 8} more shapes differ")
        return f"{where} does not fit {what}; nothing was restored: " + "; ".join(parts)


def _names(keys: list[str], limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _patterns(model: Any, attr: str) -> list[re.Pattern[str]]:
    out = []
    for p in getattr(model, attr, None) or []:
        try:
            out.append(re.compile(str(p)))
        except re.error:
            continue
    return out


def state_fit(saved: Mapping[str, tuple[int, ...]], model: Any, *, prefix: str = "") -> StateFit:
    """Compare ``saved`` (key -> shape) with ``model.state_dict()`` (keys with ``prefix``
    removed where the saved ones lack it)."""
    live = model.state_dict()
    if prefix:
        live = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in live.items()}
    fit = StateFit()
    ignore_missing = _patterns(model, "_keys_to_ignore_on_load_missing")
    ignore_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    present_storage = {_storage(live[k]) for k in saved if k in live}
    for key, tensor in live.items():
        if key in saved:
            shape = tuple(int(d) for d in getattr(tensor, "shape", ()))
            if tuple(saved[key]) != shape:
                fit.shapes.append((key, tuple(saved[key]), shape))
        elif _storage(tensor) in present_storage and _storage(tensor) is not None:
            continue  # tied to a saved tensor (saved once)
        elif not any(p.search(key) for p in ignore_missing):
            fit.missing.append(key)
    fit.unexpected = [k for k in saved if k not in live and not any(p.search(k) for p in ignore_unexpected)]
    return fit


def _storage(t: Any) -> Any:
    try:
        return (t.untyped_storage().data_ptr(), t.device.type) if t.numel() else None
    except Exception:  # noqa: BLE001 - not a tensor: never tied
        return None


def safetensors_header(data: bytes | memoryview) -> dict[str, tuple[int, ...]]:
    """Key -> shape from the header of a safetensors file's bytes (JSON only: nothing else
    of the file is interpreted). CheckpointCorruptError for a header that is not one."""
    mv = memoryview(data)
    if mv.nbytes < 8:
        raise CheckpointCorruptError("model.safetensors", "too short for a safetensors header")
    (n,) = struct.unpack("<Q", mv[:8])
    if n > min(_MAX_HEADER, mv.nbytes - 8):
        raise CheckpointCorruptError("model.safetensors", f"header length {n} exceeds the file")
    try:
        header = json.loads(bytes(mv[8 : 8 + n]))
    except ValueError as ex:
        raise CheckpointCorruptError("model.safetensors", f"header is not JSON ({ex})") from None
    if not isinstance(header, dict):
        raise CheckpointCorruptError("model.safetensors", "header is not a JSON object")
    out: dict[str, tuple[int, ...]] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointCorruptError("model.safetensors", f"tensor {key!r} has no valid shape")
        out[str(key)] = tuple(shape)
    return out


def check_weights_fit(path: str, saved: Mapping[str, tuple[int, ...]], model: Any) -> None:
    """BlobMismatchError naming every key of ``path`` that does not fit ``model`` (nothing is
    written); see the module doc."""
    fit = state_fit(saved, model)
    if not fit.ok:
        raise BlobMismatchError(fit.message(f"checkpoint {path}", f"the live {type(model).__name__}"))


def keys_of(items: Iterable[tuple[str, Any]]) -> dict[str, tuple[int, ...]]:
    """Key -> shape of ``(key, tensor)`` pairs (a loaded state dict's)."""
    return {str(k): tuple(int(d) for d in getattr(v, "shape", ())) for k, v in items}
