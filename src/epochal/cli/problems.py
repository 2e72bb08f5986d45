"""The one kind of failure the commands report: a :class:`Problem`, one line naming the
file or blob at fault (exit code 1)."""

from __future__ import annotations

from ..storage.formats.base import error_line as one_line

__all__ = ["Problem", "one_line"]


class Problem(Exception):
    """A problem the user must hear about in one line (exit code 1): a missing or damaged
    file, something that is not a checkpoint, an unknown blob."""
