"""The metrics index: ``.epochal/index.json``, the metrics recorded by every committed epoch in
one object, so that ``keep_best`` ranks a history of thousands of steps with one read instead
of one per manifest.

It is a cache, never the source of truth; the manifests are:

* it is written after the commit it describes (a crash in between leaves an epoch that is
  listed but missing from the index: its manifest is read, and the entry added);
* an entry whose manifest is no longer listed (retention deleted it, or a crash came between
  the delete and the index write) is dropped;
* an index that is absent, unreadable or damaged is rebuilt from the manifests (every one read
  once), and written back by the next commit that keeps best epochs;
* retention never deletes on its word alone: the manifest of each epoch it deletes, and of
  each epoch it ranks among the best, is read first (see
  :func:`epochal.checkpoint.handler.cleanup.apply_retention`).

Layout::

    {"format": "epochal-index", "version": 1,
     "epochs": {"<epoch>": {"<metric>": <number or null>, ...}, ...}}

The writer that keeps best epochs (a handler with ``keep_best``) maintains it while it holds
the location's lock; tools (``epochal ls``) read it and never write it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .manifest import Manifest
    from .view import CheckpointDirectory

logger = logging.getLogger("epochal")

__all__ = ["INDEX_FILE", "INDEX_FORMAT", "MetricIndex", "decode_index", "encode_index"]

INDEX_FILE = "index.json"
INDEX_FORMAT = "epochal-index"
INDEX_VERSION = 1

Metrics = dict[str, Any]


def _number(value: Any) -> bool:
    return value is None or isinstance(value, (int, float)) and not isinstance(value, bool)


def decode_index(raw: bytes) -> dict[int, Metrics] | None:
    """The ``{epoch: metrics}`` an index holds; None when ``raw`` is not a valid index (it is
    then rebuilt from the manifests)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT or data.get("version") != INDEX_VERSION:
        return None
    epochs = data.get("epochs")
    if not isinstance(epochs, dict):
        return None
    out: dict[int, Metrics] = {}
    for key, metrics in epochs.items():
        if not (isinstance(key, str) and key.isdigit() and str(int(key)) == key):
            return None
        if not isinstance(metrics, dict) or not all(isinstance(k, str) and _number(v) for k, v in metrics.items()):
            return None
        out[int(key)] = dict(metrics)
    return out


def encode_index(entries: dict[int, Metrics]) -> bytes:
    """The bytes of an index of ``entries`` (compact JSON, epochs in order)."""
    data = {"format": INDEX_FORMAT, "version": INDEX_VERSION,
            "epochs": {str(e): entries[e] for e in sorted(entries)}}
    return (json.dumps(data, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")


class MetricIndex:
    """The metrics index of the checkpoint directory ``d`` (see the module doc), loaded once
    and kept in step with the listing of its manifests."""

    def __init__(self, d: CheckpointDirectory) -> None:
        self.d = d
        self.path = os.path.join(d.records_dir, INDEX_FILE)
        self._entries: dict[int, Metrics] | None = None  # None: not read yet
        self._dirty = False
        #: manifests read because the index lacked them (or was rebuilt): what it saved, or not
        self.manifests_read = 0

    def _load(self) -> dict[int, Metrics]:
        if self._entries is not None:
            return self._entries
        entries: dict[int, Metrics] | None = None
        try:
            raw = self.d.records.read(self.path)
        except FileNotFoundError:
            pass
        except OSError as ex:
            logger.warning("Cannot read the metrics index %s (%s): reading the manifests instead", self.path, ex)
        else:
            entries = decode_index(raw)
            if entries is None:
                logger.warning("The metrics index %s is damaged: rebuilt from the manifests", self.path)
        self._entries = {} if entries is None else entries
        self._dirty = entries is None
        return self._entries

    def metrics(self, listed: Iterable[int], unreadable: dict[int, str]) -> dict[int, Metrics]:
        """``{epoch: recorded metrics}`` of the epochs of ``listed`` (the epochs that have a
        manifest file): from the index, reading the manifests of the epochs it lacks (all at
        once); entries of epochs not listed are dropped. An epoch whose manifest cannot be read
        or parsed is added to ``unreadable`` (with why) and left out."""
        entries = self._load()
        wanted = {int(e) for e in listed}
        for gone in [e for e in entries if e not in wanted]:
            del entries[gone]
            self._dirty = True
        missing = sorted(e for e in wanted if e not in entries and e not in unreadable)
        if missing:
            good, bad = self.d.read_manifests(missing)
            self.manifests_read += len(missing)
            for epoch, manifest in good.items():
                self.note(epoch, manifest)
            unreadable.update(bad)
        return {e: entries[e] for e in sorted(wanted) if e in entries and e not in unreadable}

    def note(self, epoch: int, manifest: Manifest) -> None:
        """Record the metrics of committed ``epoch`` as ``manifest`` (just read) says."""
        entries = self._load()
        metrics = dict(manifest.metrics)
        if entries.get(int(epoch)) != metrics:
            entries[int(epoch)] = metrics
            self._dirty = True

    def forget(self, epochs: Iterable[int]) -> None:
        """Drop the entries of ``epochs`` (deleted)."""
        entries = self._load()
        for e in epochs:
            if entries.pop(int(e), None) is not None:
                self._dirty = True

    def save(self) -> None:
        """Write the index when it changed since it was read (a failure is a warning: it is a
        cache, rebuilt from the manifests when needed)."""
        if self._entries is None or not self._dirty:
            return
        try:
            self.d.records.write(self.path, encode_index(self._entries))
        except (OSError, ValueError) as ex:
            logger.warning("Cannot write the metrics index %s: %s", self.path, ex)
            return
        self._dirty = False
