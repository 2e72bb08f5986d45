"""Integrations with other libraries, each imported only when needed.

* :mod:`epochal.integrations.rng`: :class:`RNGState`, the random generators' state as a
  stateful blob (no torch needed).
* :mod:`epochal.integrations.torch`: torch tensor codecs; imported lazily by the codec registry
  the first time a torch value or a ``torch.*`` blob appears, never by ``import epochal``.
"""

from __future__ import annotations

from .rng import RNGState

__all__ = ["RNGState"]
