"""Byte I/O under the formats: the byte-store seam (:mod:`.seam`), the local file as its
first store (:mod:`.local`, with O_DIRECT writes in :mod:`.direct`), object storage through
fsspec (:mod:`.remote`: its byte store, uploads, compare-and-swap of small objects),
atomic writes (:mod:`.atomic`), checksums (:mod:`.checksum`, its combination), exact and
prefetched reads (:mod:`.reads`), the read paths' threads (:mod:`.threads`), progress
reports and the I/O thresholds (:mod:`.tuning`). Formats reach bytes only through these."""

from __future__ import annotations

from .seam import ByteSink, ByteSource, ByteStore, committed, register_store, store_for

__all__ = ["ByteSink", "ByteSource", "ByteStore", "committed", "register_store", "store_for"]
