"""Retention by reference: which db files kept steps still take bytes from.

An incremental step's db references stored bytes of older steps' dbs
(:mod:`epochal.storage.io.extents`). Deleting a step deletes its manifest, but a db file of
it that a kept step references stays until no kept step does; it is then a leftover of an
epoch without a manifest, removed by a later retention pass (docs/reliability.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ...storage.io.extents import referenced_files

__all__ = ["referenced"]


def referenced(paths: Iterable[str]) -> set[str] | None:
    """The file names that the dbs at ``paths`` (those of the kept epochs) reference; None
    when one of them cannot be read (its references are unknown: nothing may be deleted
    then). The paths are the kept epochs' db names, not a listing of the folder: a listing
    at a URL may lag behind the newest upload."""
    names: set[str] = set()
    for path in paths:
        refs = referenced_files(path)
        if refs is None:
            return None
        names.update(refs)
    return {os.path.basename(n) for n in names}
