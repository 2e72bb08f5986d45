"""An Orbax handler: epochal's checked, pickle-free files under an Orbax ``CheckpointManager``.

For a loop that keeps Orbax's manager (its step directories, retention, async saves) and
changes one line::

    mngr.save(step, args=EpochalSave(pytree))
    tree = mngr.restore(step, args=EpochalRestore(abstract_pytree))

(``names=`` on either, as :func:`epochal.jax.restore` takes it: a flax pytree against a
torch state's names.)

:class:`EpochalCheckpointHandler` is an Orbax v0 ``AsyncCheckpointHandler``; the args are
registered with it (``ocp.args.register_with_handler``), so the manager finds it by the args'
type. A save copies every array to host before it returns (the training loop may then
change or donate its buffers), and its commit future writes an epochal checkpoint (step 0 of
a :class:`~epochal.Checkpointer`, the ``local.0`` db and its manifest) inside the item
directory Orbax gives; Orbax then finalizes its step as usual. A restore is
:func:`epochal.jax.restore` of that directory: only each shard's rows read,
every range checked.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orbax.checkpoint as ocp

from ..checkpointer import Checkpointer
from .api import DEFAULT_CHUNK, host_state, restore
from .mapping import NameMap

__all__ = ["EpochalCheckpointHandler", "EpochalRestore", "EpochalSave"]

#: the step of the one epochal checkpoint inside an Orbax item directory
STEP = 0


class EpochalCheckpointHandler(ocp.handlers.AsyncCheckpointHandler):  # type: ignore[misc]
    """Saves and restores a pytree as an epochal checkpoint in Orbax's item directory."""

    def _write(self, directory: str, state: dict[str, Any]) -> None:
        with Checkpointer(directory, progress=False) as ckpt:
            ckpt.save(STEP, state)

    async def async_save(self, directory: Any, args: EpochalSave | None = None) -> list[Any]:
        """Copies the pytree to host now; the returned commit future writes it."""
        if args is None:
            raise ValueError("EpochalCheckpointHandler saves with args=EpochalSave(pytree)")
        state = host_state(args.item, args.names, copy=True)

        async def write() -> None:
            await asyncio.to_thread(self._write, str(directory), state)

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="epochal_save")]

    def save(self, directory: Any, args: EpochalSave | None = None) -> None:
        """:meth:`async_save`, waited for."""
        async def run() -> None:
            for fut in await self.async_save(directory, args):
                fut.result()

        asyncio.run(run())

    def restore(self, directory: Any, args: EpochalRestore | None = None) -> Any:
        """The pytree of ``args.item``'s structure (see :func:`epochal.jax.restore`)."""
        if args is None or args.item is None:
            raise ValueError("EpochalCheckpointHandler restores with args=EpochalRestore(abstract_pytree)")
        return restore(str(directory), args.item, STEP, chunk_bytes=args.chunk_bytes, partial=args.partial,
                       names=args.names)

    def metadata(self, directory: Any) -> None:
        """No tree metadata: the abstract pytree of a restore says what is wanted."""
        return None

    def finalize(self, directory: Any) -> None:
        """Nothing: the epochal checkpoint is committed by the save's future."""

    def close(self) -> None:
        """Nothing to release."""


@ocp.args.register_with_handler(EpochalCheckpointHandler, for_save=True)
@dataclasses.dataclass
class EpochalSave(ocp.args.CheckpointArgs):  # type: ignore[misc]
    """Save ``item`` (a pytree) as an epochal checkpoint; ``names``: where each leaf is
    stored, as :func:`~epochal.jax.save` takes it (default: under its own names)."""

    item: Any
    names: NameMap | None = None


@ocp.args.register_with_handler(EpochalCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class EpochalRestore(ocp.args.CheckpointArgs):  # type: ignore[misc]
    """Restore the pytree of ``item``'s structure (``jax.ShapeDtypeStruct`` leaves with their
    target shardings); ``chunk_bytes``, ``partial`` and ``names`` (where each leaf is
    stored: a torch state's names, say) as in :func:`~epochal.jax.restore`."""

    item: Any = None
    chunk_bytes: int = DEFAULT_CHUNK
    partial: bool = False
    names: NameMap | None = None
