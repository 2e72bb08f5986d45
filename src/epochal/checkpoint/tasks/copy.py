"""A committed db copied, byte for byte, from a node-local tier to the store.

A local tier (docs/tiers.md) writes every save to a node-local directory and puts only some of
them in the store: what goes there is the local db's bytes, no second snapshot and no second
encoding. :func:`copy_db` does the copy; :class:`CopyDb` is the same as a step, so a session
runs it in the node's own process, where the node's local directory is.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ...errors import CheckpointCorruptError
from ...storage.formats.base import get_db_type
from ...storage.io.seam import committed, is_url, store_for
from .steps import StepResult, db_digest, db_location, put_outputs

__all__ = ["COPY_CHUNK", "CopyDb", "copy_db"]

#: bytes per read/write of a copy from the local tier to the store
COPY_CHUNK = 8 << 20


def copy_db(src: str, dst: str, db_type: str = "native", storage_options: dict[str, Any] | None = None, *,
            verify: bool = False) -> StepResult:
    """Copy the db ``src`` to ``dst`` (a path or URL) atomically (a temp file committed under
    its final name, or the object store's single put) and return what the store's commit
    records: its size and digest, the digest read back from ``dst`` and checked against the
    source's (CheckpointCorruptError naming both files when they differ). An interrupted copy
    leaves no file under ``dst``'s name. ``verify``: every checksum of ``src`` is checked
    first (CheckpointCorruptError naming ``src`` and the blob; nothing is written) — for a db
    written some time ago, not one just written and read back."""
    start = time.perf_counter_ns()
    if verify:
        get_db_type(db_type).verify(src)
    want = db_digest(db_type, src)
    source = store_for(src).open_read(src)
    try:
        size = source.size()
        if not is_url(dst):
            os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        with committed(store_for(dst, storage_options).create(dst, size)) as sink:
            offset = 0
            while offset < size:
                chunk = source.read(min(COPY_CHUNK, size - offset), offset)
                if not chunk:
                    raise CheckpointCorruptError(src, f"ended at byte {offset} of {size} while copied to {dst}")
                sink.write(chunk)
                offset += len(chunk)
    finally:
        source.close()
    with db_location(dst, storage_options).active():
        got = db_digest(db_type, dst)
    if got != want:
        raise CheckpointCorruptError(dst, f"its digest {got} differs from its source {src} ({want}) after the copy")
    return StepResult(dst, size, time.perf_counter_ns() - start, got)


class CopyDb:
    """(A step.) :func:`copy_db` of ``src`` to ``dst`` where the node lives; the copy's digest
    goes to ``digest_output`` (the driver commits with it), its bytes are returned (for
    :class:`~.steps.Timed`); ``verify``: ``src``'s checksums are checked first."""

    name = "checkpoint_copy"

    def __init__(self, src: str, dst: str, db_type: str, *, digest_output: str | None = None,
                 storage_options: dict[str, Any] | None = None, verify: bool = False) -> None:
        self.src, self.dst, self.db_type = src, dst, db_type
        self.digest_output = digest_output
        self.storage_options = dict(storage_options) if storage_options else None
        self.verify = verify

    def __call__(self, ws: Any) -> int:
        result = copy_db(self.src, self.dst, self.db_type, self.storage_options, verify=self.verify)
        put_outputs(ws, result, self.digest_output, None)
        return result.nbytes
