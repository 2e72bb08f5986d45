"""Sessions: what runs task groups on nodes."""

from .base import CompiledRunnable, Session
from .local import LocalSession

__all__ = ["CompiledRunnable", "LocalSession", "Session"]
