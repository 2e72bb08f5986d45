"""Fast, GIL-releasing checksums for checkpoint files, and a background checksummer.

Two algorithms are known, each identified by a small integer recorded in every file so a
reader always uses the writer's algorithm:

* ``crc32c`` (id 1): CRC-32C (Castagnoli) through ICRAR's ``crc32c`` package, hardware
  accelerated (SSE4.2 / ARMv8) at >10 GB/s, and it releases the GIL, so checksumming can run
  in a thread overlapped with disk I/O. This is the default whenever the package imports.
* ``crc32`` (id 2): zlib's CRC-32, the fallback when ``crc32c`` is missing, so the core still
  works with numpy alone. zlib also releases the GIL for buffers larger than a few KiB.

Both are incremental: ``fn(data, previous_value)`` continues a running checksum, which lets a
segment be checksummed in chunks, in order, while it is still being read or written.

:class:`Checksummer` runs checksum work on one daemon thread, strictly in submission order.
The I/O thread submits a chunk right after reading it (or right before writing it) and goes on
with the next system call; both release the GIL, so on two cores the checksum is nearly free.
"""

from __future__ import annotations

import queue
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

try:  # pragma: no cover - depends on the environment
    import crc32c as _crc32c_mod

    def _crc32c(data: Any, value: int = 0) -> int:
        # gil_release_mode=1: always release the GIL (the default only does so above 32 KiB),
        # so a background checksum never blocks the I/O thread.
        return int(_crc32c_mod.crc32c(data, value, 1))

    #: for small buffers checksummed on the calling thread: the C function itself (no Python
    #: frame per call: 20,000 small segments are 20,000 calls), whose default mode keeps the
    #: GIL below 32 KiB, where releasing and re-taking it would cost more than the checksum
    _crc32c_inline: Callable[[Any, int], int] = _crc32c_mod.crc32c

    HAVE_CRC32C = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_CRC32C = False


def _crc32(data: Any, value: int = 0) -> int:
    return zlib.crc32(data, value) & 0xFFFFFFFF


ChecksumFn = Callable[[Any, int], int]

#: algorithm name -> id stored in files
ALGORITHM_IDS: dict[str, int] = {"crc32c": 1, "crc32": 2}
#: id stored in files -> algorithm name
ALGORITHM_NAMES: dict[int, str] = {v: k for k, v in ALGORITHM_IDS.items()}


def default_algorithm() -> str:
    """The algorithm new files use: ``crc32c`` when its package imports, else ``crc32``."""
    return "crc32c" if HAVE_CRC32C else "crc32"


def checksum_function(algorithm: str, *, inline: bool = False) -> ChecksumFn:
    """The incremental function ``fn(data, value=0) -> int`` for ``algorithm``.

    ``inline=True`` gives a variant for small buffers on the calling thread (it keeps the
    GIL); the default releases the GIL, for big buffers and background threads. Raises
    ValueError for an unknown name, or when ``crc32c`` is asked for but its package is not
    installed (the message says what to install)."""
    if algorithm == "crc32c":
        if not HAVE_CRC32C:
            raise ValueError("this file uses CRC-32C checksums: pip install crc32c to read it")
        return _crc32c_inline if inline else _crc32c
    if algorithm == "crc32":
        return zlib.crc32 if inline else _crc32  # unsigned in Python 3 either way
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def checksum(data: Any, algorithm: str | None = None, value: int = 0) -> int:
    """Checksum of the bytes-like ``data`` (continuing ``value``) with ``algorithm``."""
    return checksum_function(algorithm or default_algorithm())(data, value)


def format_checksum(algorithm: str, value: int) -> str:
    """The printable form used in :class:`~epochal.storage.formats.base.BlobInfo`: ``crc32c:1a2b3c4d``."""
    return f"{algorithm}:{value & 0xFFFFFFFF:08x}"


class Checksummer:
    """Checksums segments on a background thread, in submission order.

    ``submit(slot, chunks)`` continues the running checksum of ``slot`` (an index into the
    result list) over ``chunks``; ``results()`` waits for all submitted work and returns the
    checksum of every slot. Work is processed strictly in order, so the chunks of one slot may
    be submitted across several calls. An exception in the worker is re-raised by
    ``results()``. Use as a context manager so the thread always ends.
    """

    def __init__(self, fn: ChecksumFn, nslots: int) -> None:
        self._fn = fn
        self._values = [0] * nslots
        self._queue: queue.SimpleQueue[list[tuple[int, Any]] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="epochal-checksum", daemon=True)
        self._thread.start()
        self._closed = False

    def _run(self) -> None:
        values = self._values
        fn = self._fn
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            if self._error is not None:
                continue
            try:
                for slot, data in batch:
                    if type(data) is list:  # several buffers in order, one running checksum
                        v = values[slot]
                        for part in data:
                            v = fn(part, v)
                        values[slot] = v
                    else:
                        values[slot] = fn(data, values[slot])
            except BaseException as e:  # noqa: BLE001 - re-raised in results()
                self._error = e

    def submit(self, batch: Sequence[tuple[int, Any]]) -> None:
        """Queue ``(slot, bytes-like)`` pairs (or ``(slot, [bytes-like, ...])``: several in
        order); each continues that slot's checksum."""
        self._queue.put(list(batch))

    def results(self) -> list[int]:
        """Wait for all queued work; the checksum of every slot."""
        self.close()
        if self._error is not None:
            raise self._error
        return self._values

    def close(self) -> None:
        """Stop the worker after the queued work (idempotent)."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()

    def __enter__(self) -> Checksummer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
