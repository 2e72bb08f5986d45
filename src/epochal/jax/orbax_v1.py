"""An Orbax v1 handler: epochal's checked, pickle-free files for one checkpointable of
``ocp.save_checkpointables`` / ``ocp.load_checkpointables`` (Orbax's v1 API, which Orbax
ships as ``orbax.checkpoint.experimental.v1``: its interface may still change).

:class:`EpochalHandler` is a v1 ``CheckpointableHandler`` for a pytree (``jax.Array``,
numpy and plain leaves). Register it for a checkpointable's name, in a local registry::

    ctx = ocp.Context()
    ctx.checkpointables.registry = local_registry("state")  # "state": ocp.save's checkpointable
    with ctx:
        ocp.save(path, pytree)
        tree = ocp.load_checkpointables(path, {"state": abstract_pytree})["state"]

(:func:`local_registry`: Orbax's global registry with that name's entry replaced) or globally with
``ocp.handlers.register_handler(EpochalHandler, checkpointable_name="state")``; with a name
mapping (as :func:`epochal.jax.restore` takes it), ``local_registry("state", names=...)`` or
``EpochalHandler.with_names(names)`` in place of ``EpochalHandler``. Registered
without a name it would take every pytree Orbax saves (the newest handler that accepts an
object wins), so a name is asked for. Load with ``ocp.load_checkpointables`` (``ocp.load``
looks for Orbax's own pytree files before it asks a handler). A save copies every array to host before it returns
and writes an epochal checkpoint (step 0 of a :class:`~epochal.Checkpointer`: ``local.0``
and its manifest) into the checkpointable's directory in Orbax's background; a load is
:func:`epochal.jax.restore` of that directory (``abstract_checkpointable``: the pytree
wanted, with the target shardings; None: every stored leaf, as nested dicts of the stored
names, arrays on the first device).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import jax
import numpy as np
from orbax.checkpoint.experimental import v1 as ocp

from ..checkpointer import Checkpointer
from .api import host_state, restore
from .mapping import NameMap
from .names import flat_leaves, nest
from .sources import LocalSource

__all__ = ["EpochalHandler", "local_registry"]

#: the step of the one epochal checkpoint inside a checkpointable's directory
STEP = 0


def _write(directory: str, state: dict[str, Any]) -> None:
    with Checkpointer(directory, progress=False) as ckpt:
        ckpt.save(STEP, state)


class EpochalHandler(ocp.handlers.CheckpointableHandler):  # type: ignore[misc]
    """Saves and loads a pytree as an epochal checkpoint (see the module doc)."""

    #: the name mapping of its saves and loads, in a tuple (:meth:`with_names`)
    _names: tuple[NameMap | None] = (None,)

    @classmethod
    def with_names(cls, names: NameMap | None) -> type[EpochalHandler]:
        """This handler with a name mapping (as :func:`epochal.jax.restore` takes it) for
        its saves and loads: a subclass, since Orbax registers handler types. It keeps the
        name Orbax records for a handler, so either one loads what the other saved."""
        return type(cls.__name__, (cls,), {"_names": (names,), "__qualname__": cls.__qualname__,
                                           "__module__": cls.__module__, "__doc__": cls.__doc__})

    @property
    def names(self) -> NameMap | None:
        """The name mapping of this handler's saves and loads (None: none)."""
        return self._names[0]

    async def save(self, directory: Any, checkpointable: Any) -> Awaitable[None]:
        """Copies the pytree to host now; the awaitable returned writes it once Orbax has
        created ``directory``."""
        state = host_state(checkpointable, self.names, copy=True)

        async def write() -> None:
            path = await directory.await_creation()
            await asyncio.to_thread(_write, str(path), state)

        return write()

    async def load(self, directory: Any, abstract_checkpointable: Any = None) -> Awaitable[Any]:
        """The pytree of ``abstract_checkpointable``'s structure (None: :meth:`metadata`'s),
        read by :func:`epochal.jax.restore` in Orbax's background."""
        abstract = abstract_checkpointable
        if abstract is None:
            abstract = await self.metadata(directory)

        async def read() -> Any:
            return await asyncio.to_thread(restore, str(directory), abstract, STEP, names=self.names)

        return read()

    async def metadata(self, directory: Any) -> Any:
        """The stored pytree as nested dicts of the stored names (not mapped): a ``jax.ShapeDtypeStruct``
        for each array, the value of each plain leaf (the db checked as for a restore)."""
        src = LocalSource(f"{str(directory).rstrip('/')}/local.{STEP}")
        try:
            leaves = []
            for key in src.keys():
                layout = src.layout(key, "/".join(key))
                value = (jax.ShapeDtypeStruct(layout[1], layout[0]) if layout is not None
                         else src.plain(key, "/".join(key)))
                leaves.append((key, value))
        finally:
            src.close()
        return nest(leaves)

    def is_handleable(self, checkpointable: Any) -> bool:
        """A pytree whose leaves are arrays and plain values (a container, not a bare leaf)."""
        return _pytree_of(checkpointable, (jax.Array, np.ndarray))

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        """An abstract pytree: ``jax.ShapeDtypeStruct``, array and plain leaves."""
        return _pytree_of(abstract_checkpointable, (jax.ShapeDtypeStruct, jax.Array, np.ndarray))


def _pytree_of(tree: Any, arrays: tuple[type, ...]) -> bool:
    try:
        leaves = flat_leaves(tree)
    except (ValueError, TypeError):
        return False
    return all(isinstance(v, (*arrays, np.generic, int, float, str, bool)) for _, v in leaves)


def local_registry(checkpointable_name: str = "state", names: NameMap | None = None) -> Any:
    """A local Orbax v1 registry where ``checkpointable_name`` is handled by
    :class:`EpochalHandler` (with the name mapping ``names``: :meth:`~EpochalHandler.with_names`)
    and everything else as by the global registry. The default ``"state"`` is the
    checkpointable of ``ocp.save``, which Orbax's global registry gives its PyTreeHandler:
    this registry replaces that entry."""
    registry = ocp.handlers.local_registry(include_global_registry=False)
    registry.add(EpochalHandler if names is None else EpochalHandler.with_names(names),
                 checkpointable_name=checkpointable_name)
    glob = ocp.handlers.global_registry()
    for handler, name in glob.get_all_entries():
        if name != checkpointable_name:
            registry.add(handler, checkpointable_name=name, secondary_typestrs=glob.get_secondary_typestrs(handler))
    return registry
