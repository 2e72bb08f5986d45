"""The metadata handler protocol: who decides where to resume and records each commit.

JobRunner and the managers call exactly the seed's five methods. A handler may also offer
the optional extensions below; epochal calls them only when present, so a handler with just
the five keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class DbReport:
    """What a node says of the db it just wrote: its size in bytes and its digest (see
    :meth:`epochal.storage.formats.base.DbBackend.digest`; None when the format has none)."""

    size: int
    digest: str | None
    #: the node also uploaded it to the handler's mirror (see ``node_push_target``)
    pushed: bool = False
    #: the db's file name (a base name) when its writer chose it: at a URL it carries the
    #: writer's token (:mod:`epochal.checkpoint.location.naming`); None: ``<node>.<epoch>``
    file: str | None = None


@dataclass(frozen=True)
class PushTarget:
    """Where each node uploads the db it just saved (a handler's mirror): the URL of the
    mirror's root and the fsspec options that reach it."""

    url: str
    storage_options: dict[str, Any]


@runtime_checkable
class MetadataHandler(Protocol):
    """The seed's interface, worked out from how checkpoint.py calls it."""

    def set_params(
        self,
        db_prefix: str,
        db_type: str,
        node_names: list[str],
        path_prefix: str | None,
        path_type: str | None,
    ) -> None:
        """Where checkpoints live (called first, with keywords)."""

    def last_epoch(self, user_epoch: int | None = None) -> int | None:
        """The epoch to resume from (None: start from scratch). Its answer is final."""

    def write(self, epoch: int) -> None:
        """Checkpoint ``epoch`` was saved on every node: commit it."""

    def report(self, action_name: str, stats: dict[str, int]) -> None:
        """``stats`` maps each db path to the nanoseconds its save/load took."""

    def cp_accessible(self, epoch: int | None = None) -> bool:
        """Whether the next checkpoint can be written (falsy: skip the save with a warning)."""


class MetadataHandlerExtensions(Protocol):
    """Optional methods a handler may add (all are looked up with ``getattr``).

    - ``report_bytes(action_name, sizes: dict[str, int])``: bytes per db, called just before
      ``report`` with the same keys.
    - ``expect_final(epoch)``: the stop condition was reached at ``epoch``, which is about to
      be saved (called before its save, so ``write`` can commit it as final in one step and a
      crash between the commit and ``mark_final`` cannot make a rerun run an extra epoch).
    - ``mark_final(epoch)``: the job's stop condition was reached at ``epoch`` (called after
      its ``write``).
    - ``is_final(epoch) -> bool``: ``epoch`` was a finished job's last one; a rerun with no
      explicit resume epoch loads it and runs no further epoch.
    - ``flush()``: wait for work the handler does in the background (a mirror's pushes);
      called when ``train`` ends (normally or with an exception).
    - ``report_dbs(epoch, {node: DbReport})``: size and digest of each node's db of
      ``epoch``, as the nodes reported them (called just before ``write``): a handler can
      commit without opening a node's file (which may be on another machine).
    - ``node_push_target() -> PushTarget | None``: where each node should upload the db it
      saves (a mirror), so that the driver only pushes the manifest; None: nowhere.
    - ``acquire_lock()``: take the exclusive writer lock of the checkpoint location for a run
      (called right after ``set_params``; raises ``CheckpointLockedError`` when another live
      writer holds it); ``release_lock()``: let it go (called when ``train`` ends, always).
    - ``resume_epoch(user_epoch) -> int | None``: ``last_epoch`` for a caller whose load checks
      every checksum of what it reads before any live object is touched, and reports a failure
      with ``reject_epoch``: the handler may check less up front (sizes, digests), so a resume
      reads the checkpoint once, not twice.
    - ``reject_epoch(epoch, reason) -> bool``: the load of ``epoch``, which ``resume_epoch``
      chose, found it damaged (``reason``). True: the handler will not choose it again in this
      run and the caller asks ``resume_epoch`` again (an older epoch, or None); False: the
      caller raises the load's error.
    - ``check_dbs(epoch, nodes)``: before a load of committed ``epoch`` that ``resume_epoch``
      did not choose (a partial load, a recovery reload, an explicit epoch) writes anything,
      each db of ``nodes`` against the size and digest its commit recorded.
    """

    def report_bytes(self, action_name: str, sizes: dict[str, int]) -> None: ...

    def report_dbs(self, epoch: int, dbs: dict[str, DbReport]) -> None: ...

    def node_push_target(self) -> PushTarget | None: ...

    def expect_final(self, epoch: int) -> None: ...

    def mark_final(self, epoch: int) -> None: ...

    def is_final(self, epoch: int) -> bool: ...

    def flush(self) -> None: ...

    def acquire_lock(self) -> None: ...

    def release_lock(self) -> None: ...

    def resume_epoch(self, user_epoch: int | None = None) -> int | None: ...

    def reject_epoch(self, epoch: int, reason: str) -> bool: ...

    def check_dbs(self, epoch: int, nodes: Sequence[str] | None = None) -> None: ...


class BaseMetadataHandler:
    """A handler with every optional extension as a no-op: subclass it and implement the
    seed's five methods (and whichever extensions you need). ``DirectoryMetadataHandler`` is
    one. A handler that is not a subclass is wrapped by :func:`with_extensions`, so callers
    never look methods up themselves."""

    def set_params(self, db_prefix: str, db_type: str, node_names: list[str],
                   path_prefix: str | None, path_type: str | None) -> None:
        raise NotImplementedError

    def last_epoch(self, user_epoch: int | None = None) -> int | None:
        raise NotImplementedError

    def write(self, epoch: int) -> None:
        raise NotImplementedError

    def report(self, action_name: str, stats: dict[str, int]) -> None:
        raise NotImplementedError

    def cp_accessible(self, epoch: int | None = None) -> bool:
        raise NotImplementedError

    # the extensions (see MetadataHandlerExtensions): no-ops
    def report_bytes(self, action_name: str, sizes: dict[str, int]) -> None:
        return None

    def report_dbs(self, epoch: int, dbs: dict[str, DbReport]) -> None:
        return None

    def node_push_target(self) -> PushTarget | None:
        return None

    def expect_final(self, epoch: int) -> None:
        return None

    def mark_final(self, epoch: int) -> None:
        return None

    def is_final(self, epoch: int) -> bool:
        return False

    def flush(self) -> None:
        return None

    def acquire_lock(self) -> None:
        return None

    def release_lock(self) -> None:
        return None

    def location(self) -> str | None:
        """Where the checkpoints are, for messages (None: unknown)."""
        return None

    def resume_epoch(self, user_epoch: int | None = None) -> int | None:
        """The seed's ``last_epoch``: a handler that checks less when the load verifies
        overrides this (see :class:`MetadataHandlerExtensions`)."""
        return self.last_epoch(user_epoch)

    def reject_epoch(self, epoch: int, reason: str) -> bool:
        """No fallback: the load's error stands."""
        return False

    def check_dbs(self, epoch: int, nodes: Sequence[str] | None = None, *, db_prefix: str | None = None) -> None:
        """Before a load of committed ``epoch`` writes anything: each db of ``nodes`` (None:
        all) against what the commit recorded of it, CheckpointCorruptError naming the file
        when it differs. A handler that records nothing checks nothing."""
        return None


class _Extended(BaseMetadataHandler):
    """A five-method (seed) handler seen through the full interface: each extension it has is
    forwarded, each it lacks is the base's no-op."""

    _EXTENSIONS = ("report_bytes", "report_dbs", "node_push_target", "expect_final", "mark_final", "is_final", "flush",
                   "acquire_lock", "release_lock", "location", "resume_epoch", "reject_epoch", "check_dbs")

    def __init__(self, handler: Any) -> None:
        self.handler = handler
        for name in self._EXTENSIONS:
            fn = getattr(handler, name, None)
            if callable(fn):
                setattr(self, name, fn)

    def set_params(self, db_prefix: str, db_type: str, node_names: list[str],
                   path_prefix: str | None, path_type: str | None) -> None:
        self.handler.set_params(db_prefix=db_prefix, db_type=db_type, node_names=node_names,
                                path_prefix=path_prefix, path_type=path_type)

    def last_epoch(self, user_epoch: int | None = None) -> int | None:
        return self.handler.last_epoch(user_epoch=user_epoch)  # type: ignore[no-any-return]

    def write(self, epoch: int) -> None:
        self.handler.write(epoch=epoch)

    def report(self, action_name: str, stats: dict[str, int]) -> None:
        self.handler.report(action_name, stats)

    def cp_accessible(self, epoch: int | None = None) -> bool:
        return self.handler.cp_accessible(epoch)  # type: ignore[no-any-return]


def with_extensions(handler: Any) -> BaseMetadataHandler:
    """``handler`` itself when it is a :class:`BaseMetadataHandler`, else a wrapper that
    gives it the full interface (its own extensions where it has them, no-ops otherwise)."""
    return handler if isinstance(handler, BaseMetadataHandler) else _Extended(handler)


def call_optional(handler: Any, method: str, *args: Any) -> Any:
    """Call ``handler.method(*args)`` if the handler has it; None otherwise."""
    fn = getattr(handler, method, None) if handler is not None else None
    return fn(*args) if callable(fn) else None
