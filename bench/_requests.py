"""Count the requests epochal makes to an S3 store, at the seam where every one of them goes
out: ``s3fs.S3FileSystem._call_s3`` (one call = one HTTP request: GET, PUT, HEAD, LIST,
DELETE, COPY, ...). A bench and test helper, not part of the library.

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


class Requests:
    """Requests seen so far: ``by_method`` (an s3 API name -> count) and ``total``."""

    def __init__(self) -> None:
        self.by_method: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        return sum(self.by_method.values())

    def add(self, method: str) -> None:
        with self._lock:
            self.by_method[method] += 1

    def clear(self) -> None:
        with self._lock:
            self.by_method.clear()


@contextlib.contextmanager
def count_requests(exclude: tuple[str, ...] = (), latency: float = 0.0) -> Iterator[Requests]:
    """Count every S3 request made in this process inside the block (every thread, every
    filesystem instance). ``exclude``: key substrings not counted (say ``"lease.json"``, for
    the background renewals of a lease). ``latency``: seconds added before each request (a
    real store's round trip; an ``asyncio.sleep``, so requests in flight overlap as they do
    on a network)."""
    import asyncio

    import s3fs

    seen = Requests()
    real = s3fs.S3FileSystem._call_s3

    async def counted(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        key = str(kwargs.get("Key", "")) + str(kwargs.get("Prefix", ""))
        if not any(x in key for x in exclude):
            seen.add(method)
        if latency > 0:
            await asyncio.sleep(latency)
        return await real(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = counted  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        s3fs.S3FileSystem._call_s3 = real  # type: ignore[method-assign]
