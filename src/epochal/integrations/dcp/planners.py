"""DCP planners whose non-tensor items never go through pickle.

DCP's :class:`DefaultSavePlanner` turns each non-tensor value into ``torch.save`` bytes and
:class:`DefaultLoadPlanner` reads them back with ``torch.load(weights_only=False)``. With
epochal's storage the value itself goes to the storage writer, which encodes it with
epochal's codecs (an int, a str, a list or dict of plain values, a numpy array; anything
else raises :class:`~epochal.errors.UnsupportedBlobError` naming it), and the reader hands
the decoded value back through :func:`set_value`. The storage plugin does this for DCP's
default planners too (they are what ``dcp.save``/``dcp.load`` use when given none); these
subclasses only make it explicit.
"""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import (
    LoadPlanner,
    ReadItem,
    SavePlanner,
    WriteItem,
    WriteItemType,
)

from ...errors import UnsupportedBlobError

__all__ = ["EpochalLoadPlanner", "EpochalSavePlanner", "Whole", "item_value", "set_value"]


class Whole:
    """A value DCP must treat as one non-tensor item (not flatten it into its dict keys or
    list entries): the storage writer stores ``value`` as one blob with epochal's codecs (a
    state dict with tensors in it included); on load the decoded value replaces the wrapper."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Whole({type(self.value).__name__})"


class EpochalSavePlanner(DefaultSavePlanner):
    """:class:`DefaultSavePlanner` whose non-tensor items are the values themselves (for
    epochal's codecs), not ``torch.save`` bytes."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        return object


class EpochalLoadPlanner(DefaultLoadPlanner):
    """:class:`DefaultLoadPlanner` that takes decoded non-tensor values (:meth:`load_value`)
    and refuses pickled bytes."""

    def load_value(self, read_item: ReadItem, value: Any) -> None:
        """Put the decoded value of a non-tensor item into the state dict being loaded."""
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], value)
        else:
            self.state_dict[fqn] = value

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise UnsupportedBlobError(
            f"DCP item {read_item.dest_index.fqn!r}: EpochalLoadPlanner does not unpickle bytes"
        )


def item_value(planner: SavePlanner, item: WriteItem) -> Any:
    """The value of a non-tensor item to encode: the object itself for DCP's default planner
    (its ``lookup_object``, skipping the ``torch.save``) and ours; a planner that hands back
    ``torch.save`` bytes (another subclass) is refused, naming the item."""
    assert item.type == WriteItemType.BYTE_IO
    if isinstance(planner, DefaultSavePlanner) and (
        isinstance(planner, EpochalSavePlanner)
        or type(planner).transform_object is DefaultSavePlanner.transform_object
    ):
        value = planner.lookup_object(item.index)
        return value.value if isinstance(value, Whole) else value
    value = planner.resolve_data(item)
    if isinstance(value, Whole):
        return value.value
    if isinstance(value, io.BytesIO):
        raise UnsupportedBlobError(
            f"DCP item {item.index.fqn!r}: the planner {type(planner).__name__} turned it into "
            "pickled (torch.save) bytes, which epochal does not store: use "
            "epochal.integrations.dcp.EpochalSavePlanner or return the value itself"
        )
    return value


def set_value(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    """Hand the decoded value of a non-tensor item to ``planner``: its ``load_value`` (ours),
    or for DCP's default planner the same thing done on its state dict, never ``torch.load``."""
    load_value = getattr(planner, "load_value", None)
    if callable(load_value):
        load_value(item, value)
        return
    if isinstance(planner, DefaultLoadPlanner) and type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        EpochalLoadPlanner.load_value(planner, item, value)  # type: ignore[arg-type]
        return
    raise UnsupportedBlobError(
        f"DCP item {item.dest_index.fqn!r}: the planner {type(planner).__name__} takes pickled bytes "
        "(load_bytes); epochal stores values, not pickles: use "
        "epochal.integrations.dcp.EpochalLoadPlanner or give the planner a load_value(read_item, value)"
    )
