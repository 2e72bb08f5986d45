"""Retention: which committed checkpoints to delete after a commit (a pure function).

The policy has two knobs and two absolute protections:

* ``keep_last=N`` keeps the N newest committed epochs;
* ``keep_every=K`` keeps every epoch that is a multiple of K (0, K, 2K, ...) forever;
* the newest committed epoch, pinned epochs and any ``protect``-ed epoch (one being written)
  are never deleted, whatever the policy says.

With neither knob set nothing is deleted (the default keeps every epoch). With only
``keep_every`` set, the multiples of K and the newest epoch are kept. Deleting is the
caller's job (:mod:`epochal.checkpoint.directory`): the manifest first, then the dbs, so an
interrupted delete never leaves a manifest that names missing files.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RetentionPolicy:
    """``keep_last``: keep the N newest committed epochs (None: no limit); ``keep_every``: keep
    the multiples of K forever (None: none). Both None: keep everything."""

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")

    @property
    def keeps_everything(self) -> bool:
        """True when the policy never deletes anything."""
        return self.keep_last is None and self.keep_every is None


def epochs_to_delete(
    committed: Iterable[int],
    newest: int | None,
    pins: Iterable[int],
    policy: RetentionPolicy,
    protect: Iterable[int] = (),
) -> list[int]:
    """The committed epochs that ``policy`` drops, oldest first.

    ``committed``: every committed epoch; ``newest``: the newest committed epoch (never
    deleted; when None the maximum of ``committed`` is used); ``pins``: pinned epochs;
    ``protect``: epochs that must survive for another reason (e.g. one being written).
    """
    epochs = sorted(set(int(e) for e in committed))
    if policy.keeps_everything or not epochs:
        return []
    keep: set[int] = {int(e) for e in pins} | {int(e) for e in protect}
    keep.add(max(epochs) if newest is None else int(newest))
    if policy.keep_last is not None:
        keep.update(epochs[-policy.keep_last:])
    if policy.keep_every is not None:
        keep.update(e for e in epochs if e % policy.keep_every == 0)
    return [e for e in epochs if e not in keep]
