"""Uploads of a staged local file to an object key, whole or not at all (:func:`upload_to_key`).

Call order: a :class:`~epochal.storage.io.fsspec_store.FsspecSink` stages the db in a local
file, then at commit calls :func:`upload_to_key`, which

1. on a store whose uploads are atomic (:func:`atomic_put`: S3, GCS) sends the file straight
   to the final key: on S3 below the multipart threshold as one ``PutObject`` whose body is
   streamed from the open file (:func:`put_streamed`), above it as s3fs's multipart upload
   (parts in parallel, aborted on an error); on GCS with the store's own upload, then a HEAD
   checks the size;
2. elsewhere uploads to a temp key beside the final one, checks its size, moves it into
   place, and removes the temp key whatever happens.

Why streamed: s3fs's ``put_file`` reads a file below the threshold whole into a new
``bytes`` (fresh memory, whose page faults cost about 1 ms per MiB on a VM) before its one
PUT; from the open file the body goes out in small reused chunks (64 MiB on moto: 1.13x
the speed of ``put_file``, bench/RESULTS.md, session 16).
"""

from __future__ import annotations

import errno
import secrets
from typing import Any

from ...errors import CheckpointCorruptError
from . import tuning

__all__ = ["ATOMIC_PUT_PROTOCOLS", "atomic_put", "put_streamed", "upload_to_key"]

#: the fsspec protocols whose stores make an uploaded object visible whole or not at all (a
#: PUT, or a multipart upload's completion, is atomic; a failed or killed one leaves the old
#: object): S3 and GCS. An upload there goes straight to its final key; elsewhere through a
#: temp key that is size-checked, then moved (a server-side copy on object stores)
ATOMIC_PUT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})

#: s3fs's default part size; a file below twice the part size is one PUT (as s3fs does)
_S3FS_PART = 50 << 20
_MAX_PUT = 5 << 30  # S3's largest single PUT


def atomic_put(fs: Any) -> bool:
    """True when ``fs`` stores an uploaded object atomically (:data:`ATOMIC_PUT_PROTOCOLS`)."""
    proto = fs.protocol
    return any(p in ATOMIC_PUT_PROTOCOLS for p in ((proto,) if isinstance(proto, str) else proto))


def put_streamed(fs: Any, path: str, local: str) -> None:
    """One S3 ``PutObject`` of the local file ``local`` to ``path`` on the s3fs filesystem
    ``fs``, its body read from the open file as it is sent (the request options the
    filesystem was built with, SSE and the like, included).

    Sent with the filesystem's client directly, not through s3fs's ``call_s3``: that one
    retries a failed call with the same body object, which by then has been read (a retry
    would send the rest of the file as the whole object); botocore's own retries rewind the
    body to its start before each attempt. Errors are translated as s3fs does
    (``FileNotFoundError``, ``PermissionError``, ...); a connection lost on every attempt
    is an ``OSError`` (EIO)."""
    from fsspec.asyn import sync
    from s3fs.errors import translate_boto_error

    bucket, key, _ = fs.split_path(path)

    async def put() -> None:
        await fs.set_session()
        s3 = await fs.get_s3(bucket)
        kwargs = fs._get_s3_method_kwargs(s3.put_object, Bucket=bucket, Key=key)
        with open(local, "rb") as body:
            await s3.put_object(Body=body, **kwargs)

    try:
        sync(fs.loop, put)
    except OSError:
        raise
    except Exception as ex:
        translated = translate_boto_error(ex)  # a ClientError: as s3fs names it
        if translated is not ex:
            raise translated from ex
        if type(ex).__module__.startswith(("botocore", "aiobotocore", "aiohttp")):
            # a connection lost or timed out on every attempt: a storage error like the others
            raise OSError(errno.EIO, f"PUT of {path} failed: {ex}") from ex
        raise


def _streams(fs: Any, size: int) -> bool:
    """Whether an upload of ``size`` bytes to ``fs`` is one streamed PUT (s3fs, below its
    multipart threshold, with the client calls :func:`put_streamed` needs)."""
    part = tuning.UPLOAD_PART or _S3FS_PART
    needed = ("call_s3", "get_s3", "set_session", "_get_s3_method_kwargs", "split_path")
    return size < min(_MAX_PUT, 2 * part) and all(hasattr(fs, n) for n in needed)


def upload_to_key(fs: Any, path: str, local: str, size: int, name: str) -> None:
    """Upload the local file ``local`` (``size`` bytes) to ``path``. ``name``: the URL, for
    errors.

    On a store with atomic uploads (:func:`atomic_put`: S3, GCS) straight to ``path``: on S3
    one streamed PUT below twice the part size (:func:`put_streamed`), else s3fs's multipart
    upload (parts ``max_concurrency`` at a time, aborted on an error); elsewhere the store's
    own upload. There is no temp key and no server-side copy, which cost as much as the
    upload. S3 itself refuses a body that does not match its Content-Length (and botocore's
    request checksum), so no HEAD follows; on GCS the size is checked with one. Elsewhere
    through a temp key beside ``path`` (size-checked, then moved; removed whatever happens).
    (A db that still came out short fails the quick check of its manifest's digest, which
    holds its size.)"""
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if atomic_put(fs):
        part = tuning.UPLOAD_PART
        try:
            if _streams(fs, size):
                put_streamed(fs, path, local)
            else:
                fs.put_file(local, path, **({} if part is None else {"chunksize": part}))
            fs.invalidate_cache(path)
            got = size if hasattr(fs, "call_s3") else int(fs.info(path)["size"])
        finally:
            fs.invalidate_cache(parent or None)
        if got != size:
            raise CheckpointCorruptError(name, f"uploaded {got} bytes, expected {size}")
        return
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp.upload.{secrets.token_hex(4)}"
    try:
        fs.put_file(local, tmp)
        got = int(fs.info(tmp)["size"])
        if got != size:
            raise CheckpointCorruptError(name, f"uploaded {got} bytes, expected {size}")
        fs.mv(tmp, path)
    finally:
        try:
            if fs.exists(tmp):
                fs.rm(tmp)
        except Exception:  # a failed cleanup must not hide the real error
            pass
        fs.invalidate_cache(parent or None)
