"""DCP save plans kept from one save to the next of a state of the same structure.

A DCP save plans collectively before it writes: every rank makes its local plan (the items
it holds), the coordinator gathers them (pickled object collectives), dedups replicated
items, builds the global metadata and scatters each rank's final plan; after the writes it
gathers every rank's write results. A training state's structure (its FQNs, shapes, dtypes,
shardings) is the same from save to save, so all of that gives the same answer each time.
On a background save those collectives are most of what blocks the training loop.

:class:`SavePlanCache` keeps this rank's local and final plan of the last full DCP save and,
on the coordinator, DCP's global metadata and every rank's write results. At the next save
each rank makes its local plan again (no collective) and compares it with the kept one; the
ranks agree on "nothing changed anywhere" in one small all-reduce (the caller's), and then
each rank writes its kept final plan for the new step (:meth:`SavePlanCache.write`) and the
coordinator commits with the kept metadata, its write results pointed at the new step's dbs
(whose sizes and digests are read from the files). When anything changed on any rank, the
save goes through DCP in full and the plans kept are replaced. DCP's own
``DefaultSavePlanner(enable_plan_caching=True)`` still runs its object collectives on every
save (with empty plans) and keeps its cache in class attributes shared by every planner in
the process; this one is per Checkpointer and has no collective of its own.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ...checkpoint.location.naming import db_token, split_db_file
from ...checkpoint.location.view import CheckpointDirectory
from ...errors import CheckpointError
from .planners import EpochalSavePlanner
from .storage import EpochalStorageWriter, Target, Written, rank_node

__all__ = ["RecordingSavePlanner", "SavePlanCache"]


class RecordingSavePlanner(EpochalSavePlanner):
    """:class:`EpochalSavePlanner` that keeps the local plan it made and the final plan DCP
    handed it (:attr:`local`, :attr:`final`)."""

    local: SavePlan | None = None
    final: SavePlan | None = None

    def create_local_plan(self) -> SavePlan:
        self.local = super().create_local_plan()
        return self.local

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.final = super().finish_plan(new_plan)
        return self.final


def same_plan(a: SavePlan, b: SavePlan) -> bool:
    """Whether two local plans hold the same items (index, type, chunk, properties, sizes)
    and the same flattening of the state dict."""
    return a.items == b.items and a.planner_data == b.planner_data


@dataclasses.dataclass
class _Kept:
    local: SavePlan
    final: SavePlan
    finished: tuple[Metadata, list[list[WriteResult]]] | None  # the coordinator's


class SavePlanCache:
    """This rank's plans of the last full DCP save (see the module doc). Counters for
    tests and benches: :attr:`hits` (saves that reused them), :attr:`misses`."""

    def __init__(self) -> None:
        self._kept: _Kept | None = None
        self.hits = 0
        self.misses = 0

    def planner(self, state_dict: dict[str, Any], is_coordinator: bool) -> tuple[RecordingSavePlanner, bool]:
        """A planner set up on ``state_dict`` with its local plan made, and whether that plan
        is the kept one (this rank's answer; the caller agrees it with the other ranks)."""
        planner = RecordingSavePlanner()
        planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=is_coordinator)
        plan = planner.create_local_plan()
        kept = self._kept
        same = kept is not None and (kept.finished is not None or not is_coordinator) and same_plan(plan, kept.local)
        return planner, same

    def record(self, planner: RecordingSavePlanner, writer: EpochalStorageWriter) -> None:
        """Keep the plans of a full DCP save that wrote every rank's data (``planner`` and
        ``writer`` were the save's)."""
        if planner.local is None or planner.final is None:
            self._kept = None
            return
        self._kept = _Kept(planner.local, planner.final, writer.finished if writer.is_coordinator else None)
        self.misses += 1

    def forget(self) -> None:
        """Drop the kept plans (the next save plans in full)."""
        self._kept = None

    def write(self, planner: RecordingSavePlanner, writer: EpochalStorageWriter, step: int, rank: int) -> None:
        """This rank's part of a save of ``step`` with the kept plans (every rank agreed they
        hold): write_data of the kept final plan (a snapshot when ``writer`` is deferred)."""
        kept = self._kept
        if kept is None:
            raise CheckpointError("SavePlanCache.write: no plans kept")
        writer.set_up_storage_writer(rank == 0)
        writer.prepare_local_plan(kept.local)
        token = getattr(kept.final.storage_data, "token", None)  # the full save's (a URL's names)
        final = planner.finish_plan(dataclasses.replace(kept.final, storage_data=Target(step, rank_node(rank), token)))
        writer.write_data(final, planner).wait()
        self.hits += 1

    def finish(self, writer: EpochalStorageWriter, step: int) -> None:
        """On the coordinator, once every rank's :meth:`write` returned: ``writer.finish``
        with the kept metadata and every rank's kept write results pointed at ``step``'s dbs
        (a sync writer commits the step there; a deferred one keeps it for its commit)."""
        kept = self._kept
        if kept is None or kept.finished is None:
            return
        metadata, results = kept.finished
        writer.finish(dataclasses.replace(metadata), [[_for_step(r, writer.path, step) for r in rs] for rs in results])


def _for_step(result: WriteResult, path: str, step: int) -> WriteResult:
    """A kept write result pointed at ``step``'s db of the same rank; its size and digest
    are read from the file at the commit."""
    w = result.storage_data
    if not isinstance(w, Written):
        raise CheckpointError(f"SavePlanCache: a kept write result of {result.index.fqn!r} is not epochal's")
    node = (split_db_file(w.location.db) or ("", -1))[0]
    db = os.path.basename(CheckpointDirectory(path).token_db_path(node, step, db_token(w.location.db)))
    return dataclasses.replace(result, storage_data=Written(dataclasses.replace(w.location, db=db), None))
