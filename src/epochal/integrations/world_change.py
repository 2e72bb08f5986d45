"""A step written at another world size than the run's: one process's step, on many ranks.

The commonest change of world size is a debug run at world size 1 scaled up under torchrun.
Its steps are a plain Checkpointer's (one db, ``local.<step>``), not DCP's; each rank reads
that db whole into its own live objects (DDP replicas all get the same tensors; a DDP or
``torch.compile`` wrapper is loaded through the module it wraps), after every rank's check
passed, so no rank writes unless all can. Sharded (DTensor) state cannot take a whole tensor
in place: refused, naming the change of rank count and how to convert.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from ..checkpoint.location.view import CheckpointDirectory
from ..checkpoint.tasks.steps import LoadBlobs
from ..errors import CheckpointError
from .ranks import RankGroup

__all__ = ["SINGLE_NODE", "load_one_process_step"]

logger = logging.getLogger("epochal")

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
