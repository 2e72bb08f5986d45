"""The exceptions epochal raises. Every one names the thing at fault (file, blob, node, epoch)."""

from __future__ import annotations


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


class NodeLostError(CheckpointError):
    """A node's process or machine was lost mid-run, and the node's workspace with it.

    ``node`` is the node at fault, ``nodes`` every node found lost at the same time (``node``
    first); ``epoch`` is the last committed epoch when the raiser knows it (None otherwise).
    """

    def __init__(self, node: str, message: str, *, nodes: list[str] | None = None,
                 epoch: int | None = None) -> None:
        self.node = str(node)
        self.nodes = [self.node, *(str(n) for n in (nodes or []) if str(n) != self.node)]
        self.epoch = epoch
        others = f" (lost too: {', '.join(self.nodes[1:])})" if len(self.nodes) > 1 else ""
        last = f"; last committed epoch: {epoch}" if epoch is not None else ""
        super().__init__(f"node {self.node!r} was lost: {message}{others}{last}")


class Preempted(Exception):
    """Raised by ``JobRunner.train(raise_on_preempt=True)`` after a signal stopped training.

    ``epoch`` is the last epoch that was run and committed.
    """

    def __init__(self, epoch: int, signum: int) -> None:
        self.epoch = epoch
        self.signum = signum
        super().__init__(f"training preempted by signal {signum} after epoch {epoch}")
