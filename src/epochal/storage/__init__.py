"""Storage, bottom up: byte I/O (:mod:`.io`), how values become bytes (:mod:`.encoding`), and
the db formats (:mod:`.formats`).

Importing the package registers the tree codec (state dicts and containers of values), so
:mod:`.encoding.codecs` needs no reference back to :mod:`.encoding.tree`.
"""

from __future__ import annotations

from .encoding import tree as _tree  # noqa: F401 - registers TreeCodec
