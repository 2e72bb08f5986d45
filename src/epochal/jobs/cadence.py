"""When to checkpoint: every K epochs (or steps) and/or once enough time has passed.

The final epoch and a preempted one are always saved; that is the runner's business, not
the cadence's. ``Cadence.due`` only answers for an ordinary epoch.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([smhd])")


def parse_interval(value: float | int | str | None) -> float | None:
    """Seconds from ``value``: a number of seconds, or a string such as ``"90s"``, ``"30m"``,
    ``"1h30m"``, ``"2d"`` (None stays None). ValueError naming the value otherwise."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"save interval {value!r} is not a duration")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            parts = _PART.findall(text)
            if not parts or _PART.sub("", text).strip():
                raise ValueError(
                    f"save interval {value!r} is not a duration (say e.g. '90s', '30m', '1h30m')"
                ) from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise ValueError(f"save interval {value!r} is not a duration")
    if not seconds > 0:
        raise ValueError(f"save interval {value!r} must be positive")
    return seconds


@dataclass
class Cadence:
    """Save every ``every`` epochs and/or once ``interval`` seconds have passed since the last
    save, whichever comes first. Neither given: every epoch."""

    every: int | None = None
    interval: float | None = None
    _last: float = field(default_factory=time.monotonic, repr=False)

    def __post_init__(self) -> None:
        if self.every is not None and (isinstance(self.every, bool) or int(self.every) != self.every
                                       or self.every < 1):
            raise ValueError(f"save_every must be a positive integer, got {self.every!r}")
        self.interval = parse_interval(self.interval)

    def due(self, epoch: int, now: float | None = None) -> bool:
        """Whether ``epoch`` should be saved (an ordinary one: not the last, not preempted)."""
        if self.every is None and self.interval is None:
            return True
        if self.every is not None and epoch % self.every == 0:
            return True
        if self.interval is not None:
            now = time.monotonic() if now is None else now
            return now - self._last >= self.interval
        return False

    def saved(self, now: float | None = None) -> None:
        """A checkpoint was just saved: the interval starts again."""
        self._last = time.monotonic() if now is None else now
