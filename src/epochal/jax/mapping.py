"""A user's name mapping between a pytree's leaves and a checkpoint's names (a torch state's).

Where a pytree is not nested dicts of the torch names (flax's ``{"params": {"Dense_0":
{"kernel": ...}}}`` against torch's ``{"model": {"fc.weight": ...}}``), ``names=`` maps each
leaf to the stored name it is saved under or restored from:

* a dict: key a leaf's path, written ``params/Dense_0/kernel``, ``params.Dense_0.kernel``
  or as ``jax.tree_util.keystr`` gives it (``['params']['Dense_0']['kernel']``); value the
  stored name, levels of nested dicts joined by ``/`` (``model/fc.weight``: the blob
  ``model``, a tree whose key ``fc.weight`` holds it) or a tuple of the levels. A leaf the
  dict does not name keeps its own names; a key that names no leaf is an error (a typo
  would otherwise leave a leaf unmapped);
* a callable: the leaf's path (``params/Dense_0/kernel``) -> the stored name, or None to
  keep its own.

A value wrapped in :func:`transposed` says the stored array is the leaf's transpose (numpy's
``.T``: every axis reversed; torch's ``Linear.weight`` is ``(out, in)``, a flax ``Dense``
kernel ``(in, out)``): a restore reads the transposed region and transposes it, a save
stores the transpose. Nothing is ever transposed unless the mapping says so: an array whose
stored shape is the reverse of the wanted one is refused, naming the leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .names import Leaf, leaf_label

__all__ = ["NameMap", "Target", "Transposed", "map_leaves", "transposed"]


@dataclass(frozen=True)
class Transposed:
    """A stored name whose array is the leaf's transpose (see :func:`transposed`)."""

    name: str | tuple[str, ...]


def transposed(name: str | tuple[str, ...]) -> Transposed:
    """``names={"params/Dense_0/kernel": transposed("model/fc.weight")}``: the stored array
    is the leaf's ``.T`` (every axis reversed)."""
    return Transposed(name)


#: a value of a mapping: a stored name, its levels, or one of those transposed
NameValue = str | tuple[str, ...] | Transposed
#: the ``names=`` argument of ``save`` and ``restore``
NameMap = Mapping[str, NameValue] | Callable[[str], NameValue | None]


@dataclass(frozen=True)
class Target:
    """Where one leaf is stored: ``names`` (blob name first) and whether it is transposed.
    ``label`` names the leaf in messages: its own path, and the stored name when mapped."""

    names: tuple[str, ...]
    transpose: bool
    label: str


def _stored(value: Any, leaf: str) -> tuple[tuple[str, ...], bool]:
    transpose = isinstance(value, Transposed)
    if transpose:
        value = value.name
    if isinstance(value, str):
        parts = tuple(value.split("/"))
    elif isinstance(value, tuple) and all(isinstance(p, str) for p in value):
        parts = value
    else:
        raise TypeError(f"names: leaf {leaf} maps to {value!r}, not a str, a tuple of str "
                        "or epochal.jax.transposed(...)")
    if not parts or any(not p for p in parts):
        raise ValueError(f"names: leaf {leaf} maps to {value!r}, which has an empty level")
    return parts, transpose


def _spellings(names: Sequence[str], keystr: str) -> tuple[str, ...]:
    return (leaf_label(names), ".".join(names), keystr)


def map_leaves(leaves: Sequence[Leaf], keystrs: Sequence[str], names: NameMap | None) -> list[Target]:
    """The stored names of each leaf under ``names`` (see the module doc). ``keystrs``: each
    leaf's ``jax.tree_util.keystr``. ValueError for a key naming no leaf, a key naming one
    leaf twice, or two leaves stored under one name; TypeError for a bad value."""
    out: list[Target] = []
    used: set[str] = set()
    for (leaf_names, _), ks in zip(leaves, keystrs):
        label = leaf_label(leaf_names)
        if names is None:
            value = None
        elif callable(names) and not isinstance(names, Mapping):
            value = names(label)
        else:
            hits = [s for s in dict.fromkeys(_spellings(leaf_names, ks)) if s in names]
            if len(hits) > 1:
                raise ValueError(f"names: leaf {label} is named twice ({', '.join(map(repr, hits))})")
            used.update(hits)
            value = names[hits[0]] if hits else None
        if value is None:
            out.append(Target(tuple(leaf_names), False, label))
            continue
        stored, transpose = _stored(value, label)
        shown = leaf_label(stored) + (", transposed" if transpose else "")
        out.append(Target(stored, transpose, label if stored == tuple(leaf_names) and not transpose
                          else f"{label} (stored as {shown})"))
    if isinstance(names, Mapping):
        unknown = sorted(set(names) - used)
        if unknown:
            raise ValueError("names: no leaf of the pytree is named " + ", ".join(map(repr, unknown)))
    seen: dict[tuple[str, ...], str] = {}
    for t in out:
        if t.names in seen:
            raise ValueError(f"names: leaves {seen[t.names]} and {t.label} are both stored as "
                             f"{leaf_label(t.names)}")
        seen[t.names] = t.label
    return out
