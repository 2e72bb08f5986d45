"""Start moto's S3 server for a bench (:func:`moto_server`) and count the requests epochal makes to an S3 store, at the seam where every one of them goes
out: aiobotocore's ``AioBaseClient._make_api_call``, under s3fs's ``call_s3`` and under the
streamed PUT of a db (one call = one HTTP request: GET, PUT, HEAD, LIST, DELETE, COPY, ...;
botocore's own retries of it inside). A bench and test helper, not part of the library; with
:func:`fill_committed`, which lays out N committed steps at a URL to count requests against.

    with count_requests() as n:
        handler.write(step)
    n.total, n.by_method  # {"put_object": 2, "get_object": 1, ...}
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any


def moto_server(bucket: str = "bench") -> tuple[Any, dict[str, Any]]:
    """moto's S3 server on 127.0.0.1 as a process of its own (as a real store is: not sharing
    our GIL), with ``bucket`` created: (the process, to ``terminate()``; the fsspec storage
    options that reach it)."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")).read()
            break
        except OSError:
            time.sleep(0.1)
    opts = {"endpoint_url": endpoint, "key": "bench", "secret": "bench",
            "client_kwargs": {"region_name": "us-east-1"}}
    return server, opts


class Requests:
    """Requests seen so far: ``by_method`` (an s3 API name -> count) and ``total``."""

    def __init__(self) -> None:
        self.by_method: Counter[str] = Counter()
        #: bytes of the request bodies sent (PUT, UploadPart), by s3 API name
        self.bytes_by_method: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        return sum(self.by_method.values())

    def add(self, method: str, nbytes: int = 0) -> None:
        with self._lock:
            self.by_method[method] += 1
            self.bytes_by_method[method] += nbytes

    def clear(self) -> None:
        with self._lock:
            self.by_method.clear()
            self.bytes_by_method.clear()


def _body_size(body: Any) -> int:
    """The bytes of a request body: a buffer's length, or a stream's from where it stands."""
    if body is None:
        return 0
    if isinstance(body, memoryview):
        return body.nbytes
    if isinstance(body, (bytes, bytearray, str)):
        return len(body)
    try:
        here = body.tell()
        end = body.seek(0, 2)
        body.seek(here)
        return int(end - here)
    except (AttributeError, OSError, ValueError):
        return 0


@contextlib.contextmanager
def count_requests(exclude: tuple[str, ...] = (), latency: float = 0.0) -> Iterator[Requests]:
    """Count every S3 request made in this process inside the block (every thread, every
    filesystem instance). ``exclude``: key substrings not counted (say ``"lease.json"``, for
    the background renewals of a lease). ``latency``: seconds added before each request (a
    real store's round trip; an ``asyncio.sleep``, so requests in flight overlap as they do
    on a network)."""
    import asyncio

    from aiobotocore.client import AioBaseClient
    from botocore import xform_name

    seen = Requests()
    real = AioBaseClient._make_api_call

    async def counted(self: Any, operation_name: str, api_params: dict[str, Any]) -> Any:
        key = str(api_params.get("Key", "")) + str(api_params.get("Prefix", ""))
        if not any(x in key for x in exclude):
            seen.add(xform_name(operation_name), _body_size(api_params.get("Body")))
        if latency > 0:
            await asyncio.sleep(latency)
        return await real(self, operation_name, api_params)

    AioBaseClient._make_api_call = counted  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        AioBaseClient._make_api_call = real  # type: ignore[method-assign]


def fill_committed(url: str, steps: int, node: str, *, stats: bool = False, epochs: Any = None,
                   metric: str | None = None) -> tuple[bytes, str]:
    """Lay out ``steps`` committed steps at ``url`` (an fsspec URL, or a local directory) as a
    handler would leave them: one small native db of ``node`` and its manifest each (and a
    stats object each with ``stats``), sent in parallel PUTs. ``epochs``: their numbers
    (default ``range(steps)``). ``metric``: each manifest records a value of it (``keep_best=3``
    by it, ``min``; the last three steps a value of 9, never among the best) and the metrics
    index holds them all, as a handler with ``keep_best`` leaves it. Returns the db's bytes and
    digest, for the saves that follow."""
    import json

    import numpy as np

    import epochal as ep
    from epochal.checkpoint.location.manifest import DbEntry, KeepBest, Manifest
    from epochal.storage.io.remote.fsspec_store import filesystem_for

    backend = ep.get_db_type("native")
    probe = f"{url}/probe.0"
    backend.write(probe, {"w": np.arange(64, dtype=np.float32)})
    digest = str(backend.digest(probe))
    fs, root = filesystem_for(url)
    data = bytes(fs.cat_file(filesystem_for(probe)[1]))
    fs.rm_file(filesystem_for(probe)[1])
    numbers = sorted(epochs) if epochs is not None else list(range(steps))
    batch: dict[str, bytes] = {}
    index: dict[str, dict[str, float]] = {}
    for e in numbers:
        metrics = {}
        if metric is not None:
            metrics = {metric: 9.0 if e in numbers[-3:] else (e * 7919 % 997) / 997}
            index[str(e)] = metrics
        m = Manifest(epoch=e, db_type="native", created="2026-12-02T00:00:00.000+00:00",
                     nodes={node: DbEntry(f"{node}.{e}", len(data), digest)}, metrics=metrics,
                     keep_best=KeepBest(3, metric, "min") if metric is not None else None)
        batch[f"{root}/{node}.{e}"] = data
        batch[f"{root}/.epochal/manifest.{e}.json"] = m.encode()
        if stats:
            batch[f"{root}/.epochal/stats/20261202T{e:010d}Z.0000.jsonl"] = (
                b'{"time": "t", "action": "checkpoint_save", "epoch": %d, "node": "%s", "ns": 1000, "bytes": %d}\n'
                % (e, node.encode(), len(data)))
    if metric is not None:
        batch[f"{root}/.epochal/index.json"] = json.dumps(
            {"format": "epochal-index", "version": 1, "epochs": index}).encode()
    fs.makedirs(f"{root}/.epochal/stats", exist_ok=True)
    fs.pipe(batch, batch_size=64)
    fs.invalidate_cache()
    return data, digest


@contextlib.contextmanager
def count_record_calls() -> Iterator[Requests]:
    """Count every call to a local directory's record store (``LocalRecords``: reads, writes,
    deletes, listings, sizes) inside the block: the local disk's equivalent of requests."""
    from epochal.checkpoint.location.records import LocalRecords

    seen = Requests()
    names = ("read", "write", "delete", "exists", "size", "files", "add_stats", "read_stats")
    real = {name: getattr(LocalRecords, name) for name in names}

    def counted(name: str) -> Any:
        def call(self: Any, *a: Any, **k: Any) -> Any:
            seen.add(name)
            return real[name](self, *a, **k)
        return call

    for name in names:
        setattr(LocalRecords, name, counted(name))
    try:
        yield seen
    finally:
        for name in names:
            setattr(LocalRecords, name, real[name])
