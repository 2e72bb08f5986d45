"""How the ranks of a DistributedCheckpointer agree: small collectives on int64 tensors.

Every decision the ranks must share (did any rank fail, which step to resume, is a save due,
did the state's structure change) is one ``all_reduce(MAX)`` or ``broadcast`` of a few
integers on a gloo group (the default group when it is gloo, else one of the caller's): no
object collective, nothing pickled. :class:`RankGroup` holds the group and this rank's place
in it; without a process group (one process) every collective is the identity.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointCorruptError, CheckpointError

__all__ = ["TOLD", "RankGroup", "failure_code", "process_world", "unwrap_failure"]

#: how many bytes of a failed rank's error the other ranks are told
TOLD = 1024


def _released(t: torch.Tensor, base: int) -> None:
    """Wait (the GIL released, at most a second) until the collective's worker thread has let
    ``t`` go. torch keeps a reference to a tensor's Python object while C++ holds the tensor,
    and gloo's worker drops its hold just after the collective returns: if the interpreter is
    already exiting by then (a collective at ``close`` right before the script ends), that
    worker cannot take the GIL to drop it and the process aborts ("terminate called without
    an active exception", exit -6, seen under load). ``base``: ``sys.getrefcount(t)`` in the
    caller before the collective. (Here ``t`` has one reference more than there: this
    function's own argument. Without counting it every collective waited the whole second.)"""
    deadline = time.monotonic() + 1.0
    while sys.getrefcount(t) - 1 > base and time.monotonic() < deadline:
        time.sleep(0.0002)


def process_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def failure_code(problem: BaseException | None) -> int:
    """0: no failure; 1: damaged data (CheckpointCorruptError: the caller may fall back); 2: any
    other failure."""
    return 0 if problem is None else (1 if isinstance(problem, CheckpointCorruptError) else 2)


def unwrap_failure(ex: BaseException, what: str) -> BaseException:
    """The exception behind a CheckpointException (DCP wraps each rank's): this rank's own
    when it failed; else the first failed rank's, as a CheckpointError naming that rank (a
    CheckpointCorruptError, which names its file and blob, stays one)."""
    if not isinstance(ex, CheckpointException) or not ex.failures:
        return ex
    rank = process_world()[0]
    if rank in ex.failures:
        exc = ex.failures[rank][0]
        return exc if isinstance(exc, BaseException) else ex
    other, (exc, _) = next(iter(sorted(ex.failures.items(), key=lambda kv: kv[0])))
    if isinstance(exc, CheckpointCorruptError):
        return exc
    err = CheckpointError(f"rank {other} failed to {what}: {exc!r}")
    err.__cause__ = exc if isinstance(exc, BaseException) else None
    return err


class RankGroup:
    """This process's rank and world in ``group`` (None: the default group; a non-gloo default
    group gets a gloo group of its own for these host-side collectives). ``where`` names the
    checkpoint in the errors raised."""

    def __init__(self, group: Any, where: str) -> None:
        self.where = where
        self.dist = dist.is_available() and dist.is_initialized()
        self.rank, self.world = process_world()
        if self.dist and group is not None:  # ranks of that group
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        if self.dist and group is None and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")

    def fork(self) -> RankGroup:
        """A gloo group of the same ranks, for collectives of another thread (collective:
        every rank creates it at the same point); without a process group, this one."""
        if not self.dist:
            return self
        ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
        return RankGroup(dist.new_group(ranks=ranks, backend="gloo"), self.where)

    def all_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of ``values`` over the ranks (collective)."""
        t = torch.tensor(values, dtype=torch.int64)
        if self.dist:
            base = sys.getrefcount(t)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            _released(t, base)
        return [int(v) for v in t.tolist()]

    def broadcast(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (collective)."""
        t = torch.tensor([value], dtype=torch.int64)
        if self.dist:
            base = sys.getrefcount(t)
            dist.broadcast(t, src=0 if self.group is None else dist.get_global_rank(self.group, 0),
                           group=self.group)
            _released(t, base)
        return int(t.item())

    def slots(self, problem: BaseException | None) -> list[int]:
        """This rank's contribution to :meth:`all_max` for :meth:`settle`: its failure code at
        its own index (``world`` ints)."""
        return [failure_code(problem) if r == self.rank else 0 for r in range(self.world)]

    def settle(self, codes: list[int], problem: BaseException | None, what: str, corrupt_ok: bool = False) -> bool:
        """Act on the all-maxed :meth:`slots` of every rank: nothing failed: False; else this
        rank's own error is raised as it is, and a rank that did not fail raises a
        CheckpointError naming the ranks that did. With ``corrupt_ok``, when every failure is
        a CheckpointCorruptError, return True instead (the caller falls back) on every rank."""
        failed = [r for r, c in enumerate(codes) if c]
        if not failed:
            return False
        if corrupt_ok and all(codes[r] == 1 for r in failed):
            return True
        told = self._tell(problem)  # (every rank: the failed ranks' errors, as text)
        if problem is not None:
            raise problem
        why = "; ".join(f"rank {r} failed to {what}: {told[r]}" for r in failed)
        raise CheckpointError(f"{self.where}: {why}")

    def _tell(self, problem: BaseException | None) -> list[str]:
        """Every rank's ``repr(problem)`` (first :data:`TOLD` bytes; "" for none) on every rank
        (collective): the bytes travel as int64 values in one all-reduce, nothing pickled."""
        t = torch.zeros((self.world, TOLD), dtype=torch.int64)
        if problem is not None:
            raw = repr(problem).encode("utf-8", "backslashreplace")[:TOLD]
            t[self.rank, :len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
        if self.dist:
            base = sys.getrefcount(t)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            _released(t, base)
        return [bytes(int(v) for v in row if v).decode("utf-8", "replace") for row in t.tolist()]

    def agree(self, problem: BaseException | None, what: str, corrupt_ok: bool = False) -> bool:
        """Every rank learns whether any failed at ``what`` (collective; see :meth:`settle`)."""
        return self.settle(self.all_max(self.slots(problem)), problem, what, corrupt_ok)
