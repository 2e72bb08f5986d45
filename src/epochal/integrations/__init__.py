"""Integrations with other libraries, each imported only when needed.

* :mod:`epochal.integrations.rng`: :class:`RNGState`, the random generators' state as a
  stateful blob (no torch needed).
* :mod:`epochal.integrations.torch`: torch tensor codecs; imported lazily by the codec registry
  the first time a torch value or a ``torch.*`` blob appears, never by ``import epochal``.
* :mod:`epochal.integrations.torch_data`: :class:`ResumableSampler`, the data position as
  state (also ``epochal.integrations.torch.ResumableSampler``).
* :mod:`epochal.integrations.safetensors_export`: ``export_safetensors``, one state dict out
  of a checkpoint for tools that read safetensors.
* :mod:`epochal.integrations.lightning`: ``EpochalCheckpointIO``, Lightning's checkpoint files
  as native dbs (imports lightning: import it yourself).
"""

from __future__ import annotations

from .rng import RNGState

__all__ = ["RNGState"]
