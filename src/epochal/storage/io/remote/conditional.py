"""Conditional writes of small objects at an fsspec URL: compare-and-swap on a version.

A writer lease on object storage is safe only if taking, renewing and deleting it are
compare-and-swap operations: "replace this object only if it is still the one I read". This
module gives those three operations for one URL, on every store, with how strong they are:

* **S3** (s3fs): the store checks the condition itself, atomically. The version is the
  object's ``ETag``; a create is ``PUT`` with ``If-None-Match: *``, a replace ``PUT`` with
  ``If-Match: <etag>``, a delete ``DELETE`` with ``If-Match: <etag>`` (AWS S3 since 2024,
  MinIO, moto). ``atomic`` is True.
* **GCS** (gcsfs, ``gs://``/``gcs://``): the store checks the condition itself, atomically.
  The version is the object's ``generation``; a create is an upload with
  ``ifGenerationMatch=0``, a replace one with ``ifGenerationMatch=<generation>``, a delete
  ``DELETE`` with ``ifGenerationMatch=<generation>`` (see the GCS section below; a 412 that
  finds exactly the bytes it sent counts as its own write: gcsfs retried a request whose
  answer was lost). ``atomic`` is True.
* **Any other store** (``memory://``, ``file://``, Azure, ...): read, compare, write. The
  version is the SHA-256 of the bytes; the compare and the write are not one operation, so
  two writers within one round trip of each other can both succeed. Within one process a
  lock makes it atomic (``memory://`` in tests); across processes it is best effort.
  ``atomic`` is False; :mod:`epochal.checkpoint.location.lease` reads the object back after each write
  to catch most such races and documents the rest.

An S3 or GCS look-alike that refuses the preconditions (HTTP 501, ``NotImplemented``) turns
``atomic`` off for that URL with a warning, and the same operations run as read-compare-write.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

from .fsspec_store import filesystem_for

__all__ = ["ConditionalObjects", "Versioned", "conditional_for"]

logger = logging.getLogger("epochal")

_fallback_lock = threading.Lock()


@dataclass(frozen=True)
class Versioned:
    """An object's bytes and the version a conditional write compares against."""

    data: bytes
    version: str


def _not_implemented(ex: BaseException) -> bool:
    """True when the store refuses conditional requests (an S3 look-alike without them)."""
    seen: BaseException | None = ex
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            if (response.get("Error") or {}).get("Code") in ("NotImplemented", "501"):
                return True
            if (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") == 501:
                return True
        seen = seen.__cause__ or seen.__context__
    return "NotImplemented" in str(ex) or "not implemented" in str(ex).lower()


def _precondition_failed(ex: BaseException) -> bool:
    """True for the store's "the condition did not hold" answer (HTTP 412)."""
    if isinstance(ex, FileExistsError):
        return True
    seen: BaseException | None = ex
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            err = response.get("Error") or {}
            if err.get("Code") in ("PreconditionFailed", "ConditionalRequestConflict", "412"):
                return True
            if (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") in (409, 412):
                return True
        seen = seen.__cause__ or seen.__context__
    return "pre-condition" in str(ex) or "precondition" in str(ex).lower()


class ConditionalObjects:
    """Compare-and-swap on the objects of one fsspec filesystem (see the module doc)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        #: the options every request carries (None: this process's defaults for each URL)
        self.storage_options = storage_options
        self.fs, _ = filesystem_for(url, storage_options)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        kinds = set(protocols)
        #: the store's own compare-and-swap: "s3", "gcs", or None (read-compare-write)
        self.native: str | None = None
        if {"s3", "s3a"} & kinds and hasattr(self.fs, "_call_s3"):
            self.native = "s3"
        elif {"gs", "gcs"} & kinds and hasattr(self.fs, "_call") and hasattr(self.fs, "_location"):
            self.native = "gcs"
        #: True when the store checks conditions itself (S3, GCS); False: read-compare-write
        self.atomic = self.native is not None

    # -- reads
    def get(self, url: str) -> Versioned | None:
        """The object's bytes and version; None when it does not exist."""
        _, path = filesystem_for(url, self.storage_options)
        if self.atomic and self.native == "gcs":
            got = _gcs_get(self.fs, path)
            return None if got is None else Versioned(*got)
        if self.atomic:
            return self._s3_get(path)
        try:
            data = bytes(self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        return Versioned(data, hashlib.sha256(data).hexdigest())

    # -- writes: each returns the new version, or None when the condition did not hold
    def create(self, url: str, data: bytes) -> str | None:
        """Write ``url`` only if it does not exist."""
        _, path = filesystem_for(url, self.storage_options)
        if self.atomic:
            try:
                if self.native == "gcs":
                    return _gcs_put(self.fs, path, data, "0")
                return self._s3_put(path, data, {"IfNoneMatch": "*"})
            except OSError as ex:
                if not self._refused(ex, url):
                    raise _named(ex, url) from ex
        with _fallback_lock:
            if self.fs.exists(path):
                return None
            return self._plain_put(path, data)

    def replace(self, url: str, data: bytes, version: str) -> str | None:
        """Write ``url`` only if it is still at ``version``."""
        _, path = filesystem_for(url, self.storage_options)
        if self.atomic:
            try:
                if self.native == "gcs":
                    return _gcs_put(self.fs, path, data, version)
                return self._s3_put(path, data, {"IfMatch": version})
            except FileNotFoundError:  # deleted meanwhile: the condition did not hold
                return None
            except OSError as ex:
                if not self._refused(ex, url):
                    raise
        with _fallback_lock:
            current = self.get(url)
            if current is None or current.version != version:
                return None
            return self._plain_put(path, data)

    def delete(self, url: str, version: str) -> bool:
        """Delete ``url`` only if it is still at ``version``; False when it is not (or gone)."""
        _, path = filesystem_for(url, self.storage_options)
        if self.atomic and self.native == "gcs":
            try:
                return _gcs_delete(self.fs, path, version)
            except OSError as ex:
                if not self._refused(ex, url):
                    raise
        if self.atomic:
            bucket, key, _ = self.fs.split_path(path)
            try:
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version)
            except FileNotFoundError:
                return False
            except OSError as ex:
                if _precondition_failed(ex):
                    return False
                if not self._refused(ex, url):
                    raise
            else:
                return True
            finally:
                self.fs.invalidate_cache(path)
        with _fallback_lock:
            current = self.get(url)
            if current is None or current.version != version:
                return False
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                return False
            finally:
                self.fs.invalidate_cache(path)
            return True

    def _refused(self, ex: OSError, url: str) -> bool:
        """The store does not do conditional requests: from now on read-compare-write."""
        if not _not_implemented(ex):
            return False
        logger.warning("%s refuses conditional requests (%s): the lease there is best effort "
                       "(see docs/remote.md)", url, ex)
        self.atomic = False
        return True

    # -- S3
    def _s3_get(self, path: str) -> Versioned | None:
        from fsspec.asyn import sync

        bucket, key, _ = self.fs.split_path(path)
        fs = self.fs

        async def get() -> tuple[bytes, str]:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key)
            try:
                return bytes(await resp["Body"].read()), str(resp["ETag"])
            finally:
                resp["Body"].close()

        try:
            data, etag = sync(fs.loop, get)
        except FileNotFoundError:
            return None
        except OSError as ex:
            if ex.errno == errno.ENOENT:
                return None
            raise
        return Versioned(data, etag)

    def _s3_put(self, path: str, data: bytes, condition: dict[str, str]) -> str | None:
        try:
            out: Any = self.fs.pipe_file(path, bytes(data), **condition)
        except FileNotFoundError:
            raise
        except OSError as ex:
            if _precondition_failed(ex):
                return None
            raise
        finally:
            self.fs.invalidate_cache(path)
        etag = out.get("ETag") if isinstance(out, dict) else None
        if etag is None:  # an s3fs that does not return the response: ask
            etag = self.fs.info(path, refresh=True).get("ETag")
        return str(etag)

    def _plain_put(self, path: str, data: bytes) -> str:
        self.fs.pipe_file(path, bytes(data))
        self.fs.invalidate_cache(path)
        return hashlib.sha256(bytes(data)).hexdigest()


def _named(ex: OSError, url: str) -> OSError:
    """``ex`` as an error naming ``url`` (a missing bucket is CheckpointNotFoundError)."""
    from ....errors import CheckpointNotFoundError

    text = f"cannot write {url}: {ex.strerror or ex}"
    if isinstance(ex, FileNotFoundError):
        return CheckpointNotFoundError(text + " (does the bucket exist?)")
    return OSError(ex.errno, text)


# -- GCS (gcsfs): generation preconditions. The version is the object's ``generation`` (the
# store gives every write of an object a new one) and GCS checks ``ifGenerationMatch`` itself.
# A get is one ``GET ?alt=media`` (bytes and ``X-Goog-Generation`` in one answer); a put one
# multipart upload (the request gcsfs's own ``simple_upload`` sends) with ``ifGenerationMatch``
# (``0``: only if absent); a delete one ``DELETE`` with ``ifGenerationMatch``, after a metadata
# read that compares the generation first (one request more, at a release only), so a server
# that ignores the precondition on DELETE (fake-gcs-server does) still never deletes an object
# it shows with another generation. Every request goes through gcsfs's own ``fs.call`` (its
# session, credentials, endpoint, retries; a 412 arrives as ``FileExistsError``); a 501 is
# raised as a ``NotImplemented`` OSError, which ``ConditionalObjects._refused`` falls back on.

_GCS_BOUNDARY = "==epochal-cas=="


def _gcs_key(fs: Any, path: str) -> tuple[str, str]:
    bucket, key, _ = fs.split_path(path)
    return bucket, key


def _gcs_refusal(ex: Exception) -> OSError | None:
    """A 501 from the store as the ``NotImplemented`` OSError the fallback looks for."""
    if getattr(ex, "code", None) in (501, "501"):
        return OSError(errno.EOPNOTSUPP, f"NotImplemented: the store refuses generation preconditions ({ex})")
    return None


def _gcs_get(fs: Any, path: str) -> tuple[bytes, str] | None:
    """The object's bytes and generation (None: no such object), in one GET where the server
    sends ``X-Goog-Generation`` with the media (GCS does; so does fake-gcs-server). Else the
    metadata first, then the bytes of exactly that generation (``&generation=``), so the pair
    is one snapshot even then."""
    try:
        headers, data = fs.call("GET", fs.url(path))
    except FileNotFoundError:
        return None
    generation = headers.get("X-Goog-Generation") or headers.get("x-goog-generation")
    if generation is not None:
        return bytes(data), str(generation)
    for _ in range(5):
        fs.invalidate_cache(path)
        try:
            generation = str(fs.info(path)["generation"])
        except FileNotFoundError:
            return None
        try:
            _, data = fs.call("GET", fs.url(path, generation=generation))
        except FileNotFoundError:  # rewritten between the two: look again
            continue
        return bytes(data), generation
    raise OSError(errno.EAGAIN, f"cannot read gs://{path}: it keeps changing")


def _gcs_put(fs: Any, path: str, data: bytes, generation: str) -> str | None:
    """Write ``path`` only if its live generation is ``generation`` (``"0"``: only if there is
    none); the new generation, or None when the condition did not hold."""
    bucket, key = _gcs_key(fs, path)
    meta = json.dumps({"name": key})
    body = (f"--{_GCS_BOUNDARY}\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n"
            f"--{_GCS_BOUNDARY}\nContent-Type: application/octet-stream\n\n").encode() + bytes(data) \
        + f"\n--{_GCS_BOUNDARY}--".encode()
    from gcsfs.core import quote

    try:
        out = fs.call("POST", f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
                      uploadType="multipart", ifGenerationMatch=str(generation), data=body, json_out=True,
                      headers={"Content-Type": f'multipart/related; boundary="{_GCS_BOUNDARY}"'})
    except FileExistsError:  # 412
        # gcsfs retries a request whose answer was lost (a 5xx, a reset): a write that landed
        # the first time then reads as 412. The bytes say whether it was ours.
        now = _gcs_get(fs, path)
        return now[1] if now is not None and now[0] == bytes(data) else None
    except Exception as ex:
        refused = _gcs_refusal(ex)
        if refused is None:
            raise
        raise refused from ex
    finally:
        fs.invalidate_cache(path)
    return str(out["generation"])


def _gcs_delete(fs: Any, path: str, generation: str) -> bool:
    """Delete ``path`` only if its live generation is ``generation``; False when it is not
    (or it is gone)."""
    bucket, key = _gcs_key(fs, path)
    fs.invalidate_cache(path)
    try:
        live = fs.info(path).get("generation")
        if live is not None and str(live) != str(generation):
            return False
        fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=str(generation))
    except (FileNotFoundError, FileExistsError):  # gone, or 412: not ours any more
        return False
    except Exception as ex:
        refused = _gcs_refusal(ex)
        if refused is None:
            raise
        raise refused from ex
    finally:
        fs.invalidate_cache(path)
    return True


def conditional_for(url: str, storage_options: dict[str, Any] | None = None) -> ConditionalObjects:
    """The conditional operations of the store at ``url`` (reached with ``storage_options``)."""
    return ConditionalObjects(url, storage_options)
