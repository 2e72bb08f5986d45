"""Uploads of a staged local file to an object key, whole or not at all (:func:`upload_to_key`).

Call order: a :class:`~epochal.storage.io.remote.fsspec_store.FsspecSink` stages the db in a local
file, then at commit calls :func:`upload_to_key`, which

1. on a store whose uploads are atomic (:func:`atomic_put`: S3, GCS) sends the file straight
   to the final key: on S3 streamed from the open file (:func:`put_streamed`: one
   ``PutObject`` below the multipart threshold, above it a multipart upload whose parts go
   up in parallel, each read from its slice of the file, aborted on an error); on GCS with
   the store's own upload, then a HEAD checks the size;
2. elsewhere uploads to a temp key beside the final one, checks its size, moves it into
   place, and removes the temp key whatever happens.

Why streamed: s3fs's ``put_file`` reads a file below the threshold whole into a new
``bytes``, and each part of a bigger one likewise (fresh memory, whose page faults cost
about 1 ms per MiB on a VM) before sending it; from the open file a body goes out in small
reused chunks (on moto, paired: 64 MiB in one PUT 1.13x the speed of ``put_file``, 256 MiB
in 50 MiB parts 1.10x; bench/RESULTS.md, "bench_upload.py").
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import os
import secrets
from typing import Any

from ....errors import CheckpointCorruptError
from .. import tuning

__all__ = ["ATOMIC_PUT_PROTOCOLS", "atomic_put", "part_size", "put_streamed", "upload_to_key"]

#: the fsspec protocols whose stores make an uploaded object visible whole or not at all (a
#: PUT, or a multipart upload's completion, is atomic; a failed or killed one leaves the old
#: object): S3 and GCS. An upload there goes straight to its final key; elsewhere through a
#: temp key that is size-checked, then moved (a server-side copy on object stores)
ATOMIC_PUT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})

#: s3fs's default part size; a file below twice the part size is one PUT (as s3fs does)
_S3FS_PART = 50 << 20
_MAX_PUT = 5 << 30  # S3's largest single PUT (and part)
_MAX_PARTS = 10_000  # S3's most parts in one upload
_READ_BUFFER = 1 << 20  # a part's body is read from the file this much at a time


def atomic_put(fs: Any) -> bool:
    """True when ``fs`` stores an uploaded object atomically (:data:`ATOMIC_PUT_PROTOCOLS`)."""
    proto = fs.protocol
    return any(p in ATOMIC_PUT_PROTOCOLS for p in ((proto,) if isinstance(proto, str) else proto))


class _FileSlice(io.RawIOBase):
    """Bytes ``start .. start + size`` of a local file as a seekable, read-only stream: a
    multipart upload's part, read from the file as it is sent (positions are the slice's,
    so botocore's rewind before a retry, ``seek(0)``, goes back to the part's first byte)."""

    def __init__(self, path: str, start: int, size: int) -> None:
        super().__init__()
        self._fd = os.open(path, os.O_RDONLY)
        self._start, self._size, self._pos = start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._size - self._pos)
        if n <= 0:
            return 0
        got = os.preadv(self._fd, [memoryview(buffer).cast("B")[:n]], self._start + self._pos)
        self._pos += got
        return got

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def part_size(size: int) -> int:
    """The part size of a multipart upload of ``size`` bytes: ``tuning.UPLOAD_PART`` (None:
    s3fs's 50 MiB), grown so that there are at most 10,000 parts (S3's limit)."""
    return max(tuning.UPLOAD_PART or _S3FS_PART, -(-size // _MAX_PARTS))


def put_streamed(fs: Any, path: str, local: str, size: int) -> None:
    """Upload the local file ``local`` (``size`` bytes) to ``path`` on the s3fs filesystem
    ``fs``, its bytes read from the file as they are sent: below twice :func:`part_size`
    one ``PutObject``, else a multipart upload whose parts (:class:`_FileSlice`) go up
    ``fs.max_concurrency`` (s3fs: 10) at a time, aborted on an error (a killed one is
    aborted by the next lease holder: ``fsspec_store.abort_uploads``). The request options
    the filesystem was built with (SSE and the like) are included.

    Sent with the filesystem's client directly, not through s3fs's ``call_s3``: that one
    retries a failed call with the same body object, which by then has been read (a retry
    would send the rest of the file as the whole object); botocore's own retries rewind a
    body to its first byte before each attempt. Errors are translated as s3fs does
    (``FileNotFoundError``, ``PermissionError``, ...); a connection lost on every attempt
    is an ``OSError`` (EIO)."""
    from fsspec.asyn import sync

    bucket, key, _ = fs.split_path(path)

    async def put() -> None:
        await fs.set_session()
        s3 = await fs.get_s3(bucket)
        part = part_size(size)
        if size < 2 * part:
            kwargs = fs._get_s3_method_kwargs(s3.put_object, Bucket=bucket, Key=key)
            with open(local, "rb") as body:
                await s3.put_object(Body=body, **kwargs)
            return
        kwargs = fs._get_s3_method_kwargs(s3.create_multipart_upload, Bucket=bucket, Key=key)
        upload = (await s3.create_multipart_upload(**kwargs))["UploadId"]
        ids = {"Bucket": bucket, "Key": key, "UploadId": upload}
        gate = asyncio.Semaphore(max(1, int(getattr(fs, "max_concurrency", 10) or 10)))

        async def send(number: int, start: int) -> dict[str, Any]:
            async with gate:
                with io.BufferedReader(_FileSlice(local, start, min(part, size - start)), _READ_BUFFER) as body:
                    out = await s3.upload_part(PartNumber=number, Body=body, **ids)
            return {"PartNumber": number, "ETag": out["ETag"]}

        sends = [asyncio.ensure_future(send(i + 1, at)) for i, at in enumerate(range(0, size, part))]
        try:
            parts = await asyncio.gather(*sends)
            await s3.complete_multipart_upload(MultipartUpload={"Parts": list(parts)}, **ids)
        except BaseException:
            for task in sends:  # no part goes up after the abort
                task.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
            with contextlib.suppress(Exception):  # the parts would stay stored (and billed)
                await s3.abort_multipart_upload(**ids)
            raise

    from botocore.exceptions import BotoCoreError, ClientError

    try:
        sync(fs.loop, put)
    except ClientError as ex:  # the store's answer: as s3fs names it (FileNotFoundError, ...)
        from s3fs.errors import translate_boto_error

        raise translate_boto_error(ex) from ex
    except BotoCoreError as ex:  # a connection lost or timed out on every attempt (aiobotocore
        # wraps aiohttp's errors in these): a storage error like the others
        raise OSError(errno.EIO, f"upload of {path} failed: {ex}") from ex


def _streams(fs: Any, size: int) -> bool:
    """Whether ``fs`` is s3fs with the client calls :func:`put_streamed` needs."""
    needed = ("call_s3", "get_s3", "set_session", "_get_s3_method_kwargs", "split_path")
    return size <= _MAX_PARTS * _MAX_PUT and all(hasattr(fs, n) for n in needed)


def upload_to_key(fs: Any, path: str, local: str, size: int, name: str) -> None:
    """Upload the local file ``local`` (``size`` bytes) to ``path``. ``name``: the URL, for
    errors.

    On a store with atomic uploads (:func:`atomic_put`: S3, GCS) straight to ``path``: on S3
    streamed from the file (:func:`put_streamed`: one PUT below twice the part size, else a
    multipart upload, parts ``max_concurrency`` at a time, aborted on an error); on GCS the
    store's own upload. There is no temp key and no server-side copy, which cost as much as the
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
                put_streamed(fs, path, local, size)
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
