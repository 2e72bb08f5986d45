"""Remote storage through fsspec: ship checkpoints to any URL (s3://, gs://, memory://, ...).

Checkpoints are written and committed on local disk first (where atomic renames and fsync
exist), then uploaded, whole or not at all, and its size is checked, so a reader of the
final key never sees a partial object (on S3/GCS straight to the key, their uploads being
atomic; elsewhere through a temporary key moved into place: ``uploads.upload_to_key``).
Downloads land in a temp file and are read with the pickle-free backends, checksums
verified.

Requires the ``s3`` extra (fsspec, plus s3fs for S3).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Sequence
from typing import Any

from ...errors import CheckpointNotFoundError
from ..io.seam import is_url as is_url  # the one notion of local vs URL (re-exported here)


def filesystem(url: str, **storage_options: Any) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path within it."""
    from ..io.remote.fsspec_store import filesystem_for  # one way to reach a URL (loaded lazily)

    return filesystem_for(url, storage_options)


def upload_file(local: str, url: str, **storage_options: Any) -> int:
    """Copy the local file ``local`` to ``url`` (whole or not at all, size-checked:
    ``uploads.upload_to_key``). Returns the bytes uploaded."""
    from ..io.remote.uploads import upload_to_key

    size = os.path.getsize(local)
    fs, path = filesystem(url, **storage_options)
    upload_to_key(fs, path, local, size, url)
    return size


def download_file(url: str, local: str, **storage_options: Any) -> int:
    """Copy ``url`` to the local file ``local`` (through a temp name); the bytes downloaded."""
    fs, path = filesystem(url, **storage_options)
    if not fs.exists(path):
        raise CheckpointNotFoundError(f"remote checkpoint {url} does not exist")
    tmp = f"{local}.tmp.download.{secrets.token_hex(4)}"
    try:
        fs.get_file(path, tmp)
        os.replace(tmp, local)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return os.path.getsize(local)


def read_remote(
    url: str,
    names: Sequence[str] | None = None,
    *,
    db_type: str = "native",
    allow_incomplete: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Read blobs of the db at ``url`` (downloaded to a temp file, checksums verified)."""
    from .base import get_db_type

    with tempfile.TemporaryDirectory(prefix="epochal-dl-") as tmpdir:
        local = os.path.join(tmpdir, "db")
        download_file(url, local, **(storage_options or {}))
        return get_db_type(db_type).read(local, names, allow_incomplete=allow_incomplete)
