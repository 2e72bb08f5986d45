"""One checkpoint location, local or at a URL, with the options to reach it (fsspec's
``url_to_fs`` idea): :func:`location_for` decides once whether a path is the local disk
(``file://`` URLs included) or object storage, and the :class:`Location` it returns carries
its scheme, its normalized root and its fsspec ``storage_options``.

Everything that used to test ``"://"`` asks a Location (or :func:`.seam.is_url` where only a
string is at hand). A Location is a small frozen value, so the checkpoint steps pickle it to
each node's process and reach the store with the same options as the driver:

    loc = location_for("s3://bucket/run", {"endpoint_url": ...})
    loc.join("trainer_0.3")            # 's3://bucket/run/trainer_0.3'
    loc.store()                        # its byte store (:mod:`.seam`), with its options
    with loc.active():                 # code below that has only a path (a db format's
        backend.write(db, blobs)       # store_for(path)) reaches it with loc's options

:meth:`Location.active` scopes the options to the current thread / context (a
:class:`contextvars.ContextVar`), never to the process: two Locations with different options
for the same URL in one process do not see each other's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .seam import ByteStore, local_path, store_for, url_scheme

__all__ = ["Location", "location_for"]


@dataclass(frozen=True)
class Location:
    """A checkpoint location: ``root`` (a local path, or a URL without a trailing ``/``),
    ``scheme`` (``""`` for the local disk, ``file://`` included) and the fsspec
    ``storage_options`` of a URL (``{}``: fsspec's own configuration)."""

    root: str
    scheme: str = ""
    storage_options: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def is_local(self) -> bool:
        """True for the local disk (fsync, rename, flock), ``file://`` URLs included."""
        return not self.scheme

    @property
    def is_url(self) -> bool:
        """True for object storage (any ``scheme://`` other than ``file://``)."""
        return bool(self.scheme)

    def join(self, *parts: str) -> str:
        """The path or URL of ``parts`` under the root (``os.path.join`` locally, ``/`` at a URL)."""
        if self.is_local:
            return os.path.join(self.root, *parts)
        tail = "/".join(p.strip("/") for p in parts if p)
        if not tail:
            return self.root
        return f"{self.root}{tail}" if self.root.endswith("/") else f"{self.root}/{tail}"

    def store(self) -> ByteStore:
        """The byte store of paths under this location, reaching it with its options."""
        return store_for(self.root, self.storage_options or None)

    def filesystem(self, url: str | None = None) -> tuple[Any, str]:
        """The fsspec filesystem (with this location's options) and the path within it of
        ``url`` (default: the root). URLs only."""
        if self.is_local:
            raise ValueError(f"{self.root} is a local path, not a URL")
        from .remote.fsspec_store import filesystem_for

        return filesystem_for(url or self.root, self.storage_options)

    def remember(self) -> None:
        """Record this location's options as this process's default for URLs under its root
        (:func:`.fsspec_store.set_storage_options`, the one process-wide registry), for code
        that gets only a URL: a handler or ``CheckpointDirectory`` built without options for
        a URL a manager or the CLI was given options for. Nothing without options."""
        if self.is_url and self.storage_options:
            from .remote.fsspec_store import set_storage_options

            set_storage_options(self.root, self.storage_options)

    @contextmanager
    def active(self) -> Iterator[Location]:
        """While inside, any store opened by path under this URL (a db format's
        ``store_for(path)``) uses this location's options; only in this thread / context.
        Nothing to do for a local location or one without options."""
        if self.is_local or not self.storage_options:
            yield self
            return
        from .remote.fsspec_store import scoped_storage_options

        with scoped_storage_options(self.root, self.storage_options):
            yield self


def location_for(url_or_path: str | os.PathLike[str] | Location,
                 storage_options: dict[str, Any] | None = None) -> Location:
    """The :class:`Location` of a local path or URL (``file://`` maps to its local path; a
    trailing ``/`` of a URL is dropped). ``storage_options`` matter for URLs only. A Location
    given is returned as it is (with ``storage_options`` added when it had none)."""
    if isinstance(url_or_path, Location):
        if storage_options and not url_or_path.storage_options:
            return Location(url_or_path.root, url_or_path.scheme, dict(storage_options))
        return url_or_path
    text = local_path(url_or_path)
    scheme = url_scheme(text)
    if not scheme:
        return Location(text or ".")
    root = text.rstrip("/")
    if root == f"{scheme}:":  # "memory://": the store's root itself
        root = text
    return Location(root, scheme, dict(storage_options or {}))
