"""What a rank reads of a DCP checkpoint, and in which order (:class:`EpochalStorageReader`).

DCP's load planner gives each rank read items: a region of a saved chunk (``storage_offsets``,
``lengths``) for a region of a live tensor. Each item becomes pieces, one per blob it needs:
the chunk's one blob, or, for a chunk stored as row blocks (:mod:`.blocks`), only the blocks
its rows overlap, so a rank that needs a quarter of a chunk reads about a quarter of its bytes
(a block is the unit a checksum covers). Each blob is read once, even when several pieces
want it, and every blob this read needs is verified before any live tensor is written:

1. every db is opened; a blob whose one piece wants all of it, into a live region of its
   shape and dtype, is *direct* (read straight into the live memory later); a partly
   wanted tensor of its live regions' dtype, into CPU memory, in a file that looks cached,
   is *mapped*: verified now on a read-only map of the file (CRC over the page-cache
   pages, no memory allocated: fresh memory costs more in page faults than the read
   itself) and its wanted bytes copied out of that map in step 2; the others
   (another dtype, bytes items, a cold file, a URL) are read now into fresh memory,
   verified, and held (past :data:`HOLD_MAX` bytes they are only verified now and read
   again in step 2); the direct blobs of every db but the one with the most of them are verified
   now too (that one's are verified by its in-place read before any of them is written;
   on a URL that read fetches them into fresh memory, verified, then copies them), or, for
   a URL, read now into held memory while under HOLD_MAX (a verify pass would fetch twice);
2. only then, db by db (that one first): the direct blobs into the live memory (those
   verified in step 1 without a second check, as the in-place path itself verifies a map
   of the file and then reads it again), the held values (and the wanted bytes of the
   mapped ones) copied into their regions, each item committed to the planner once all its
   pieces are in.

A damaged byte is a :class:`~epochal.errors.CheckpointCorruptError` naming the db file and
the blob (``w@4,0#b1``: FQN, chunk offsets, block), raised before any live tensor changed
(except when a file changed on disk between the two steps: a held-back or mapped blob).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ...errors import CheckpointCorruptError, CheckpointNotFoundError
from ...storage.encoding.codecs import LoadOptions, load_options
from ...storage.formats.base import BlobInfo
from ...storage.formats.native.reader import NativeFile
from ...storage.formats.native.reads.mapped import MappedViews
from ...storage.io import tuning
from ...storage.io.seam import is_url, store_for
from ..torch import dtype_name
from .blocks import blocks_over
from .metadata_json import ItemLocation
from .planners import set_value

__all__ = ["HOLD_MAX", "read_items"]

#: the most bytes of partly-wanted blobs held in memory between the two steps
HOLD_MAX = 256 << 20


@dataclass(frozen=True)
class Piece:
    """What one read item takes from one blob: the region ``offsets`` + ``lengths`` of the
    blob's tensor, into rows ``at .. at + lengths[0]`` of the item's live region (``at`` is
    None: the whole region)."""

    item: int  # the item's position in the plan
    blob: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    at: int | None


def read_items(root: str, storage: Mapping[MetadataIndex, ItemLocation], chunk_rows: Mapping[tuple[str, tuple[int, ...]], int],
               plan: LoadPlan, planner: LoadPlanner) -> None:
    """Read ``plan``'s items from the dbs under ``root`` (see the module doc). ``storage``:
    the metadata's storage entries; ``chunk_rows``: (FQN, chunk offsets) -> the chunk's rows."""
    items = list(plan.items)
    wanted: dict[str, dict[str, list[Piece]]] = defaultdict(lambda: defaultdict(list))
    parts = [0] * len(items)
    for i, item in enumerate(items):
        loc = storage.get(item.storage_index)
        if loc is None:
            raise CheckpointCorruptError(root, f"the DCP metadata has no storage for item "
                                         f"{item.storage_index.fqn!r} at {item.storage_index.offset}")
        for piece in _pieces(i, item, loc, chunk_rows, root):
            wanted[loc.db][piece.blob].append(piece)
            parts[i] += 1
    empty = [i for i, n in enumerate(parts) if not n]  # (rows lo..lo of a blocked chunk: nothing to read)
    with load_options(LoadOptions(map_location="cpu", where=f"DCP checkpoint {root}")), \
            contextlib.ExitStack() as stack:
        files: dict[str, NativeFile] = {}
        for file in sorted(wanted):
            path = f"{root.rstrip('/')}/{file}"
            if not store_for(path).exists(path):
                raise CheckpointNotFoundError(f"{path}: the db of DCP items {sorted(wanted[file])[:3]} does not exist")
            files[file] = stack.enter_context(NativeFile(path, mmap=False))
        reads = _Reads(items, planner, parts)
        stack.callback(reads.close)
        for file, f in files.items():
            reads.plan(file, f, wanted[file])
        main = reads.verify_first(files)
        for file in sorted(files, key=lambda k: k != main):  # (the unverified one first)
            reads.apply(file, files[file], wanted[file])
        for i in empty:
            planner.commit_tensor(items[i], planner.resolve_tensor(items[i]).detach())


def _pieces(i: int, item: ReadItem, loc: ItemLocation, chunk_rows: Mapping[tuple[str, tuple[int, ...]], int],
            root: str) -> list[Piece]:
    so, ln = tuple(int(x) for x in item.storage_offsets), tuple(int(x) for x in item.lengths)
    if item.type == LoadItemType.BYTE_IO or not loc.rows or not ln:
        return [Piece(i, loc.blob, so, ln, None)]
    key = (item.storage_index.fqn, tuple(int(x) for x in item.storage_index.offset or ()))
    total = chunk_rows.get(key)
    if total is None:
        raise CheckpointCorruptError(root, f"the DCP metadata has no chunk {key[1]} of {key[0]!r}", loc.blob)
    try:
        return [Piece(i, b.blob, (b.first, *so[1:]), (b.count, *ln[1:]), b.at)
                for b in blocks_over(loc.blob, loc.rows, total, so[0], so[0] + ln[0])]
    except ValueError as ex:
        raise CheckpointCorruptError(root, f"DCP item {item.dest_index.fqn!r}: {ex}", loc.blob) from None


class _Reads:
    """The state of one read: live regions resolved once per item, held values, direct blobs."""

    def __init__(self, items: list[ReadItem], planner: LoadPlanner, parts: list[int]) -> None:
        self.items, self.planner, self.parts = items, planner, parts
        self.targets: dict[int, torch.Tensor] = {}
        self.held: dict[tuple[str, str], Any] = {}
        self.later: dict[str, list[str]] = defaultdict(list)
        self.direct: dict[str, dict[str, torch.Tensor]] = {}
        self.held_bytes = 0
        #: the dbs whose direct blobs step 1 verified
        self.verified: set[str] = set()
        #: the verified maps held values are copied out of (closed by :meth:`close`)
        self.maps: list[MappedViews] = []

    def close(self) -> None:
        """Let the maps of the held views go."""
        self.held.clear()
        for m in self.maps:
            m.close()
        self.maps = []

    def target(self, piece: Piece) -> torch.Tensor:
        """The live region ``piece`` fills (a view of the planner's tensor for its item)."""
        t = self.targets.get(piece.item)
        if t is None:
            t = self.targets[piece.item] = self.planner.resolve_tensor(self.items[piece.item]).detach()
        if piece.at is not None and t.dim():
            t = t.narrow(0, piece.at, piece.lengths[0])
        return t

    def plan(self, file: str, f: NativeFile, wanted: dict[str, list[Piece]]) -> None:
        """Step 1 for one db: sort its blobs into direct, mapped and held (the mapped ones
        verified now, the held ones read now)."""
        direct: dict[str, torch.Tensor] = {}
        staged: list[str] = []
        mappable: list[str] = []  # partly wanted tensors that can be copied out of a map as bytes
        infos: dict[str, BlobInfo] = {}
        for blob, pieces in wanted.items():
            first = pieces[0]
            if self.items[first.item].type == LoadItemType.BYTE_IO:
                staged.append(blob)
                continue
            info = infos[blob] = f.info(blob)
            if len(pieces) == 1 and not any(first.offsets) and info.shape == first.lengths:
                target = self.target(first)
                if tuple(target.size()) == first.lengths and info.dtype == dtype_name(target.dtype):
                    direct[blob] = target
                    continue
            (mappable if _mappable(info, [self.target(p) for p in pieces]) else staged).append(blob)
        self.direct[file] = direct
        views = f.views(mappable) if mappable else None  # verified now, on a map of the file
        if views is None:
            staged = mappable + staged
        else:
            self.maps.append(views)
            for blob, view in views.views.items():
                self.held[file, blob] = _Mapped(view, infos[blob].shape or ())
        batch: list[str] = []
        size = 0
        for blob in staged:
            n = (infos.get(blob) or f.info(blob)).nbytes
            if self.held_bytes + n > HOLD_MAX and self.held_bytes:
                self.later[file].append(blob)
                continue
            if size and size + n > tuning.PARALLEL_MIN // 4:
                self._hold(file, f, batch)
                batch, size = [], 0
            batch.append(blob)
            size += n
            self.held_bytes += n
        self._hold(file, f, batch)
        if self.later[file]:
            f.verify(self.later[file])

    def _hold(self, file: str, f: NativeFile, batch: list[str]) -> None:
        """Read ``batch`` (in reads of about a quarter of tuning.PARALLEL_MIN bytes: below the
        size at which the reader spreads a read over threads, which costs more than it gives
        when every core is busy, as a training job's are) into fresh memory, verified."""
        if batch:
            for blob, value in f.read(batch).items():
                self.held[file, blob] = value

    def verify_first(self, files: dict[str, NativeFile]) -> str | None:
        """The direct blobs of every db but the one with the most direct bytes (returned; its
        are verified by its in-place read, which step 2 does first): verified now, so that a
        damaged one is found before any live memory is written."""
        sizes = {file: sum(t.numel() * t.element_size() for t in d.values()) for file, d in self.direct.items() if d}
        if not sizes:
            return None
        main = max(sizes, key=lambda k: sizes[k])
        for file, n in sizes.items():
            if file == main:
                continue
            f, names = files[file], list(self.direct[file])
            if is_url(f.path) and self.held_bytes + n <= HOLD_MAX:  # (a verify pass would fetch twice)
                self.held_bytes += n
                self._hold(file, f, names)
                self.direct[file] = {}
                continue
            f.verify(names)
            self.verified.add(file)
        return main

    def apply(self, file: str, f: NativeFile, wanted: dict[str, list[Piece]]) -> None:
        """Step 2 for one db: the direct blobs into live memory, the held values handed out."""
        direct = self.direct.get(file) or {}
        if direct:
            f.read(list(direct), existing=direct, verify=file not in self.verified)
            for blob in direct:
                self._done(wanted[blob][0])
        for blob in wanted:
            if (file, blob) in self.held:
                self._hand_out(f, blob, self.held.pop((file, blob)), wanted[blob])
        later = self.later.get(file) or []
        for k in range(0, len(later), 8):
            got = f.read(later[k:k + 8])
            for blob, value in got.items():
                self._hand_out(f, blob, value, wanted[blob])

    def _hand_out(self, f: NativeFile, blob: str, saved: Any, pieces: Sequence[Piece]) -> None:
        """Copy each piece's region of the (verified) saved value into its live region."""
        for piece in pieces:
            item = self.items[piece.item]
            if item.type == LoadItemType.BYTE_IO:
                set_value(self.planner, item, saved)
                continue
            target = self.target(piece)
            if isinstance(saved, _Mapped):  # bytes of the map into the live bytes (numpy: no GIL)
                src, dst = saved.region(piece.offsets, piece.lengths, target.element_size()), _bytes(target)
                if dst is None or src.shape != dst.shape:
                    raise CheckpointCorruptError(f.path, f"DCP item {item.dest_index.fqn!r}: saved region "
                                                 f"{piece.lengths} does not fit {tuple(target.size())}", blob)
                np.copyto(dst, src)
                self._done(piece)
                continue
            if not isinstance(saved, torch.Tensor):
                raise CheckpointCorruptError(f.path, "a DCP tensor chunk holds no tensor", blob)
            part = _narrow(saved, piece.offsets, piece.lengths)
            if target.size() != part.size():
                raise CheckpointCorruptError(f.path, f"DCP item {item.dest_index.fqn!r}: saved region "
                                             f"{tuple(part.size())} does not fit {tuple(target.size())}", blob)
            target.copy_(part)
            self._done(piece)

    def _done(self, piece: Piece) -> None:
        """One more piece of its item is in; the last one commits the item to the planner."""
        self.parts[piece.item] -= 1
        if not self.parts[piece.item]:
            self.planner.commit_tensor(self.items[piece.item], self.targets[piece.item])


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The region ``offsets`` .. ``offsets + lengths`` of ``t`` (a view)."""
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.size(dim):
            t = t.narrow(dim, int(o), int(n))
    return t



@dataclass(frozen=True)
class _Mapped:
    """A held blob as a verified read-only view of its bytes on a map of its file."""

    view: memoryview
    shape: tuple[int, ...]

    def region(self, offsets: Sequence[int], lengths: Sequence[int], itemsize: int) -> np.ndarray:
        """The bytes of the region ``offsets`` .. ``offsets + lengths``: a read-only uint8 view
        whose last dim is in bytes (as :func:`_bytes` of the live region)."""
        a = np.frombuffer(self.view, dtype=np.uint8).reshape(*self.shape[:-1], self.shape[-1] * itemsize)
        index = [slice(o, o + n) for o, n in zip(offsets, lengths)]
        index[-1] = slice(offsets[-1] * itemsize, (offsets[-1] + lengths[-1]) * itemsize)
        return a[tuple(index)]


def _bytes(t: torch.Tensor) -> np.ndarray | None:
    """The memory of the CPU tensor ``t`` as a writable uint8 numpy view whose last dim is in
    bytes; None where it has none such (another device, 0-d, a last dim with a stride, a
    conjugate or negative bit)."""
    if t.device.type != "cpu" or t.layout != torch.strided or not t.dim() or t.is_conj() or t.is_neg():
        return None
    if t.stride(-1) != 1 and t.size(-1) != 1:
        return None
    try:
        return t.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None


def _mappable(info: BlobInfo, targets: Sequence[torch.Tensor]) -> bool:
    """Whether a partly-wanted blob can be copied out of a map as bytes: a tensor of the
    live regions' dtype and rank, whose bytes its shape accounts for, into CPU memory."""
    shape = info.shape
    if info.kind != "torch.tensor" or not shape or not info.nbytes:
        return False
    for t in targets:
        if (info.dtype != dtype_name(t.dtype) or t.dim() != len(shape)
                or math.prod(shape) * t.element_size() != info.nbytes or _bytes(t) is None):
            return False
    return True
