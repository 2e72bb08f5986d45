"""Retention: which committed checkpoints to delete after a commit (pure functions).

The policy has three knobs and two absolute protections:

* ``keep_last=N`` keeps the N newest committed epochs;
* ``keep_every=K`` keeps every epoch that is a multiple of K (0, K, 2K, ...) forever;
* ``keep_best=B`` (with ``metric`` and ``mode``) keeps the B epochs with the best value of
  ``metric`` (``"min"``: lowest, ``"max"``: highest), as recorded in their manifests;
* the newest committed epoch, pinned epochs and any ``protect``-ed epoch (one being written)
  are never deleted, whatever the policy says.

An epoch is kept when any knob keeps it (the union). With no knob set nothing is deleted (the
default keeps every epoch). For ``keep_best``, an epoch recorded without a value of the metric
(None, NaN, or missing from its manifest) is never among the best; an epoch whose record is
not known at all (absent from ``metrics``, e.g. one only a mirror holds) is kept, since it
cannot be ranked. Ties go to the older epoch, so the set of the B best never changes except
when a strictly better epoch arrives: over a resumed run it is exactly the B best of all.
Deleting is the caller's job (:mod:`epochal.checkpoint.handler.cleanup`): the manifest first, then
the dbs, so an interrupted delete never leaves a manifest that names missing files.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MODES = ("min", "max")


@dataclass(frozen=True)
class RetentionPolicy:
    """``keep_last``: keep the N newest committed epochs (None: no limit); ``keep_every``: keep
    the multiples of K forever (None: none); ``keep_best``: keep the B best epochs by
    ``metric`` under ``mode`` (None: none). All None: keep everything."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.keep_best is not None and (not isinstance(self.metric, str) or not self.metric):
            raise ValueError(f"keep_best={self.keep_best} needs metric= (the name of the value to rank by)")

    @property
    def keeps_everything(self) -> bool:
        """True when the policy never deletes anything."""
        return self.keep_last is None and self.keep_every is None and self.keep_best is None


def metric_value(value: object) -> float | None:
    """``value`` as a rankable float: None for None, bools, non-numbers and NaN."""
    if value is None or isinstance(value, bool):
        return None
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return None if math.isnan(x) else x


def metric_unreadable(value: object) -> bool:
    """True for a recorded metric that no float holds (an int beyond about 1.8e308, written by
    an older epochal): it cannot be ranked, and tools show it as unreadable."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    try:
        float(value)
    except OverflowError:
        return True
    return False


def best_epochs(metrics: Mapping[int, object], k: int, mode: str = "min") -> list[int]:
    """The ``k`` epochs of ``metrics`` (``{epoch: value}``) with the best values, best first;
    epochs without a rankable value are left out; ties go to the older epoch."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    ranked = [(v, int(e)) for e, raw in metrics.items() if (v := metric_value(raw)) is not None]
    sign = 1.0 if mode == "min" else -1.0
    ranked.sort(key=lambda ve: (sign * ve[0], ve[1]))
    return [e for _, e in ranked[:k]]


def epochs_to_delete(
    committed: Iterable[int],
    newest: int | None,
    pins: Iterable[int],
    policy: RetentionPolicy,
    protect: Iterable[int] = (),
    metrics: Mapping[int, object] | None = None,
) -> list[int]:
    """The committed epochs that ``policy`` drops, oldest first.

    ``committed``: every committed epoch; ``newest``: the newest committed epoch (never
    deleted; when None the maximum of ``committed`` is used); ``pins``: pinned epochs;
    ``protect``: epochs that must survive for another reason (e.g. one being written);
    ``metrics``: ``{epoch: value of policy.metric}`` for ``keep_best`` (see the module doc:
    committed epochs absent from it are kept).
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
    if policy.keep_best is not None:
        known = {int(e): v for e, v in (metrics or {}).items()}
        keep.update(e for e in epochs if e not in known)
        keep.update(best_epochs({e: known[e] for e in epochs if e in known}, policy.keep_best, policy.mode))
    return [e for e in epochs if e not in keep]
