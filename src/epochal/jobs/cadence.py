"""When to checkpoint: durations such as ``"30m"`` and the every-K / every-T test."""

from __future__ import annotations

import math
import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)")


def parse_interval(value: float | int | str) -> float:
    """Seconds in ``value``: a number of seconds, or a string such as ``"90s"``, ``"30m"``,
    ``"1.5h"``, ``"1h30m"``, ``"2d"``, ``"500ms"``. ValueError for anything else, or a
    duration that is not positive and finite."""
    if isinstance(value, bool):
        raise ValueError(f"an interval must be seconds or a string like '30m', not {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        pos, seconds = 0, 0.0
        for m in _PART.finditer(text):
            if m.start() != pos and text[pos:m.start()].strip():
                break
            seconds += float(m.group(1)) * _UNITS[m.group(2)]
            pos = m.end()
        if not text or text[pos:].strip() or pos == 0:
            raise ValueError(f"cannot read the interval {value!r} (write it like '90s', '30m', '1h30m')")
    else:
        raise ValueError(f"an interval must be seconds or a string like '30m', not {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"an interval must be positive, got {value!r}")
    return seconds


def is_due(step: int, every: int | None, interval_s: float | None, elapsed_s: float) -> bool:
    """Whether step ``step`` should be checkpointed: it is a multiple of ``every``, or
    ``elapsed_s`` (since the last save) reached ``interval_s``; with neither set, always."""
    if every is None and interval_s is None:
        return True
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        if step % every == 0:
            return True
    return interval_s is not None and elapsed_s >= interval_s
