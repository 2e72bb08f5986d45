"""Retention by reference: which db files kept steps still take bytes from.

An incremental step's db references stored bytes of older steps' dbs
(:mod:`epochal.storage.io.extents`). Deleting a step deletes its manifest, but a db file of
it that a kept step references stays until no kept step does; it is then a leftover of an
epoch without a manifest, removed by a later retention pass (docs/reliability.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from ...storage.io.extents import referenced_files

__all__ = ["referenced"]


def referenced(scanned: Mapping[int, Mapping[str, str]], kept: Iterable[int], after: int) -> set[str] | None:
    """The file names that the dbs of the ``kept`` epochs newer than ``after`` reference
    (references only point to older steps); None when one of those dbs cannot be read (its
    references are unknown: nothing may be deleted then)."""
    names: set[str] = set()
    for epoch in kept:
        if epoch <= after:
            continue
        for path in scanned.get(epoch, {}).values():
            refs = referenced_files(path)
            if refs is None:
                return None
            names.update(refs)
    return {os.path.basename(n) for n in names}
