"""The typed items the native reader's phases hand each other (instead of tuples).

A load resolves names to blob indices, allocates one :class:`LoadItem` per blob (its codec
and fresh buffers), has a read path fill and verify the buffers, then decodes each item.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NoReturn

from ....errors import BlobMismatchError, CheckpointError
from ...io.seam import ByteSource
from .index import Index
from .layout import corrupt

__all__ = ["DECODE_ERRORS", "BigRead", "Direct", "LoadItem", "Opened", "raise_codec_error"]

#: what a codec raises on a meta or bytes it cannot make sense of (reported as corrupt)
DECODE_ERRORS = (
    ValueError, TypeError, KeyError, IndexError, OverflowError, UnicodeError, struct.error,
    RecursionError,
)


def raise_codec_error(path: str, item: LoadItem, e: BaseException) -> NoReturn:
    """Re-raise ``e``, which a codec raised for ``item`` (its decode or inplace_targets),
    naming the file and blob: a mismatch with the live object stays a BlobMismatchError, an
    epochal error passes as it is, anything else a codec cannot make sense of (DECODE_ERRORS)
    is reported as corrupt. Call it from an ``except`` clause."""
    if isinstance(e, BlobMismatchError):
        raise BlobMismatchError(f"{path}, blob {item.name!r}: {e}") from e
    if isinstance(e, CheckpointError) or not isinstance(e, DECODE_ERRORS):
        raise e
    raise corrupt(path, f"cannot decode {item.kind} blob: {e}", item.name) from None


@dataclass(frozen=True)
class Opened:
    """What every read path needs of an open native file: its name, bytes and index."""

    path: str
    src: ByteSource
    index: Index


@dataclass(slots=True)
class LoadItem:
    """One blob being loaded: blob index, name, kind, meta, codec and the buffers the read
    path fills (one per segment; the mmap path appends views, the in-place path swaps a
    buffer for the live target it read into). Read-only by convention, not ``frozen``: a
    frozen dataclass costs 1.7 us per instance against 0.5 us, a measurable share of a load
    of thousands of small blobs (one item each)."""

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
