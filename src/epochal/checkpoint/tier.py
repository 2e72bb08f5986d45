"""A local tier's directory, and the restore that takes a step from the nearest intact place.

Both doors have a local tier (docs/tiers.md): ``Checkpointer(path, local=DIR, persist_every=K)``
(:mod:`epochal.checkpointer.tier`) and ``JobRunner(job, manager, local=DIR, persist_every=K)``
(:mod:`epochal.jobs.tier`). Every save goes to DIR, a node-local directory (RAM-backed, such as
``/dev/shm/run``: it survives the death of the process, not of the machine), kept as an
ordinary epochal location — the native format, CRC-32C on every byte, a committed manifest,
its own writer lock and retention (``keep_last=local_keep``) — so ``epochal ls``/``verify``
read it like any other; some saves also go to the store. What both share is here:
:class:`LocalPlace` (the directory, its handler and engine) and the restore order
(:func:`restore_order`, :func:`try_sources`): every (step, place) newest step first, the local
copy first; a damaged copy is named in a warning and the next one is tried.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from ..storage.io.seam import is_url, local_path
from .engine import CheckpointEngine, EngineEvents
from .handler.directory import DirectoryMetadataHandler
from .tasks.handler_calls import HandlerLink

__all__ = ["LocalPlace", "Source", "check_args", "restore_order", "try_sources"]

logger = logging.getLogger("epochal")


def check_args(directory: str | os.PathLike[str], keep: int, persist_every: int | None) -> str:
    """The local directory's path; ValueError naming the argument at fault (before anything opens)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"local_keep must be an int >= 1, got {keep!r}")
    if persist_every is not None and (isinstance(persist_every, bool) or not isinstance(persist_every, int)
                                      or persist_every < 1):
        raise ValueError(f"persist_every must be an int >= 1 or None, got {persist_every!r}")
    path = local_path(directory)
    if is_url(path):
        raise ValueError(f"local={path!r}: the local tier is a directory of this machine, not a URL")
    return path


@dataclass(frozen=True)
class Source:
    """A place a step can be restored from: its name (``"local"``, ``"durable"``), its
    handler (which steps are committed, and their checks), its engine (the load), the db(s)
    of a step there (for messages) and, for the runner's managers, the ``path_prefix`` its dbs
    are read with (None: the manager's own directory)."""

    name: str
    handler: DirectoryMetadataHandler
    engine: CheckpointEngine
    db_path: Callable[[int], str]
    path_prefix: str | None = None


class LocalPlace:
    """The node-local directory of a tier: a :class:`DirectoryMetadataHandler` keeping
    ``keep`` steps of ``nodes`` there and the :class:`CheckpointEngine` that commits them,
    holding the directory's writer lock until :meth:`close`. ``word``, ``max_failed_saves``,
    ``own_error`` and ``events`` are the door's (see :class:`CheckpointEngine`)."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int, persist_every: int | None, db_type: str,
                 nodes: list[str], word: str = "step", max_failed_saves: int | None = 1, own_error: bool = True,
                 events: EngineEvents | None = None) -> None:
        self.directory = check_args(directory, keep, persist_every)
        os.makedirs(self.directory, exist_ok=True)
        self.persist_every = persist_every
        self.nodes = list(nodes)
        self.handler = DirectoryMetadataHandler(keep_last=keep)
        self.handler.set_params(db_prefix=self.directory, db_type=db_type, node_names=self.nodes,
                                path_prefix=None, path_type=None)
        assert self.handler.directory is not None
        self._dir = self.handler.directory
        self.engine = CheckpointEngine(HandlerLink(self.handler, self.directory, db_type, self.nodes),
                                       max_failed_saves=max_failed_saves, word=word, own_error=own_error,
                                       events=events)
        self.engine.open()  # one writer per local directory, until close()
        #: the seed's ``path_prefix`` a manager reads this place's dbs with (the runner's; None: unused)
        self.path_prefix: str | None = None

    def db_path(self, step: int, node: str | None = None) -> str:
        """The local db of ``node`` (None: the first) at ``step``."""
        return self._dir.db_path(node if node is not None else self.nodes[0], int(step))

    def steps(self) -> list[int]:
        """The steps committed in the local directory, oldest first."""
        return self.handler.committed_epochs()

    def source(self) -> Source:
        """This place as a :class:`Source` (named ``"local"``)."""
        def dbs(step: int) -> str:
            return ", ".join(self.db_path(step, n) for n in self.nodes)

        return Source("local", self.handler, self.engine, dbs, self.path_prefix)

    def restore(self, step: int | None, committed: list[int], durable: Source,
                load: Callable[[Source, int], None]) -> int | None:
        """Load the newest step intact in either place (``step``: that one), the local copy
        first; None when neither holds a step. ``committed``: the steps of both, for errors."""
        order = restore_order([self.source(), durable])
        if step is not None:
            order = [(s, src) for s, src in order if s == step]
            if not order:
                raise CheckpointNotFoundError(
                    f"step {step} is committed neither in {self.directory} nor in {durable.db_path(step)} "
                    f"(committed steps: {', '.join(map(str, committed)) or 'none'})")
        found = try_sources(order, load)
        if found is None:
            return None
        self.engine.last_committed = found[0]
        return found[0]

    def close(self, *, flush: bool = True) -> None:
        """Let the local directory's writer lock go."""
        self.engine.close(flush=flush)


def restore_order(sources: list[Source]) -> list[tuple[int, Source]]:
    """Every (step, source) to try, newest step first, the nearer source first for a step."""
    held: dict[int, list[Source]] = {}
    for src in sources:
        for step in src.handler.committed_epochs():
            held.setdefault(step, []).append(src)
    return [(step, src) for step in sorted(held, reverse=True) for src in held[step]]


def try_sources(order: list[tuple[int, Source]], load: Callable[[Source, int], Any]) -> tuple[int, Source] | None:
    """Load the first (step, source) of ``order`` that is intact; a damaged copy is named in a
    warning and the next one tried. None when ``order`` is empty; the last error when every
    copy is damaged."""
    last: Exception | None = None
    for i, (step, src) in enumerate(order):
        try:
            src.handler.resume_epoch(step)  # its dbs against its manifest (size, digest)
            load(src, step)
        except (CheckpointCorruptError, CheckpointNotFoundError) as ex:
            after = f"the {order[i + 1][1].name} copy of step {order[i + 1][0]}" if i + 1 < len(order) else "none"
            logger.warning("The %s copy of step %d (%s) is damaged: %s; restoring from %s instead", src.name,
                           step, src.db_path(step), ex, after)
            last = ex
            continue
        return step, src
    if last is not None:
        raise last
    return None
