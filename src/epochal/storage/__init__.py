"""Storage: how values become bytes (codecs, trees), the db formats, and the byte I/O under them.

Importing the package registers the tree codec (state dicts and containers of values), so
:mod:`.codecs` needs no reference back to :mod:`.tree`.
"""

from __future__ import annotations

from . import tree as _tree  # noqa: F401 - registers TreeCodec
