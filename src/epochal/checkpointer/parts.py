"""The Checkpointer's small parts: what a restore reports, the check of a state's names, the
engine's events to the display, a background save's handle, and "step" for "epoch" in errors."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.engine import Results
from ..checkpoint.tasks.background import BackgroundSaver
from ..checkpoint.tasks.steps import INTERNAL_PREFIX, JoinSave, SnapshotAndSave
from ..errors import CheckpointError, MissingMetricError, UnsupportedBlobError
from ..jobs.events import CheckpointEvent, RunListener

__all__ = ["DB_TYPE", "NODE", "RestoreReport"]

#: the node name of a Checkpointer's dbs (``<directory>/local.<step>``)
NODE = "local"
DB_TYPE = "native"


def check_ranked(policy: Any, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None) -> None:
    """With ``keep_best`` (``policy``: the handler's retention), metrics given must hold the
    metric (or ``state`` a scalar of it): refused before anything is written, naming the
    metric and the keys given (a typo in ``metric=`` would otherwise keep no best, silently).
    A save without metrics (``metrics=None``: a run that evaluates less often than it saves)
    is unranked: kept or deleted by ``keep_last``, never counted among the best."""
    if policy.keep_best is None or not policy.metric or not metrics:
        return
    if policy.metric in metrics or policy.metric in state:
        return
    given = ", ".join(sorted(map(repr, map(str, metrics))))
    keys = ", ".join(sorted(map(repr, map(str, state))))
    raise MissingMetricError(
        f"keep_best ranks by metric {policy.metric!r}, but the save of step {step} has no value "
        f"of it: metrics given: {given}; state keys: {keys}")


def _check_state(state: Mapping[str, Any], what: str) -> list[str]:
    """The names of ``state`` (str keys, not epochal's own), with a hint for a plain DataLoader."""
    if not isinstance(state, Mapping) or not state:
        raise ValueError(f"{what} needs a non-empty dict of name -> object, got {state!r}")
    names = []
    for name, value in state.items():
        if not isinstance(name, str) or not name or name.startswith(INTERNAL_PREFIX):
            raise ValueError(f"{what}: state key {name!r} must be a non-empty str (not {INTERNAL_PREFIX!r}...)")
        t = type(value)
        if t.__name__ == "DataLoader" and t.__module__.startswith("torch.") and not hasattr(value, "state_dict"):
            raise UnsupportedBlobError(
                f"state[{name!r}] is a torch DataLoader, which has no state to save: put its sampler "
                "in the state instead (epochal.integrations.torch.ResumableSampler), or use "
                "torchdata's StatefulDataLoader (see docs/pytorch.md)"
            )
        names.append(name)
    return names


@dataclass(frozen=True)
class RestoreReport:
    """What the last :meth:`Checkpointer.restore` did: the ``step`` restored (None: a fresh
    start), the ``seconds`` it took, and with ``strict=False`` the keys that were not
    restored, per entry of the state (as torch's ``_IncompatibleKeys``): ``missing_keys``
    (live keys the checkpoint lacks: they keep their values), ``unexpected_keys`` (the
    checkpoint's keys the live object lacks). ``missing_blobs``: entries of the state the
    checkpoint lacks (they keep their values). ``source``: where the bytes came from:
    ``"local"`` (the node-local tier, ``local=``), ``"peer"`` (a peer's copy of this rank's
    part), ``"durable"`` (the Checkpointer's directory); None on a fresh start."""

    step: int | None
    seconds: float
    missing_keys: dict[str, list[str]] = field(default_factory=dict)
    unexpected_keys: dict[str, list[str]] = field(default_factory=dict)
    missing_blobs: list[str] = field(default_factory=list)
    source: str | None = None


class _Shown:
    """The engine's events to the terminal display (:func:`~epochal.jobs.events.auto_progress`):
    a bar while a big save or load moves its bytes, one line when it ends."""

    def __init__(self, display: RunListener) -> None:
        self.display = display

    def checkpoint_start(self, action: str, epoch: int) -> None:
        self.display.on_checkpoint_start(action, epoch)

    def checkpoint_end(self, action: str, epoch: int, seconds: float, nbytes: int, ok: bool,
                       error: str | None) -> None:
        self.display.on_checkpoint(CheckpointEvent(action, epoch, seconds, nbytes, ok, error))


class _Background:
    """A background save of the Checkpointer (the engine's SaveHandle): the snapshot is taken
    when it is made; :meth:`join` waits for the write."""

    def __init__(self, snapshot: SnapshotAndSave, state: Mapping[str, Any], saver: BackgroundSaver) -> None:
        snapshot.run(state)
        self.joiner = JoinSave(snapshot.db, "", "", db_type=DB_TYPE, saver=saver,
                               storage_options=snapshot.location.storage_options or None)

    def join(self) -> Results:
        return {NODE: self.joiner.join()}


_EPOCH_N = re.compile(r"\b([Ee])poch(s?)(?= \d)")


@contextmanager
def _in_steps() -> Iterator[None]:
    """Say "step" where the layers below say "epoch <n>" in a CheckpointError (same type,
    same attributes; the original is the cause)."""
    try:
        yield
    except CheckpointError as ex:
        text = _EPOCH_N.sub(lambda m: ("S" if m.group(1) == "E" else "s") + "tep" + m.group(2), str(ex))
        if text == str(ex):
            raise
        raise _reworded(ex, text) from ex


def _reworded(ex: CheckpointError, text: str) -> CheckpointError:
    """``ex`` (same type and attributes) saying ``text``."""
    new = type(ex).__new__(type(ex))
    new.__dict__.update(ex.__dict__)
    new.args = (text,)
    return new
