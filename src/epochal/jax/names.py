"""Where each leaf of a pytree is stored, and which dtypes cross between frameworks.

A pytree is stored as nested dicts of str keys, one level per step of each leaf's
``jax.tree_util`` key path: a dict key that is a str stays itself (``{"params": {"w": x}}``
is stored exactly as a torch state ``{"params": {"w": tensor}}``: the blob ``params``, a tree
whose key ``w`` holds the tensor), any other step is named by ``jax.tree_util.keystr`` of it
alone (``[0]`` for a list or tuple index or an int dict key, ``.mu`` for a named tuple's
field). The top level's names are the Checkpointer's blob names. Restores compute the same
names from the abstract pytree, so no structure is stored apart from the names.

Array leaves are stored as the tensor records torch writes (kind ``torch.tensor``: raw
little-endian bytes, the dtype by torch's name, the shape), so a PyTorch Checkpointer
restores them with no mapping. :data:`DTYPES` lists the dtypes both sides know (bf16 and
the float8s through ``ml_dtypes``, same bits as torch's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from ..errors import UnsupportedBlobError

__all__ = ["DTYPES", "Leaf", "dtype_by_name", "dtype_name", "flat_leaves", "leaf_label", "nest"]

#: torch dtype name -> numpy dtype (ml_dtypes for the ones numpy lacks)
DTYPES: dict[str, np.dtype] = {
    **{n: np.dtype(n) for n in (
        "float16", "float32", "float64", "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128",
    )},
    **{n: np.dtype(getattr(ml_dtypes, n)) for n in (
        "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )},
}

#: one leaf: its stored names (blob name first) and its value or abstract value
Leaf = tuple[tuple[str, ...], Any]


def dtype_name(dt: Any, label: str) -> str:
    """torch's name of numpy/JAX dtype ``dt``; UnsupportedBlobError naming ``label`` if none."""
    dt = np.dtype(dt)
    if dt.name in DTYPES and DTYPES[dt.name] == dt:
        return dt.name
    raise UnsupportedBlobError(f"leaf {label}: dtype {dt} has no PyTorch equivalent "
                               f"(stored dtypes: {', '.join(sorted(DTYPES))})")


def dtype_by_name(name: Any) -> np.dtype | None:
    """The numpy dtype of a stored torch dtype name; None for a name not in :data:`DTYPES`."""
    return DTYPES.get(name) if isinstance(name, str) else None


def _part(key: Any) -> str:
    if isinstance(key, jax.tree_util.DictKey) and isinstance(key.key, str):
        return key.key
    return jax.tree_util.keystr((key,))


def leaf_label(names: Sequence[str]) -> str:
    """A leaf's names as one readable path: ``params/w``."""
    return "/".join(names)


def flat_leaves(tree: Any) -> list[Leaf]:
    """Every leaf of ``tree`` with its stored names (see the module doc), in jax's order.
    ValueError for a bare leaf (no names) or two leaves under one name."""
    out: list[Leaf] = []
    seen: set[tuple[str, ...]] = set()
    for path, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = tuple(_part(k) for k in path)
        if not names:
            raise ValueError("the pytree must be a container (a dict, list, ...), not a bare leaf")
        if names in seen:
            raise ValueError(f"two leaves of the pytree are named {leaf_label(names)!r}")
        seen.add(names)
        out.append((names, value))
    return out


def nest(leaves: Sequence[Leaf]) -> dict[str, Any]:
    """The nested dicts of str keys holding each leaf's value at its names."""
    root: dict[str, Any] = {}
    for names, value in leaves:
        d = root
        for i, p in enumerate(names[:-1]):
            sub = d.setdefault(p, {})
            if not isinstance(sub, dict):
                raise ValueError(f"leaf {leaf_label(names[: i + 1])!r} is also a container")
            d = sub
        if names[-1] in d:
            raise ValueError(f"leaf {leaf_label(names)!r} is also a container")
        d[names[-1]] = value
    return root
