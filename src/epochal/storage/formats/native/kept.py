"""The content chunks of the last incremental save in a folder, kept in memory for the next.

An incremental save on this machine compares each chunk with the same bytes of its base
step. Reading those bytes back (through the page cache, over the base's extents) cost more
than the comparison itself; so a save keeps in memory the bytes of the content chunks it
wrote (its own copy: the caller's arrays change after the save), and the next save in the
same folder compares against them instead, with no read. A kept buffer is reused from save
to save: only the units that changed are copied into it.

Kept bytes stand for a file's logical bytes only while that file and every file it takes
bytes from are the ones written: each file's identity (device, inode, size, modification
and change times) is recorded when the save commits and checked before the next save uses
them. Any difference (another process rewrote a step, a file was replaced or removed, the
base is not the step this process wrote last) and the kept bytes are dropped: the save
reads the base as before. A save takes the kept bytes for itself as it starts and hands back
the new ones only once it has committed, so a failed save leaves none.

A :class:`KeptBytes` belongs to whoever saves in the folder: the ``Checkpointer`` (freed with
it), or a JobRunner's node (:func:`for_node`: held by the process that runs the node's saves
until :func:`release`, which ``JobRunner.train`` calls as it ends). The ``kept_bytes`` knob
(:mod:`epochal.knobs`, 2 GiB; 0 keeps none) bounds the memory of each; chunks past it are
not kept (their next save reads them). While a save runs, buffers of the save before that it
has not reused yet are held too.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

import numpy as np

from .... import knobs

logger = logging.getLogger("epochal")

__all__ = ["KeptBytes", "Keeper", "for_node", "release"]

_Ident = tuple[int, int, int, int, int]


class _Entry:
    """What a committed save left: the file's name, the identities of it and of the files
    it references, and its chunks' bytes by logical offset."""

    def __init__(self, file: str, ids: dict[str, _Ident], chunks: dict[int, np.ndarray], nbytes: int) -> None:
        self.file, self.ids, self.chunks, self.nbytes = file, ids, chunks, nbytes


def _ident(path: str) -> _Ident | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Keeper:
    """The kept chunks of one save: those of the save before (``prior``, taken from
    ``owner``) and those it keeps for the next (``chunks``), at most ``room`` bytes."""

    def __init__(self, owner: KeptBytes, folder: str, prior: dict[int, np.ndarray], room: int) -> None:
        self.owner, self.folder, self.prior, self.room = owner, folder, prior, room
        self.chunks: dict[int, np.ndarray] = {}
        self.nbytes = 0

    def old(self, loff: int, length: int) -> np.ndarray | None:
        """The base's bytes of its chunk at logical ``loff`` when kept (``length`` bytes);
        the buffer is this save's from now on (see :meth:`keep`)."""
        buf = self.prior.pop(loff, None)
        return buf if buf is not None and len(buf) == length else None

    def keep(self, loff: int, data: memoryview, buf: np.ndarray | None = None,
             changed: np.ndarray | None = None, unit: int = 0) -> None:
        """Keep ``data``, the bytes of this save's chunk at logical ``loff``: in ``buf`` (a
        buffer from :meth:`old`) when given, else in a new one when there is room. With
        ``changed`` (a flag per ``unit`` bytes), ``buf`` already holds ``data`` wherever the
        flag is off: only the flagged units are copied."""
        n = data.nbytes
        if buf is None:
            if self.nbytes + n > self.room:
                return
            buf = np.empty(n, dtype=np.uint8)
            changed = None
        new = np.frombuffer(data, dtype=np.uint8)
        if changed is None:
            np.copyto(buf, new)
        else:
            whole = n // unit
            rows = np.flatnonzero(changed[:whole])
            if len(rows):
                buf[: whole * unit].reshape(whole, unit)[rows] = new[: whole * unit].reshape(whole, unit)[rows]
            if whole < len(changed) and changed[whole]:
                buf[whole * unit:] = new[whole * unit:]
        self.chunks[loff] = buf
        self.nbytes += n

    def commit(self, path: str, refs: Iterable[str]) -> None:
        """The save of ``path`` (taking bytes from the files ``refs`` of the same folder)
        committed: its chunks are the folder's kept bytes, with the files' identities."""
        ids: dict[str, _Ident] = {}
        for name in [os.path.basename(path), *refs]:
            ident = _ident(os.path.join(self.folder, name))
            if ident is None:
                return
            ids[name] = ident
        with self.owner.lock:
            self.owner.entry = _Entry(os.path.basename(path), ids, self.chunks, self.nbytes)


class KeptBytes:
    """The kept bytes of the last save committed in one folder (module doc)."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = knobs.get().kept_bytes if budget is None else int(budget)
        self.lock = threading.Lock()
        self.entry: _Entry | None = None

    def take(self, path: str, base: str | None, files: list[str]) -> Keeper:
        """The :class:`Keeper` of a save at ``path`` on ``base`` (a file of the same folder
        that takes bytes from ``files``, itself first; None: no base): with the kept bytes
        when they are that file's and every file's identity is unchanged; none otherwise.
        The kept bytes are taken in any case (the save's own replace them once it commits)."""
        folder = os.path.dirname(os.path.abspath(path))
        with self.lock:
            entry, self.entry = self.entry, None
        if entry is None or base is None:
            return Keeper(self, folder, {}, self.budget)
        if (entry.file != os.path.basename(base) or os.path.dirname(os.path.abspath(base)) != folder
                or set(entry.ids) != set(files)
                or any(_ident(os.path.join(folder, name)) != ident for name, ident in entry.ids.items())):
            logger.debug("Incremental save of %s: the kept bytes of %s do not match %s on disk; reading it",
                         path, entry.file, base)
            return Keeper(self, folder, {}, self.budget)
        return Keeper(self, folder, entry.chunks, self.budget)


#: the kept bytes of the JobRunner's nodes, by (folder, node), in the process that runs a
#: node's saves (a save task crosses to that process without them; see :func:`for_node`)
_NODES: dict[tuple[str, str], KeptBytes] = {}
_nodes_lock = threading.Lock()


def for_node(db: str, node: str) -> KeptBytes:
    """The kept bytes of ``node``'s saves in the folder of the local db ``db``, made on the
    first incremental save of that node in this process (at most the ``kept_bytes`` knob
    each) and held until :func:`release`."""
    key = (os.path.dirname(os.path.abspath(db)), node)
    with _nodes_lock:
        kept = _NODES.get(key)
        if kept is None:
            kept = _NODES[key] = KeptBytes()
        return kept


def release() -> None:
    """Free every node's kept bytes in this process (a JobRunner's ``train`` ended: its next
    run's first saves read their base)."""
    with _nodes_lock:
        _NODES.clear()
