"""The typed items the native reader's phases hand each other (instead of tuples).

A load resolves names to blob indices, allocates one :class:`LoadItem` per blob (its codec
and fresh buffers), has a read path fill and verify the buffers, then decodes each item.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import BlobMismatchError, CheckpointError
from ..io.seam import ByteSource
from .index import Index
from .layout import corrupt

__all__ = ["DECODE_ERRORS", "BigRead", "Direct", "LoadItem", "Opened", "call_codec"]

#: what a codec raises on a meta or bytes it cannot make sense of (reported as corrupt)
DECODE_ERRORS = (
    ValueError, TypeError, KeyError, IndexError, OverflowError, UnicodeError, struct.error,
    RecursionError,
)


def call_codec(path: str, item: LoadItem, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` (a codec's decode or inplace_targets for ``item``), its errors naming
    the file and blob: a mismatch with the live object stays a BlobMismatchError, anything
    a codec cannot make sense of is reported as corrupt."""
    try:
        return fn(*args)
    except BlobMismatchError as e:
        raise BlobMismatchError(f"{path}, blob {item.name!r}: {e}") from e
    except CheckpointError:
        raise
    except DECODE_ERRORS as e:
        raise corrupt(path, f"cannot decode {item.kind} blob: {e}", item.name) from None


@dataclass(frozen=True)
class Opened:
    """What every read path needs of an open native file: its name, bytes and index."""

    path: str
    src: ByteSource
    index: Index


@dataclass(frozen=True, slots=True)
class LoadItem:
    """One blob being loaded: blob index, name, kind, meta, codec and the buffers the read
    path fills (one per segment; the mmap path appends views, the in-place path swaps a
    buffer for the live target it read into)."""

    index: int
    name: str
    kind: str
    meta: dict[str, Any]
    codec: Any
    bufs: list[memoryview]


@dataclass(frozen=True)
class Direct:
    """A segment read straight into live memory: plan position, segment number in its blob,
    blob name, file offset, size, padding, checksum, target view and its address."""

    pos: int
    seg: int
    name: str
    off: int
    size: int
    pad: int
    crc: int
    target: memoryview
    addr: int


@dataclass(frozen=True)
class BigRead:
    """A big segment for the parallel pass: its checksum slot, buffer, file offset, padding
    and blob name."""

    slot: int
    buf: memoryview
    off: int
    pad: int
    name: str
