"""What of a DistributedCheckpointer's ``state`` goes to DCP, under which key, and how each
loaded entry gets back into the live object.

* ``nn.Module`` (plain, DDP, FSDP2, ``torch.compile``d) and optimizers: through
  ``torch.distributed.checkpoint.state_dict``'s ``get_*_state_dict``/``set_*_state_dict``
  (parameters matched by FQN whatever the wrapper; an optimizer is paired with the module
  of ``state`` holding its parameters);
* tensors and DTensors: as they are (loaded in place);
* other stateful objects and plain values: one :class:`~epochal.integrations.dcp.Whole` item
  each (epochal's codecs);
* per-rank values (the types of :data:`PER_RANK_TYPES` and the names the caller lists): under
  ``__rank<r>__/<name>``, each rank's own.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, cast

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ...checkpoint.tasks.steps import INTERNAL_PREFIX
from ...errors import CheckpointError
from ..dcp import Whole

__all__ = ["PER_RANK_TYPES", "dcp_state", "rank_key"]

logger = logging.getLogger("epochal")

#: type names whose objects are per rank by default (data positions and RNG)
PER_RANK_TYPES = ("RNGState", "ResumableSampler", "StatefulDataLoader", "DistributedSampler")


def rank_key(rank: int, name: str) -> str:
    """The DCP key of rank ``rank``'s own value ``name``."""
    return f"__rank{int(rank)}__/{name}"


def _stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def dcp_state(state: Mapping[str, Any], rank: int, per_rank: set[str], saved: set[str] | None, where: str
              ) -> tuple[dict[str, Any], dict[str, Callable[[Any], Any]]]:
    """The state dict DCP saves or loads into for rank ``rank``, and (for a load) what to do
    with each loaded entry, by key. ``saved``: the keys of the step being loaded (None: a
    save); entries it lacks are skipped with a warning naming them and ``where``."""
    if not isinstance(state, Mapping) or not state:
        raise ValueError(f"state must be a non-empty dict of name -> object, got {state!r}")
    modules = {n: v for n, v in state.items() if isinstance(v, torch.nn.Module)}
    sd: dict[str, Any] = {}
    after: dict[str, Callable[[Any], Any]] = {}
    skipped: list[str] = []
    for name, value in state.items():
        if not isinstance(name, str) or not name or name.startswith((INTERNAL_PREFIX, "__")):
            raise ValueError(f"state key {name!r} must be a non-empty str not starting with '__'")
        own = name in per_rank or type(value).__name__ in PER_RANK_TYPES
        key = rank_key(rank, name) if own else name
        if saved is not None and key not in saved and not any(k.startswith(key + ".") for k in saved):
            skipped.append(name)
            continue
        if isinstance(value, torch.nn.Module):
            sd[key] = get_model_state_dict(value)
            after[key] = functools.partial(set_model_state_dict, value)
        elif isinstance(value, torch.optim.Optimizer):
            owner = _owner(name, value, modules)
            sd[key] = get_optimizer_state_dict(owner, value)
            after[key] = functools.partial(set_optimizer_state_dict, owner, value)
        elif isinstance(value, torch.Tensor):
            sd[key] = value  # DTensor or plain: loaded in place
        elif _stateful(value):
            sd[key] = Whole(value.state_dict() if saved is None else None)
            after[key] = value.load_state_dict
        else:
            sd[key] = Whole(value)
            after[key] = functools.partial(cast(MutableMapping[str, Any], state).__setitem__, name)
    if skipped:
        logger.warning("The step in %s has no %s for rank %d: they keep their current values "
                       "(per-rank values are restored only at the world size they were saved with)",
                       where, ", ".join(map(repr, skipped)), rank)
    return sd, after


def _owner(name: str, opt: torch.optim.Optimizer, modules: Mapping[str, torch.nn.Module]) -> torch.nn.Module:
    """The module of ``state`` whose parameters ``opt`` updates (FQNs come from it)."""
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    for m in modules.values():
        if any(id(p) in ids for p in m.parameters()):
            return m
    raise CheckpointError(f"state[{name!r}]: an optimizer is saved by parameter name, which needs the "
                          "module holding its parameters in the state too")
