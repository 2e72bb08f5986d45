"""The ``native`` db_type: epochal's own checkpoint file format (see docs/format.md).

One file per (node, epoch)::

    [superblock: 64 bytes] [segment 0][pad] [segment 1][pad] ... [index]

* Blob data is written raw, straight from the arrays' memory, each segment starting at a
  multiple of 64 bytes, so a reader can ``readinto`` a fresh array or memory-map it.
* The index at the end holds fixed-size binary tables (blobs, segments, a name-sorted
  permutation for bisection) plus a names heap and one compact JSON array of the distinct
  ``[kind, meta]`` pairs. Nothing is ever pickled or evaluated.
* Every byte of the file is covered by a checksum (CRC-32C, or zlib CRC-32 when the crc32c
  package is missing; the algorithm is recorded): the superblock's own, the index's, and one
  per segment (covering its padding too). Data checksums are computed on a background thread
  overlapped with the disk I/O.
* Files are written under a temp name, fsynced and renamed into place, through the byte
  store of :mod:`epochal.storage.io` (local: :mod:`epochal.storage.io.atomic`).

Modules: :mod:`.layout` (the spec in code: constants, tables, superblock), :mod:`.index`
(parsing and validation from bytes alone), :mod:`.writer` (planning and streamed writes),
:mod:`.reader` (open, resolve, allocate, choose a read path, decode), the read paths in
:mod:`.reads` (one module each: :mod:`.reads.batch`, :mod:`.reads.inplace`,
:mod:`.reads.parallel`, :mod:`.reads.fill`, :mod:`.reads.mapped`, :mod:`.reads.coded`, and
:mod:`.reads.ranges` for byte ranges of one blob), :mod:`.items` (the typed items the phases
pass) and :mod:`.backend`. Tuning thresholds are in
:mod:`epochal.storage.io.tuning`, the I/O machinery in :mod:`epochal.storage.io`.

Public entry points: :class:`NativeBackend` (registered as ``db_type="native"``),
:func:`open_native` (a lazy, optionally memory-mapped reader for inspection and partial
loads) and :func:`stat_native` (a header-only summary).
"""

from __future__ import annotations

from .backend import NativeBackend
from .layout import FORMAT_MAJOR, FORMAT_MINOR, MAGIC, NativeStat
from .reader import NativeFile, open_native, stat_native
from .write import write_native

__all__ = [
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "MAGIC",
    "NativeBackend",
    "NativeFile",
    "NativeStat",
    "open_native",
    "stat_native",
    "write_native",
]
