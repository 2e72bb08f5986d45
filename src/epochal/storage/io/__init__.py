"""Byte I/O under the formats: the byte-store seam (:mod:`.seam`), the local file as its
first store (:mod:`.local`), exact and prefetched reads (:mod:`.reads`) and the threads of
the read paths (:mod:`.threads`). Formats reach bytes only through these modules."""

from __future__ import annotations

from .seam import ByteSink, ByteSource, ByteStore, committed, register_store, store_for

__all__ = ["ByteSink", "ByteSource", "ByteStore", "committed", "register_store", "store_for"]
