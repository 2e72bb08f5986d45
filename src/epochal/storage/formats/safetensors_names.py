"""How the ``safetensors`` db_type names the torch tensors of a blob as real tensors: the blob
itself (a tensor blob) or the tensor leaves of its state dict, ``<blob>/<key path>``
(``model/fc.weight``, ``opt/state/0/exp_avg``), with their safetensors dtype and shape. The
writer names them so; the reader checks the header against the same names."""

from __future__ import annotations

from typing import Any

__all__ = ["TORCH_DTYPES", "named_tensors"]


#: torch dtype name (a ``torch.tensor`` codec meta's ``dtype``) -> safetensors dtype name
TORCH_DTYPES: dict[str, str] = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "int32": "I32",
    "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16", "bfloat16": "BF16",
    "float32": "F32", "float64": "F64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}


def _leaf_names(root: Any, nleaves: int) -> list[str | None]:
    """For each leaf of a tree blob's skeleton (see :mod:`epochal.storage.encoding.skeleton`), the
    key path where it is first met (``"fc.weight"``, ``"state/0/exp_avg"``); None for a leaf
    under a key that is not a plain str or int."""
    names: list[str | None] = [None] * nleaves
    stack: list[tuple[Any, tuple[str, ...]]] = [(root, ())]
    seen: set[int] = set()
    order: list[tuple[int, tuple[str, ...]]] = []
    while stack:
        node, path = stack.pop()
        if not isinstance(node, list) or not node or not isinstance(node[0], str):
            continue
        tag = node[0]
        if tag == "x" and len(node) == 2 and isinstance(node[1], int) and not isinstance(node[1], bool):
            order.append((node[1], path))
        elif tag in ("l", "t") and len(node) == 2 and isinstance(node[1], list):
            stack.extend((c, (*path, str(i))) for i, c in reversed(list(enumerate(node[1]))))
        elif tag in ("d", "o") and len(node) >= 2 and isinstance(node[1], list):
            for item in reversed(node[1]):
                if isinstance(item, list) and len(item) == 2:
                    key = item[0]
                    ok = isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool))
                    stack.append((item[1], (*path, str(key)) if ok else (*path, "\0")))
    for i, path in order:  # depth first, in key order: the first reference names the leaf
        if 0 <= i < nleaves and i not in seen:
            seen.add(i)
            names[i] = None if "\0" in path or not path else "/".join(path)
    return names


def named_tensors(name: str, kind: str, meta: dict[str, Any]) -> dict[int, tuple[str, str, list[int]]]:
    """Segment index -> (tensor name, safetensors dtype, shape) for the torch tensors of a blob
    that can be real named tensors: the blob itself (a tensor), or the tensor leaves of its
    state dict (``<blob>/<key path>``)."""
    def of(m: Any) -> tuple[str, list[int]] | None:
        if not isinstance(m, dict):
            return None
        dt, shape = TORCH_DTYPES.get(str(m.get("dtype"))), m.get("shape")
        if dt is None or not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            return None
        return dt, shape

    if kind == "torch.tensor":
        got = of(meta)
        return {0: (name, *got)} if got is not None else {}
    if kind != "tree" or not isinstance(meta.get("leaves"), list):
        return {}
    leaves = meta["leaves"]
    keys = _leaf_names(meta.get("root"), len(leaves))
    out: dict[int, tuple[str, str, list[int]]] = {}
    seg = 0
    for i, leaf in enumerate(leaves):
        if not (isinstance(leaf, list) and len(leaf) == 3 and isinstance(leaf[2], int)):
            return {}
        if leaf[0] == "torch.tensor" and leaf[2] == 1 and keys[i] is not None:
            got = of(leaf[1])
            if got is not None:
                out[seg] = (f"{name}/{keys[i]}", *got)
        seg += leaf[2]
    return out
