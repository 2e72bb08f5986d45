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
from ..storage.formats.native.layout import corrupt
from ..storage.formats.native.reads.ranges import RangedFile
from .dcp import DcpLeaf, open_dcp, read_dcp_regions
from .names import leaf_label
from .pieces import Piece, chunked_layout, read_pieces
from .reads import Stored, Task, array_layout, read_plain, read_regions, stored_leaves

__all__ = ["DcpSource", "LocalSource", "Source"]

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
