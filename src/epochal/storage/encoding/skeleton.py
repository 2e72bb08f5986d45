"""The tree codec's skeleton: a nested container as JSON data plus its leaves' segments,
and back (see :mod:`epochal.storage.encoding.tree` for the node table). Never imports torch."""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ...errors import BlobMismatchError, UnsupportedBlobError
from . import codecs
from .fit import in_place_container

__all__ = ["MAX_DEPTH", "TREE_KIND", "Decoder", "Encoder", "check_leaves", "is_stateful", "path_str", "type_name"]

#: the kind of tree blobs
TREE_KIND = "tree"

#: Nesting deeper than this is refused at save and at load (no real state dict comes close,
#: and it bounds recursion on a crafted file).
MAX_DEPTH = 200

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def is_stateful(value: Any) -> bool:
    """True for objects that save and restore themselves through a state dict."""
    return (
        not isinstance(value, (dict, list, tuple, type))
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def _float_bits(x: float) -> str:
    return f"{struct.unpack('<Q', struct.pack('<d', x))[0]:016x}"


def _bits_float(s: Any) -> float:
    if not isinstance(s, str) or len(s) != 16:
        raise ValueError(f"bad float bits {s!r}")
    return float(struct.unpack("<d", struct.pack("<Q", int(s, 16)))[0])


def type_name(value: Any) -> str:
    t = type(value)
    return f"{t.__module__}.{t.__qualname__}"


def path_str(path: Sequence[Any]) -> str:
    """A readable key path, e.g. ``state[0]['exp_avg']``; for a Module, ``'fc.weight'``."""
    if not path:
        return "<root>"
    return "".join(f"[{p!r}]" for p in path)


# ---------------------------------------------------------------- encoding
def _identity(value: Any) -> Any:
    """What makes two leaves "the same object" for storing them once.

    ``id`` in general; for a torch tensor, the memory it views (``nn.Module.state_dict()``
    detaches every parameter into a new tensor object, so tied weights differ by ``id``
    but view the same memory with the same layout). Duck-typed: torch is not imported.
    """
    if type(value).__module__.startswith("torch") and callable(getattr(value, "data_ptr", None)):
        try:
            ptr = value.data_ptr()
            if ptr:
                return ("tensor", ptr, str(value.device), str(value.dtype),
                        tuple(value.shape), tuple(value.stride()))
        except Exception:  # tensors without storage (meta, subclasses): fall back to id
            pass
    return id(value)


class Encoder:
    """One encode pass: builds the skeleton and collects the leaves' Encoded values."""

    def __init__(self) -> None:
        self.leaves: list[list[Any]] = []
        self.segments: list[memoryview] = []
        self._memo: dict[Any, int] = {}
        self._keep: list[Any] = []  # keeps memoised objects alive so their ids stay unique
        self._active: set[int] = set()

    def node(self, value: Any, path: tuple[Any, ...]) -> Any:
        if len(path) > MAX_DEPTH:
            raise UnsupportedBlobError(f"nesting deeper than {MAX_DEPTH} at {path_str(path)}")
        t = type(value)
        if value is None or t is bool:
            return value
        if t is int:
            return value if _INT64_MIN <= value <= _INT64_MAX else ["I", str(value)]
        if t is float:
            return ["f", _float_bits(value)]
        if t is str:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates: not valid JSON text, store raw
                return self.leaf(value, path)
            return value
        if isinstance(value, (dict, list, tuple)):
            vid = id(value)
            if vid in self._active:
                raise UnsupportedBlobError(f"the structure contains itself at {path_str(path)}")
            self._active.add(vid)
            try:
                if isinstance(value, dict):
                    items = [
                        [self.key(k, path), self.node(v, (*path, k))] for k, v in value.items()
                    ]
                    if isinstance(value, OrderedDict):
                        md = getattr(value, "_metadata", None)
                        return ["o", items, self.node(md, (*path, "_metadata")) if md else None]
                    return ["d", items]
                tag = "l" if isinstance(value, list) else "t"
                return [tag, [self.node(v, (*path, i)) for i, v in enumerate(value)]]
            finally:
                self._active.discard(vid)
        return self.leaf(value, path)

    def key(self, k: Any, path: tuple[Any, ...]) -> Any:
        t = type(k)
        if k is None or t in (bool, int, float, str):
            return self.node(k, path)
        if t is tuple:
            return ["t", [self.key(x, path) for x in k]]
        raise UnsupportedBlobError(
            f"dict key {k!r} of type {type_name(k)} at {path_str(path)}: only str, int, "
            "float, bool, None and tuples of those can be stored"
        )

    def leaf(self, value: Any, path: tuple[Any, ...]) -> list[Any]:
        vid = _identity(value)
        if vid in self._memo:
            return ["x", self._memo[vid]]
        try:
            enc = codecs.encode(value, path_str(path))
        except UnsupportedBlobError as e:
            raise UnsupportedBlobError(f"at {path_str(path)}: {e}") from None
        index = len(self.leaves)
        self.leaves.append([enc.kind, enc.meta, len(enc.segments)])
        self.segments.extend(enc.segments)
        self._memo[vid] = index
        self._keep.append(value)
        return ["x", index]


# ---------------------------------------------------------------- decoding
class Decoder:
    """One decode pass over a validated skeleton; leaves are decoded on first reference."""

    def __init__(
        self, leaves: Any, buffers: Sequence[memoryview], inplace: dict[int, Any] | None = None
    ) -> None:
        self.leaves = check_leaves(leaves)
        #: leaf index -> live leaf whose memory the format may have read the leaf into
        self.inplace = inplace or {}
        self.buffers = buffers
        self.offsets: list[int] = []
        off = 0
        for _, _, n in self.leaves:
            self.offsets.append(off)
            off += n
        if off != len(buffers):
            raise ValueError(f"the tree's leaves need {off} segments, the blob has {len(buffers)}")
        self.values: dict[int, Any] = {}

    def node(self, n: Any, depth: int, existing: Any = None) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"tree nested deeper than {MAX_DEPTH}")
        if n is None or isinstance(n, (bool, str)):
            return n
        if isinstance(n, int):
            return n
        if not isinstance(n, list) or not n or not isinstance(n[0], str):
            raise ValueError(f"bad tree node {str(n)[:80]!r}")
        tag = n[0]
        if tag == "f" and len(n) == 2:
            return _bits_float(n[1])
        if tag == "I" and len(n) == 2:
            if not isinstance(n[1], str) or len(n[1]) > 100_000:
                raise ValueError("bad big int")
            return int(n[1])
        if tag in ("l", "t") and len(n) == 2 and isinstance(n[1], list):
            if isinstance(existing, (list, tuple)) and len(existing) == len(n[1]):
                subs: Sequence[Any] = existing
            else:
                subs = [None] * len(n[1])
            items = [self.node(x, depth + 1, e) for x, e in zip(n[1], subs)]
            return items if tag == "l" else tuple(items)
        if tag in ("d", "o") and len(n) in (2, 3) and isinstance(n[1], list):
            out: dict[Any, Any] = {} if tag == "d" else OrderedDict()
            ex = existing if isinstance(existing, dict) else {}
            for item in n[1]:
                if not isinstance(item, list) or len(item) != 2:
                    raise ValueError("bad dict item")
                k = self.node(item[0], depth + 1)
                if isinstance(k, (list, dict)):
                    raise ValueError("unhashable dict key")
                out[k] = self.node(item[1], depth + 1, ex.get(k))
            if ex and not codecs.LOAD_OPTIONS.get().strict and in_place_container(ex):
                # strict=False: the live keys, with the saved value where both have one
                out = type(out)((k, out[k] if k in out else v) for k, v in ex.items())
            if tag == "o" and len(n) == 3 and n[2] is not None:
                out._metadata = self.node(n[2], depth + 1)  # type: ignore[attr-defined]
            return out
        if tag == "x" and len(n) == 2 and isinstance(n[1], int) and not isinstance(n[1], bool):
            return self.leaf(n[1], existing)
        raise ValueError(f"bad tree node {str(n)[:80]!r}")

    def leaf(self, i: int, existing: Any) -> Any:
        if not 0 <= i < len(self.leaves):
            raise ValueError(f"tree leaf {i} out of range")
        if i in self.values:
            return self.values[i]
        kind, meta, nseg = self.leaves[i]
        codec = codecs.codec_for_kind(kind)
        bufs = self.buffers[self.offsets[i] : self.offsets[i] + nseg]
        # A nested stateful object is restored into its live counterpart: other plain leaves
        # of a container are fresh values (the blob replaces the container's content) ...
        nested_stateful = kind == TREE_KIND and meta.get("stateful") is True
        # ... and a leaf whose codec copies into a live leaf of its kind (torch tensors: a
        # state dict held in the state aliases the module's parameters), restored in place
        in_place = existing is not None and getattr(codec, "inplace_leaf", False)
        live = existing if nested_stateful or in_place else None
        if i in self.inplace and _read_in_place(codec, meta, bufs, self.inplace[i]):
            live = self.inplace[i]  # the bytes are already in the live leaf: decode to it
        value = codec.decode(meta, bufs, live)
        self.values[i] = value
        return value


def _read_in_place(codec: Any, meta: dict[str, Any], bufs: Sequence[memoryview], live: Any) -> bool:
    """True when every buffer of a leaf is the memory its codec offers for ``live``."""
    fn = getattr(codec, "inplace_targets", None)
    if fn is None or not bufs:
        return False
    try:
        targets = fn(meta, [b.nbytes for b in bufs], live)
    except BlobMismatchError:
        return False
    return (
        targets is not None
        and len(targets) == len(bufs)
        and all(t is not None and codecs.same_memory(t, b) for t, b in zip(targets, bufs))
    )


def check_leaves(leaves: Any) -> list[tuple[str, dict[str, Any], int]]:
    if not isinstance(leaves, list):
        raise ValueError("tree meta has no leaf list")
    out = []
    for item in leaves:
        if (
            not isinstance(item, list)
            or len(item) != 3
            or not isinstance(item[0], str)
            or not isinstance(item[1], dict)
            or not isinstance(item[2], int)
            or isinstance(item[2], bool)
            or item[2] < 0
        ):
            raise ValueError(f"bad tree leaf {str(item)[:80]!r}")
        out.append((item[0], item[1], item[2]))
    return out
