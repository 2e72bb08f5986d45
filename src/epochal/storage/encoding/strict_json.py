"""JSON from files for load paths: duplicate keys refused, parse memory bounded up front.

Python's ``json`` keeps the last of duplicate keys (so two readers of one forged text could
disagree) and a text of ``[[],[],...]`` takes ~30 times its length in memory once parsed.
:func:`loads` refuses both before anything is built: it counts the values a text can hold
(a C-speed scan of ``[ { , :``) and refuses when parsing could take more than
:data:`JSON_BUDGET` bytes.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["JSON_BUDGET", "VALUE_BYTES", "loads"]

#: the most memory the parse of one JSON text on a load path may take (refused above)
JSON_BUDGET = 256 << 20
#: an upper bound of the memory one parsed JSON value takes (an empty dict: 64 bytes + its slot)
VALUE_BYTES = 80


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r}")
            seen.add(k)
    return out


_CHUNK = 1 << 20


def parse_cost(text: bytes | memoryview | str) -> int:
    """An upper bound of the bytes ``json.loads(text)`` allocates (its text copy included),
    counted without copying more than 1 MiB of ``text`` at a time."""
    if isinstance(text, str):
        return parse_cost(memoryview(text.encode("utf-8", "surrogatepass")))
    mv = memoryview(text)
    values = 1
    for i in range(0, len(mv), _CHUNK):
        b = mv[i : i + _CHUNK].tobytes() if not isinstance(text, bytes) or len(mv) > _CHUNK else text
        values += b.count(b"[") + b.count(b"{") + b.count(b",") + b.count(b":")
    return 2 * len(mv) + VALUE_BYTES * values


def loads(text: bytes | memoryview | str, budget: int = JSON_BUDGET) -> Any:
    """``json.loads(text)``, refusing duplicate keys and texts whose parse could take more
    than ``budget`` bytes (checked before ``text`` is copied or parsed): ValueError
    (RecursionError for absurd nesting) saying which."""
    if len(text) * 2 > budget or parse_cost(text) > budget:
        raise ValueError(f"JSON of {len(text)} bytes could take more than {budget >> 20} MiB to parse")
    if isinstance(text, memoryview):
        text = text.tobytes()
    return json.loads(text, object_pairs_hook=_no_duplicates)
