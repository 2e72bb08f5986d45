"""Metrics of committed epochs, and the best-k epochs of a checkpoint directory.

A manifest may carry ``"metrics"`` (``{"val_loss": 0.31, ...}``: finite numbers, or null for
a value that was NaN or infinite) and, when its handler keeps the best epochs, ``"keep_best"``
(``{"k": 3, "metric": "val_loss", "mode": "min"}``), so tools such as ``epochal ls`` can tell
which epochs are the best without knowing the job's settings (:func:`best_of_directory`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ...errors import CheckpointError, MissingMetricError, UnsupportedBlobError
from ...storage.formats.base import get_db_type
from .manifest import KeepBest, Manifest
from .retention import RetentionPolicy, best_epochs, metric_unreadable, metric_value

logger = logging.getLogger("epochal")


class Manifests(Protocol):
    """Where committed manifests are read (a
    :class:`~epochal.checkpoint.location.view.CheckpointDirectory`)."""

    def committed_epochs(self) -> list[int]: ...

    def read_manifest(self, epoch: int) -> Manifest: ...


def metric_number(name: str, value: Any) -> float | int | None:
    """A metric as JSON can hold it and a float can rank it: an int within a float's range, a
    finite float, or None (None, NaN, infinities: recorded as null, never among the best).
    UnsupportedBlobError naming the metric for anything else: a bool, a str or bytes, a
    non-number, an int no float holds (``10**400``)."""
    if value is None:
        return None
    if isinstance(value, bool) or isinstance(value, (str, bytes, bytearray)):
        raise UnsupportedBlobError(f"metric {name!r} is a {type(value).__name__}, not a number")
    if isinstance(value, int):
        try:
            float(value)
        except OverflowError:
            raise UnsupportedBlobError(
                f"metric {name!r} is an int of {len(str(abs(value)))} digits: no float holds it, so it "
                "cannot be ranked (give a float, or None)"
            ) from None
        return value
    try:
        x = float(value)  # floats, numpy scalars and 0-d arrays, 0-d torch tensors
    except OverflowError:
        raise UnsupportedBlobError(f"metric {name!r} ({type(value).__name__}) is beyond any float") from None
    except (TypeError, ValueError):
        raise UnsupportedBlobError(f"metric {name!r} is a {type(value).__name__}, not a number") from None
    return x if math.isfinite(x) else None


_ABSENT = object()


def _blob_scalar(paths: Sequence[str], db_type: str, name: str) -> Any:
    """The scalar blob ``name`` from the first of ``paths`` that holds it (None when a db could
    not be read; ``_ABSENT`` when every db was read and none holds it)."""
    backend = get_db_type(db_type)
    unread = False
    for path in paths:
        try:
            got = backend.read(path, [name], allow_incomplete=True)
        except (CheckpointError, OSError) as ex:
            logger.warning("Cannot read the metric blob %r from %s: %s", name, path, ex)
            unread = True
            continue
        if name in got:
            return got[name]
    return None if unread else _ABSENT


def collect_metrics(
    policy: RetentionPolicy, metrics: Mapping[str, Any] | None, db_paths: Sequence[str], db_type: str,
    epoch: int | None = None,
) -> dict[str, float | int | None]:
    """The ``metrics`` a manifest records: ``metrics`` as JSON numbers (UnsupportedBlobError
    naming a metric that is none, see :func:`metric_number`), plus the policy's metric from the
    scalar blob of that name in the dbs when ``metrics`` lacks it (a blob that is no number is
    recorded as null, with a warning). A save with no metrics and no such blob is unranked
    (null: never among the best, kept or deleted by ``keep_last``/``keep_every``). With
    ``keep_best``, metrics given without the metric (and no such blob) raise
    MissingMetricError naming the metric, the keys given and the dbs (a typo in ``metric=``
    would otherwise keep no best, silently)."""
    values = {str(k): metric_number(str(k), v) for k, v in (metrics or {}).items()}
    metric = policy.metric
    if metric and metric not in values:
        raw = _blob_scalar(db_paths, db_type, metric)
        if raw is _ABSENT:
            if policy.keep_best is not None and values:
                at = "" if epoch is None else f" of epoch {epoch}"
                given = ", ".join(map(repr, sorted(values)))
                raise MissingMetricError(
                    f"keep_best ranks by metric {metric!r}, but the save{at} has no value of it: "
                    f"metrics given: {given}; no blob {metric!r} in {', '.join(db_paths) or 'its dbs'}"
                )
            raw = None  # no metrics with this save: unranked (kept or deleted by keep_last/keep_every)
        try:
            values[metric] = metric_number(metric, raw)
        except TypeError as ex:
            logger.warning("Not ranking this checkpoint: %s", ex)
            values[metric] = None
    return values


def keep_best_record(policy: RetentionPolicy) -> KeepBest | None:
    """The ``keep_best`` a manifest records for ``policy`` (None when it keeps no best-k)."""
    if policy.keep_best is None:
        return None
    return KeepBest(policy.keep_best, str(policy.metric), policy.mode)


def manifest_metric(directory: Manifests, epoch: int, metric: str) -> float | None:
    """The value of ``metric`` recorded in the manifest of committed ``epoch`` of
    ``directory``; None when it has none or the manifest cannot be read."""
    try:
        recorded = directory.read_manifest(epoch).metrics
    except CheckpointError:
        return None
    return metric_value(recorded.get(metric))


def recorded_metrics(directory: Manifests, policy: RetentionPolicy, epochs: Iterable[int]) -> dict[int, Any] | None:
    """``{epoch: recorded value of the policy's metric}`` for retention (None when the policy
    keeps no best-k); epochs whose manifest cannot be read are absent (retention keeps them)."""
    if policy.keep_best is None:
        return None
    out: dict[int, Any] = {}
    for e in epochs:  # an epoch whose manifest cannot be read is left out: it cannot be ranked, so it is kept
        try:
            recorded = directory.read_manifest(e).metrics
        except CheckpointError:
            continue
        raw = recorded.get(str(policy.metric))
        if not metric_unreadable(raw):  # a number no float holds cannot be ranked: kept
            out[e] = metric_value(raw)
    return out


@dataclass(frozen=True)
class BestEpochs:
    """The best committed epochs of a directory by ``metric`` under ``mode``, best first
    (``epochs``), and every committed epoch's recorded value (``values``)."""

    metric: str
    mode: str
    k: int | None
    epochs: list[int]
    values: dict[int, float | None]
    #: epochs whose recorded value no float holds (shown as unreadable; never ranked)
    unreadable: frozenset[int] = frozenset()


def best_of(
    d: Manifests,
    *,
    metric: str | None = None,
    mode: str | None = None,
    k: int | None = None,
) -> BestEpochs | None:
    """The best committed epochs of ``d``; see
    :func:`~epochal.checkpoint.location.view.best_of_directory`."""
    committed = d.committed_epochs()
    if metric is None or mode is None or k is None:
        for epoch in reversed(committed):
            try:
                spec = d.read_manifest(epoch).keep_best
            except CheckpointError:
                continue
            if spec is not None:
                metric = metric if metric is not None else spec.metric
                mode = mode if mode is not None else spec.mode
                k = k if k is not None else (spec.k if spec.k > 0 else None)
                break
    if metric is None:
        return None
    mode = mode if mode in ("min", "max") else "min"
    values: dict[int, float | None] = {}
    unreadable = set()
    for e in committed:
        try:
            raw = d.read_manifest(e).metrics.get(metric)
        except CheckpointError:
            raw = None
        if metric_unreadable(raw):
            unreadable.add(e)
        values[e] = metric_value(raw)
    best = best_epochs(values, k if k is not None else len(values), mode)
    return BestEpochs(metric, mode, k, best, values, frozenset(unreadable))


__all__ = [
    "BestEpochs", "Manifests", "best_of", "collect_metrics", "keep_best_record", "manifest_metric", "metric_number",
    "recorded_metrics",
]
