"""The Checkpointer under ``torch.distributed``: every rank saves its shards, one commit.

Modules: :mod:`.world` (which Checkpointer a process needs, decided without importing torch),
:mod:`.checkpointer` (:class:`DistributedCheckpointer`: collective saves and restores through
DCP), :mod:`.state` (what of the state goes to DCP, under which key) and :mod:`.tier` (each
rank's local tier and its peers' copies). The small collectives the ranks agree by are in
:mod:`epochal.integrations.ranks`, shared with the DCP storage layer.

Importing this package imports no torch: :class:`DistributedCheckpointer` and
:func:`process_world` load :mod:`.checkpointer` on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checkpointer import DistributedCheckpointer, process_world

__all__ = ["DistributedCheckpointer", "process_world"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
