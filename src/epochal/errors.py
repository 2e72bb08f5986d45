"""The exceptions epochal raises. Every one names the thing at fault (file, blob, node, epoch)."""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Base class of every checkpoint problem epochal reports."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint (db file, epoch or manifest) that was asked for does not exist."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file fails a check: truncated, bit-flipped, absurd lengths, unknown dtype.

    ``path`` is the file and ``blob`` the blob at fault (None when the damage is in the header).
    """

    def __init__(self, path: str, message: str, blob: str | None = None) -> None:
        self.path = str(path)
        self.blob = blob
        where = f"{self.path}" + (f", blob {blob!r}" if blob is not None else "")
        super().__init__(f"{where}: {message}")
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:  # picklable (torch.distributed gathers errors)
        return (type(self), (self.path, self.message, self.blob))


class CheckpointVersionError(CheckpointCorruptError):
    """The file was written by a newer, incompatible format version."""


class MissingBlobError(CheckpointError, KeyError):
    """A blob that was asked for is not in the checkpoint or the workspace."""

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class UnsupportedBlobError(CheckpointError, TypeError):
    """A value that no format can store without pickle."""


class BlobMismatchError(CheckpointError, ValueError):
    """A saved blob does not fit the live object it is restored into (shape, dtype, keys)."""


class MissingMetricError(CheckpointError, ValueError):
    """A save gave metrics, but not the one ``keep_best`` ranks by (a typo in ``metric=`` or
    in the metrics' keys would otherwise keep no best, silently). A save with no metrics at
    all is unranked, not an error."""


class NodeLostError(CheckpointError):
    """A node's process or machine was lost mid-run, and the node's workspace with it.

    ``node`` is the node at fault, ``nodes`` every node found lost at the same time (``node``
    first); ``epoch`` is the last committed epoch when the raiser knows it (None otherwise);
    ``reason`` what was seen.
    """

    def __init__(self, node: str, message: str, *, nodes: list[str] | None = None,
                 epoch: int | None = None) -> None:
        self.node = str(node)
        self.nodes = [self.node, *(str(n) for n in (nodes or []) if str(n) != self.node)]
        self.epoch = epoch
        self.reason = message
        others = f" (lost too: {', '.join(self.nodes[1:])})" if len(self.nodes) > 1 else ""
        last = f"; last committed epoch: {epoch}" if epoch is not None else ""
        super().__init__(f"node {self.node!r} was lost: {message}{others}{last}")


class CheckpointLockedError(CheckpointError):
    """Another live process holds the checkpoint directory's writer lock.

    ``path`` is the lock file; ``holder`` what it says of its holder (host, pid, since);
    ``by``: the object of this same process that holds it (and where it was taken), when it
    is this process.
    """

    def __init__(self, path: str, holder: dict[str, object], *, by: str | None = None) -> None:
        self.path = str(path)
        self.holder = dict(holder)
        self.by = by
        who = ", ".join(f"{k} {holder[k]}" for k in ("host", "pid", "since", "expires") if k in holder)
        if by is not None:  # a second lock in the holder's own process
            super().__init__(
                f"{self.path}: already held by this process ({who}), by {by}; close that one first "
                "(Checkpointer.close(), or the end of its train()), or use another directory"
            )
            return
        super().__init__(
            f"{self.path}: another job is writing checkpoints in this directory ({who or 'holder unknown'}); "
            "stop it first, or use another directory"
        )


class Preempted(Exception):
    """Raised by ``JobRunner.train()`` (unless ``raise_on_preempt=False``) after a signal
    stopped training, once the epoch in progress is committed.

    ``epoch`` is the last epoch run; ``committed`` the newest committed epoch (None when none
    is); ``signum`` the signal; ``where`` the checkpoint location. Uncaught, it makes the
    script exit non-zero, so a scheduler (Kubernetes, Slurm) restarts the job instead of
    counting it as complete; ``exit_code`` (128 + signum) is the conventional status.
    """

    def __init__(self, epoch: int, signum: int, committed: int | None = None, where: str | None = None) -> None:
        import signal as _signal

        self.epoch = epoch
        self.signum = signum
        self.committed = committed
        self.where = where
        try:
            name = _signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        place = f" in {where}" if where else ""
        if committed is None:
            state = f"no epoch is committed{place}: rerunning starts the job anew"
        else:
            state = (f"epoch {committed} is committed{place}: run the same script again to resume "
                     "from it")
        super().__init__(f"training preempted by {name} after epoch {epoch}; {state}")

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)
