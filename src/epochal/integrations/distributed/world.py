"""The world a checkpoint meets: which Checkpointer a process needs (decided without importing
torch), and a step written at another world size than the run's.

:class:`epochal.Checkpointer` asks :func:`use_distributed`: a process of a ``torch.distributed``
group (of any size, one included: FSDP2's DTensors need the group), or one process opening a
directory whose newest step was written by ranks (``epochal.integrations.dcp``'s layout:
``rank<r>.<step>`` and ``dcp.<step>``), gets
:class:`~epochal.integrations.distributed.DistributedCheckpointer`. A rank's SIGTERM is met by
:class:`RankSignalGuard` (a scheduler's signal forwarded twice is one preemption).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

from ...checkpoint.location.view import CheckpointDirectory
from ...checkpoint.tasks.steps import LoadBlobs
from ...errors import CheckpointError
from ...jobs.preemption import SignalGuard
from ...storage.io.seam import is_url

if TYPE_CHECKING:  # (ranks imports torch; this module must not)
    from ..ranks import RankGroup

__all__ = ["SINGLE_NODE", "distributed_world", "load_one_process_step", "process_group_initialized",
           "use_distributed", "written_by_ranks"]

logger = logging.getLogger("epochal")

#: the node of a ranks-written step's DCP metadata db (epochal.integrations.dcp.META_NODE)
META_NODE = "dcp"


def distributed_world() -> int:
    """The world size of an initialized default process group; 1 without one (torch is
    looked at only when the process already imported ``torch.distributed``)."""
    td = sys.modules.get("torch.distributed")
    if td is None or not td.is_available() or not td.is_initialized():
        return 1
    return int(td.get_world_size())


def written_by_ranks(directory: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the newest committed step of ``directory`` (a local one, or a URL reached with
    ``storage_options``) was written by ranks."""
    path = os.fspath(directory)
    if not is_url(path) and not os.path.isdir(path):
        return False
    try:
        d = CheckpointDirectory(path, storage_options=storage_options)
        newest = d.newest_committed()  # the newest manifest alone, not the whole history
        return newest is not None and META_NODE in newest[1].nodes
    except (CheckpointError, OSError, ValueError):
        return False
    except Exception:  # a URL's store failing some other way: the Checkpointer says so itself
        if is_url(path):
            return False
        raise


def process_group_initialized() -> bool:
    """Whether this process is in an initialized default process group (of any size: an FSDP2
    model's DTensor parameters need one even at world size 1)."""
    td = sys.modules.get("torch.distributed")
    return td is not None and td.is_available() and td.is_initialized()


def use_distributed(directory: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """A DistributedCheckpointer is needed for ``directory`` in this process: it is in a
    process group (a world of one included, where DTensor state lives), or the directory's
    newest step was written by ranks."""
    return process_group_initialized() or written_by_ranks(directory, storage_options)


# ---------------------------------------------------------------- one process's step, many ranks
# The commonest change of world size is a debug run at world size 1 scaled up under torchrun.
# Its steps are a plain Checkpointer's (one db, ``local.<step>``), not DCP's; each rank reads
# that db whole into its own live objects (DDP replicas all get the same tensors; a DDP or
# ``torch.compile`` wrapper is loaded through the module it wraps), after every rank's check
# passed, so no rank writes unless all can. Sharded (DTensor) state cannot take a whole tensor
# in place: refused, naming the change of rank count and how to convert.

#: the node of a step one process wrote (a plain Checkpointer's ``local.<step>``)
SINGLE_NODE = "local"


def load_one_process_step(directory: str, step: int, state: MutableMapping[str, Any], ranks: RankGroup,
                          options: dict[str, Any] | None) -> None:
    """Load ``step`` of ``directory``, written by one process, into ``state`` on every rank of
    ``ranks`` (collective; see the module doc)."""
    db = CheckpointDirectory(directory).db_path(SINGLE_NODE, step)
    live = {k: _unwrapped(v) for k, v in state.items()}
    load = LoadBlobs(db, "native", list(live), node=SINGLE_NODE, epoch=step, allow_incomplete=True,
                     storage_options=options, whole=True)
    problem: BaseException | None = None
    try:
        sharded = [k for k, v in live.items() if _has_dtensors(v)]
        if sharded:
            raise CheckpointError(
                f"step {step} of {directory} was written by one process, and this run has {ranks.world} "
                f"ranks with sharded (DTensor) state in {sharded}: load it once at world size 1 and save "
                "it from the sharded run, or restore it into an unsharded model first")
        load.check(live)
    except Exception as ex:
        problem = ex
    ranks.agree(problem, f"check step {step} (written by one process)")
    wrapped = {k for k, v in state.items() if live[k] is not v}
    load.run(live)
    for key, value in live.items():
        if key not in wrapped:  # (a wrapper's module was restored in place)
            state[key] = value
    logger.info("Step %d of %s was written by one process: restored on each of the %d ranks",
                step, directory, ranks.world)


def _unwrapped(value: Any) -> Any:
    """The module a DDP or ``torch.compile`` wrapper holds (the keys one process saved)."""
    for attr in ("module", "_orig_mod"):
        inner = getattr(value, attr, None)
        if inner is not None and hasattr(inner, "state_dict") and type(value).__name__ in (
                "DistributedDataParallel", "OptimizedModule"):
            return _unwrapped(inner)
    return value


def _has_dtensors(value: Any) -> bool:
    params = getattr(value, "parameters", None)
    if not callable(params) or not hasattr(value, "named_parameters"):
        return False
    return any(type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor"
               for p in params())


#: a second SIGTERM this soon after the first is a duplicate delivery, not "stop at once"
DUPLICATE_SECONDS = 5.0


class RankSignalGuard(SignalGuard):
    """SignalGuard for a rank: a second SIGTERM within :data:`DUPLICATE_SECONDS` of the first
    is the same one delivered twice (a scheduler signals every process, and torchrun forwards
    its own to its workers): ignored. A later one still stops at once."""

    _first = 0.0

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.signum is None:
            self._first = now
        elif now - self._first < DUPLICATE_SECONDS:
            logger.info("Received %s again within %ss: the same preemption, already saving",
                        signal.Signals(signum).name, DUPLICATE_SECONDS)
            return
        super()._handle(signum, frame)
