"""What a restore reads from: a Checkpointer's step (one db, leaves by their names) or a
step written by ``dcp.save`` (rank dbs, items by FQN: :mod:`.dcp`), behind one interface.

A :class:`Source` is keyed by a leaf's stored names (:class:`~.mapping.Target`): the
Checkpointer's db by the names themselves, a DCP step by the FQN DCP gives nested dicts
(the names joined by ``.``: ``model.fc.weight``). For each key it gives the stored layout
(dtype and shape of an array, None for a plain value), the regions of an array read and
checked (a tensor record by its row blocks, :mod:`.reads`; a sharded array saved as its
chunks, or a DCP item, from the pieces each region overlaps, :mod:`.pieces`), or a plain
value decoded from checked bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..storage.encoding.chunks import KIND as CHUNKED_KIND
from ..storage.encoding.chunks import check_cover, part_of
from ..storage.formats.native.layout import corrupt
from ..storage.formats.native.reads.ranges import RangedFile
from .dcp import DcpLeaf, open_dcp, read_dcp_regions
from .names import leaf_label
from .pieces import Piece, chunked_layout, read_pieces
from .reads import Stored, Task, array_layout, read_plain, read_regions, stored_leaves

__all__ = ["DcpSource", "LocalSource", "ProcessesSource", "Source"]

Key = tuple[str, ...]


class Source:
    """The stored leaves of one step (see the module doc); ``path`` names the file in errors."""

    path: str

    def key(self, names: Key) -> Key:
        """The key of a leaf stored under ``names``."""
        return names

    def keys(self) -> list[Key]:
        raise NotImplementedError

    def kind(self, key: Key) -> str:
        raise NotImplementedError

    def layout(self, key: Key, label: str) -> tuple[np.dtype, tuple[int, ...]] | None:
        raise NotImplementedError

    def regions(self, key: Key, label: str, indices: list[tuple[Any, ...]], chunk: int,
                run: Callable[[list[Task]], None]) -> list[np.ndarray]:
        """The regions ``indices`` of an array leaf, checked, in aligned buffers; ``run``
        runs independent reads (on a thread pool)."""
        raise NotImplementedError

    def plain(self, key: Key, label: str) -> Any:
        raise NotImplementedError

    def prefetch(self, keys: list[Key]) -> None:
        """The leaves ``keys`` will be read, in this order: a cold file may be read ahead."""

    def close(self) -> None:
        """Close the files opened."""


def _plain(f: RangedFile, s: Stored, label: str) -> Any:
    try:
        return read_plain(f, s)
    except (ValueError, TypeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise corrupt(f.path, f"leaf {label}: {e}", s.blob) from None


class LocalSource(Source):
    """A Checkpointer's step: its one db at ``path`` (a ``torch.chunked_tensor`` leaf's
    layout parsed and checked once, when first asked for)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.f = RangedFile(path)
        self.chunked: dict[Key, tuple[np.dtype, tuple[int, ...], list[Piece]]] = {}
        try:
            self.stored = stored_leaves(self.f)
        except BaseException:
            self.f.close()
            raise

    def keys(self) -> list[Key]:
        return list(self.stored)

    def kind(self, key: Key) -> str:
        return self.stored[key].kind

    def _chunked(self, key: Key, label: str) -> tuple[np.dtype, tuple[int, ...], list[Piece]]:
        got = self.chunked.get(key)
        if got is None:
            s = self.stored[key]
            try:
                got = self.chunked[key] = chunked_layout(s)
            except ValueError as e:
                raise corrupt(self.path, f"leaf {label}: {e}", s.blob) from None
        return got

    def layout(self, key: Key, label: str) -> tuple[np.dtype, tuple[int, ...]] | None:
        s = self.stored[key]
        if s.kind == CHUNKED_KIND:
            return self._chunked(key, label)[:2]
        try:
            return array_layout(s)
        except ValueError as e:
            raise corrupt(self.path, f"leaf {label}: {e}", s.blob) from None

    def regions(self, key: Key, label: str, indices: list[tuple[Any, ...]], chunk: int,
                run: Callable[[list[Task]], None]) -> list[np.ndarray]:
        s = self.stored[key]
        if s.kind == CHUNKED_KIND:
            dt, shape, pieces = self._chunked(key, label)
            return read_pieces({"": self.f}, pieces, dt, shape, label, s.blob, indices, chunk, run)
        return read_regions(self.f, s, label, indices, chunk, run=run)

    def plain(self, key: Key, label: str) -> Any:
        return _plain(self.f, self.stored[key], label)

    def prefetch(self, keys: list[Key]) -> None:
        self.f.prefetch([(off, n) for k in keys for off, n, _ in self.stored[k].segs])

    def close(self) -> None:
        self.f.close()


class ProcessesSource(Source):
    """A step saved by several JAX processes (:mod:`.multiprocess`): a db per process
    (``dbs``: node -> path, each checked against the manifest by the caller). A leaf lies
    whole in one db (an array one process held whole, a plain value: process 0's), or as
    the chunk records of the processes that held its shards (each marked as a part), read
    together as one array's pieces, checked to cover it exactly once."""

    def __init__(self, dbs: dict[str, str]) -> None:
        self.files: dict[str, RangedFile] = {}
        self.path = next(iter(dbs.values()))
        #: each leaf's records: (node, record), in the order of ``dbs``
        self.stored: dict[Key, list[tuple[str, Stored]]] = {}
        self.chunked: dict[Key, tuple[np.dtype, tuple[int, ...], list[Piece]]] = {}
        try:
            for node, path in dbs.items():
                f = self.files[node] = RangedFile(path)
                for key, s in stored_leaves(f).items():
                    self.stored.setdefault(key, []).append((node, s))
        except BaseException:
            self.close()
            raise

    def keys(self) -> list[Key]:
        return list(self.stored)

    def kind(self, key: Key) -> str:
        return self.stored[key][0][1].kind

    def _one(self, key: Key, label: str) -> tuple[str, Stored] | None:
        """The leaf's one whole record (None: it is stored as parts)."""
        got = self.stored[key]
        node, s = got[0]
        try:
            part = part_of(s.meta) if s.kind == CHUNKED_KIND else None
        except ValueError as e:
            raise corrupt(self.files[node].path, f"leaf {label}: {e}", s.blob) from None
        if len(got) == 1 and part is None:
            return node, s
        if part is None or any(k != CHUNKED_KIND for k in (x.kind for _, x in got)):
            raise corrupt(self.files[node].path, f"leaf {label}: stored in the dbs of "
                          f"{', '.join(n for n, _ in got)}, not as the parts of one array", s.blob)
        return None

    def _chunked(self, key: Key, label: str) -> tuple[np.dtype, tuple[int, ...], list[Piece]]:
        got = self.chunked.get(key)
        if got is not None:
            return got
        one = self._one(key, label)
        parts = [one] if one is not None else self.stored[key]
        pieces: list[Piece] = []
        boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # every part's chunks
        first: tuple[np.dtype, tuple[int, ...]] | None = None
        for node, s in parts:
            where = self.files[node].path
            try:
                dt, shape, mine = chunked_layout(s, node, partial=one is None, boxes=boxes)
            except ValueError as e:
                raise corrupt(where, f"leaf {label}: {e}", s.blob) from None
            if first is not None and first != (dt, shape):
                raise corrupt(where, f"leaf {label}: this db's part is {dt} {shape}, another's {first[0]} "
                                     f"{first[1]}", s.blob)
            first = (dt, shape)
            pieces.extend(mine)
        assert first is not None
        if one is None:
            try:
                check_cover(first[1], boxes)
            except ValueError as e:
                raise corrupt(self.path, f"leaf {label}: the processes' parts, together: {e}",
                              parts[0][1].blob) from None
        got = self.chunked[key] = (first[0], first[1], pieces)
        return got

    def layout(self, key: Key, label: str) -> tuple[np.dtype, tuple[int, ...]] | None:
        one = self._one(key, label)
        if one is None or one[1].kind == CHUNKED_KIND:
            return self._chunked(key, label)[:2]
        try:
            return array_layout(one[1])
        except ValueError as e:
            raise corrupt(self.files[one[0]].path, f"leaf {label}: {e}", one[1].blob) from None

    def regions(self, key: Key, label: str, indices: list[tuple[Any, ...]], chunk: int,
                run: Callable[[list[Task]], None]) -> list[np.ndarray]:
        one = self._one(key, label)
        if one is None or one[1].kind == CHUNKED_KIND:
            dt, shape, pieces = self._chunked(key, label)
            return read_pieces(self.files, pieces, dt, shape, label, self.stored[key][0][1].blob, indices, chunk, run)
        return read_regions(self.files[one[0]], one[1], label, indices, chunk, run=run)

    def plain(self, key: Key, label: str) -> Any:
        one = self._one(key, label)
        assert one is not None  # (a plain value is one record: _one refuses parts of other kinds)
        return _plain(self.files[one[0]], one[1], label)

    def prefetch(self, keys: list[Key]) -> None:
        for node, f in self.files.items():
            f.prefetch([(off, n) for k in keys for nd, s in self.stored[k] if nd == node for off, n, _ in s.segs])

    def close(self) -> None:
        with contextlib.ExitStack() as stack:
            for f in self.files.values():
                stack.callback(f.close)


class DcpSource(Source):
    """A step ``dcp.save`` wrote into ``directory`` (its rank dbs, read by :mod:`.dcp`)."""

    def __init__(self, directory: str, step: int) -> None:
        self.files: dict[str, RangedFile] = {}
        try:
            self.items, self.path = open_dcp(directory, step, self.files)
        except BaseException:
            self.close()
            raise

    def key(self, names: Key) -> Key:
        return (".".join(names),)

    def keys(self) -> list[Key]:
        return [(fqn,) for fqn in self.items]

    def _item(self, key: Key) -> DcpLeaf:
        return self.items[key[0]]

    def kind(self, key: Key) -> str:
        leaf = self._item(key)
        return leaf.plain.kind if leaf.plain is not None else "torch.tensor"

    def layout(self, key: Key, label: str) -> tuple[np.dtype, tuple[int, ...]] | None:
        leaf = self._item(key)
        if leaf.plain is not None:
            return None
        if leaf.dtype is None:
            raise corrupt(self.path, f"leaf {label}: item {leaf.fqn!r} has a dtype with no numpy equivalent",
                          "metadata")
        return leaf.dtype, leaf.shape

    def regions(self, key: Key, label: str, indices: list[tuple[Any, ...]], chunk: int,
                run: Callable[[list[Task]], None]) -> list[np.ndarray]:
        return read_dcp_regions(self.files, self._item(key), label, indices, chunk, run)

    def plain(self, key: Key, label: str) -> Any:
        leaf = self._item(key)
        assert leaf.plain is not None
        return _plain(self.files[leaf.db], leaf.plain, label)

    def close(self) -> None:
        with contextlib.ExitStack() as stack:
            for f in self.files.values():
                stack.callback(f.close)


def label_of(key: Key) -> str:
    """A stored key as a readable path (``params/w``, or a DCP FQN)."""
    return leaf_label(key)
