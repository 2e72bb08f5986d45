"""The Checkpointer: epochal's checkpoints for a training loop you already have (see
:mod:`.core`); under torch.distributed it holds the part that saves across ranks."""

from .core import Checkpointer
from .parts import RestoreReport

__all__ = ["Checkpointer", "RestoreReport"]
