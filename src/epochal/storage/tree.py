"""Nested containers and stateful objects as one blob, without pickle.

A *tree* is a nested structure of dicts, lists and tuples whose leaves are Python scalars
(None, bool, int, float, str, bytes) or values another codec stores (numpy arrays and scalars,
torch tensors, ...). :class:`TreeCodec` encodes it as

* a JSON skeleton in the meta: containers and small scalars inline, each other leaf as a
  reference to an entry of ``meta["leaves"]`` (that leaf codec's kind, meta and segment count);
* the leaves' raw segments, in leaf order, as the blob's segments.

So a model's state dict is one blob with one raw segment per tensor, and nothing on the load
path ever runs code from the file: the skeleton is data, leaves are rebuilt by registered
codecs found by kind.

Why a dedicated encoding and not plain JSON: JSON cannot tell ``{1: x}`` from ``{"1": x}``,
a tuple from a list, or keep a float's bits (NaN payloads, -0.0). Optimizer state dicts use int
keys and tuples (``betas``), so the skeleton tags every container and non-JSON-native scalar.

*Stateful objects* (anything with ``state_dict()`` and ``load_state_dict()``: ``nn.Module``,
optimizers, LR schedulers, GradScaler, :class:`epochal.RNGState`, user classes) are stored as
the tree of their ``state_dict()`` with ``meta["stateful"] = True``. On load, when the
workspace holds a live object under the blob's name, the tree is handed to its
``load_state_dict`` (after a shape check, so a mismatch is a clear
:class:`~epochal.errors.BlobMismatchError` instead of a half-restored model) and the live
object is returned; otherwise the blob becomes the plain state dict.

*In-place loading.* For a live object accepted by a predicate registered with
:func:`register_inplace_stateful` (the torch integration registers plain ``nn.Module`` and
optimizers), whose ``state_dict()`` has exactly the structure of the saved one (same keys,
same list lengths), :meth:`TreeCodec.inplace_targets` offers the memory of the live
``state_dict()`` tensors (they share it with the parameters and optimizer state) to the
format, which reads verified bytes straight into it. ``decode`` then hands those live leaves
to ``load_state_dict`` (whose copy of a tensor onto itself is a no-op), so the result is the
one of the staged path without the staging memory and the copy. Shapes are checked before
anything is read.

Skeleton nodes (JSON):

=====================  ==========================================
``null``/``true``/…    None / bool
``"text"``             str
``7``                  int (only JSON integers; a JSON float is an error)
``["I", "123…"]``      int too large for 64 bits
``["f", "hexbits"]``   float, its IEEE-754 bits as 16 hex digits
``["l", [n, …]]``      list
``["t", [n, …]]``      tuple
``["d", [[k, v], …]]`` dict; keys are nodes too (str, int, float, bool, None, tuples of those)
``["o", [[k, v], …], m]``  OrderedDict, ``m`` its ``_metadata`` node or null (nn.Module
                       state dicts carry per-module versions there)
``["x", i]``           leaf ``i`` of ``meta["leaves"]``; the same object met twice is
                       stored once and decodes to one object (tied weights stay tied)
=====================  ==========================================

This module never imports torch.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import BlobMismatchError, UnsupportedBlobError
from . import codecs
from .codecs import Encoded, register_codec

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


def _type_name(value: Any) -> str:
    t = type(value)
    return f"{t.__module__}.{t.__qualname__}"


def _path_str(path: Sequence[Any]) -> str:
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


class _Encoder:
    """One encode pass: builds the skeleton and collects the leaves' Encoded values."""

    def __init__(self) -> None:
        self.leaves: list[list[Any]] = []
        self.segments: list[memoryview] = []
        self._memo: dict[Any, int] = {}
        self._keep: list[Any] = []  # keeps memoised objects alive so their ids stay unique
        self._active: set[int] = set()

    def node(self, value: Any, path: tuple[Any, ...]) -> Any:
        if len(path) > MAX_DEPTH:
            raise UnsupportedBlobError(f"nesting deeper than {MAX_DEPTH} at {_path_str(path)}")
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
                raise UnsupportedBlobError(f"the structure contains itself at {_path_str(path)}")
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
            f"dict key {k!r} of type {_type_name(k)} at {_path_str(path)}: only str, int, "
            "float, bool, None and tuples of those can be stored"
        )

    def leaf(self, value: Any, path: tuple[Any, ...]) -> list[Any]:
        vid = _identity(value)
        if vid in self._memo:
            return ["x", self._memo[vid]]
        try:
            enc = codecs.encode(value, _path_str(path))
        except UnsupportedBlobError as e:
            raise UnsupportedBlobError(f"at {_path_str(path)}: {e}") from None
        index = len(self.leaves)
        self.leaves.append([enc.kind, enc.meta, len(enc.segments)])
        self.segments.extend(enc.segments)
        self._memo[vid] = index
        self._keep.append(value)
        return ["x", index]


# ---------------------------------------------------------------- decoding
class _Decoder:
    """One decode pass over a validated skeleton; leaves are decoded on first reference."""

    def __init__(
        self, leaves: Any, buffers: Sequence[memoryview], inplace: dict[int, Any] | None = None
    ) -> None:
        self.leaves = _check_leaves(leaves)
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
        # Only a nested stateful object is restored into its live counterpart: plain leaves
        # of a container are fresh values (the blob replaces the container's content).
        nested_stateful = kind == TreeCodec.kind and meta.get("stateful") is True
        live = existing if nested_stateful else None
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


def _check_leaves(leaves: Any) -> list[tuple[str, dict[str, Any], int]]:
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


# ---------------------------------------------------------------- shape check
def _shape_mismatches(saved: Any, live: Any, path: tuple[Any, ...], out: list[str], strict: bool = True) -> None:
    """Collect 'path: checkpoint shape A, live shape B' for leaves both sides have."""
    if len(out) >= 5 or len(path) > MAX_DEPTH:
        return
    if isinstance(saved, dict) and isinstance(live, dict):
        for k, v in saved.items():
            if k in live:
                _shape_mismatches(v, live[k], (*path, k), out, strict)
        return
    if isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)):
        for i, (a, b) in enumerate(zip(saved, live)):
            _shape_mismatches(a, b, (*path, i), out, strict)
        return
    a, b = getattr(saved, "shape", None), getattr(live, "shape", None)
    if a is not None and b is not None and not _fits(tuple(a), tuple(b), strict):
        where = str(path[0]) if len(path) == 1 and isinstance(path[0], str) else _path_str(path)
        out.append(f"{where}: checkpoint shape {tuple(a)}, live object shape {tuple(b)}")


_SHAPED_KINDS = ("torch.tensor", "ndarray")


def _fits(saved: tuple[Any, ...], live: tuple[Any, ...], strict: bool) -> bool:
    """Whether a saved leaf of shape ``saved`` may replace a live one of shape ``live``: the
    same shape, or, unless ``strict``, either side empty (a live placeholder not filled yet,
    such as a sampler's permutation before the first epoch, or state saved before it grew):
    ``load_state_dict`` then gets the saved value and judges it. Objects whose tensors have
    fixed shapes (models, optimizers: see :func:`register_fixed_shapes`) are strict."""
    return saved == live or (not strict and (0 in saved or 0 in live))


#: predicates naming live stateful objects whose state tensors have fixed shapes
_fixed_shapes: list[Callable[[Any], bool]] = []


def register_fixed_shapes(predicate: Callable[[Any], bool]) -> None:
    """Declare that the live objects ``predicate`` accepts only take state of their own shapes
    (an empty tensor in their state is not a placeholder)."""
    if predicate not in _fixed_shapes:
        _fixed_shapes.append(predicate)


def _strict(existing: Any) -> bool:
    return any(p(existing) for p in _fixed_shapes)


class _LiveMatch:
    """Walks a saved skeleton next to the live ``state_dict()``: collects shape mismatches
    (as :func:`_shape_mismatches` does for a decoded state), the live counterpart of every
    leaf (first reference wins, in the decoder's order) and whether both have exactly the
    same structure (dict keys, list lengths, containers against containers)."""

    def __init__(self, leaves: list[tuple[str, dict[str, Any], int]], strict: bool = True) -> None:
        self.leaves = leaves
        self.strict = strict
        self.keys = _Decoder([], [])
        self.pairs: dict[int, Any] = {}
        self.same = True
        self.problems: list[str] = []

    def walk(self, n: Any, live: Any, path: tuple[Any, ...]) -> None:
        if len(path) > MAX_DEPTH:
            self.same = False
            return
        container = isinstance(live, (dict, list, tuple))
        tag = n[0] if isinstance(n, list) and n and isinstance(n[0], str) else None
        if tag in ("l", "t") and len(n) == 2 and isinstance(n[1], list):
            if not isinstance(live, (list, tuple)) or len(live) != len(n[1]):
                self.same = False
            if isinstance(live, (list, tuple)):
                for k, (x, e) in enumerate(zip(n[1], live)):
                    self.walk(x, e, (*path, k))
            return
        if tag in ("d", "o") and len(n) in (2, 3) and isinstance(n[1], list):
            if not isinstance(live, dict):
                self.same = False
                return
            seen = 0
            for item in n[1]:
                if not isinstance(item, list) or len(item) != 2:
                    self.same = False
                    return
                try:
                    k = self.keys.node(item[0], len(path) + 1)
                    present = k in live
                except (ValueError, TypeError):  # a raw-leaf or unhashable key: no match
                    self.same = False
                    return
                if present:
                    seen += 1
                    self.walk(item[1], live[k], (*path, k))
                else:
                    self.same = False
            if seen != len(live):
                self.same = False
            return
        if tag == "x" and len(n) == 2 and isinstance(n[1], int) and not isinstance(n[1], bool):
            if container or not 0 <= n[1] < len(self.leaves):
                self.same = False
                return
            kind, meta, _ = self.leaves[n[1]]
            a, b = meta.get("shape"), getattr(live, "shape", None)
            if kind in _SHAPED_KINDS and isinstance(a, list) and b is not None:
                if not _fits(tuple(a), tuple(b), self.strict) and len(self.problems) < 5:
                    where = str(path[0]) if len(path) == 1 and isinstance(path[0], str) else _path_str(path)
                    self.problems.append(
                        f"{where}: checkpoint shape {tuple(a)}, live object shape {tuple(b)}"
                    )
            if live is not None:
                self.pairs.setdefault(n[1], live)
            return
        if container:  # a scalar saved where the live state has a container
            self.same = False


#: predicates naming live stateful objects that may be restored in place (see module doc)
_inplace_ok: list[Callable[[Any], bool]] = []


def register_inplace_stateful(predicate: Callable[[Any], bool]) -> None:
    """Allow :meth:`TreeCodec.inplace_targets` for live stateful objects ``predicate`` accepts:
    their ``load_state_dict`` must accept a state dict whose tensors are their own
    ``state_dict()`` tensors, and must not reject a state dict of the same structure and
    shapes (the bytes are already in those tensors when it runs)."""
    if predicate not in _inplace_ok:
        _inplace_ok.append(predicate)


def _live_pairs(meta: dict[str, Any], existing: Any) -> dict[int, Any] | None:
    """Leaf index -> live leaf, when ``existing`` may be restored in place; raises
    BlobMismatchError (the message of :func:`restore_into`) for a shape mismatch."""
    if meta.get("v") != 1 or meta.get("stateful") is not True or not is_stateful(existing):
        return None
    try:
        live = existing.state_dict()
    except Exception:
        return None
    match = _LiveMatch(_check_leaves(meta.get("leaves")), _strict(existing))
    match.walk(meta.get("root"), live, ())
    if match.problems:
        raise BlobMismatchError(
            f"state dict does not fit the live {_type_name(existing)}: " + "; ".join(match.problems)
        )
    if not match.same or not any(ok(existing) for ok in _inplace_ok):
        return None
    return match.pairs


class _Stub:
    """A leaf of a saved state, known from its meta alone (no data read): kind and shape."""

    def __init__(self, kind: str, meta: dict[str, Any]) -> None:
        self.kind, self.meta = kind, meta
        shape = meta.get("shape") if kind in _SHAPED_KINDS else None
        self.shape = tuple(shape) if isinstance(shape, list) else None

    def __repr__(self) -> str:
        return f"<saved {self.kind} {self.shape}>"


class _SkeletonDecoder(_Decoder):
    """Decodes a tree's structure with every leaf as a :class:`_Stub` (reads no buffer)."""

    def __init__(self, leaves: Any) -> None:
        self.leaves = _check_leaves(leaves)
        self.inplace, self.buffers, self.offsets, self.values = {}, [], [], {}

    def leaf(self, i: int, existing: Any) -> Any:
        if not 0 <= i < len(self.leaves):
            raise ValueError(f"tree leaf {i} out of range")
        kind, meta, _ = self.leaves[i]
        return _Stub(kind, meta)


def skeleton(meta: dict[str, Any]) -> Any:
    """The saved state of a tree blob with its leaves as stubs (``.kind``, ``.shape``,
    ``.meta``): what a check can know before any data is read."""
    return _SkeletonDecoder(meta.get("leaves")).node(meta.get("root"), 0)


#: (predicate, check) pairs: ``check(live_object, saved_skeleton, live_state_dict)`` returns
#: the problems that object's ``load_state_dict`` would refuse (see register_state_check)
_state_checks: list[tuple[Callable[[Any], bool], Callable[[Any, Any, Any], list[str]]]] = []


def register_state_check(predicate: Callable[[Any], bool], check: Callable[[Any, Any, Any], list[str]]) -> None:
    """For live stateful objects ``predicate`` accepts, ``check(obj, saved, live_state)``
    lists what their ``load_state_dict`` would refuse (missing or unexpected keys, another
    parameter-group layout); ``saved`` is the :func:`skeleton` of the blob. Integrations
    register these so a load can refuse before it writes anything."""
    _state_checks.append((predicate, check))


def state_problems(meta: dict[str, Any], existing: Any) -> list[str]:
    """Why the saved tree blob ``meta`` cannot be restored into ``existing``: shapes of the
    leaves both have, plus the registered checks of its type; [] when it fits (or when
    nothing is known about it). Nested stateful values of a plain container are checked
    against their live counterparts."""
    if meta.get("v") != 1:
        return []
    saved = skeleton(meta)
    if meta.get("stateful") is not True:
        return _nested_problems(saved, existing, ())
    if not is_stateful(existing):
        return []
    try:
        live = existing.state_dict()
    except Exception:
        return []
    problems: list[str] = []
    _shape_mismatches(saved, live, (), problems, _strict(existing))
    for predicate, check in _state_checks:
        if predicate(existing):
            problems.extend(check(existing, saved, live))
    return problems


def _nested_problems(saved: Any, live: Any, path: tuple[Any, ...]) -> list[str]:
    if len(path) > MAX_DEPTH:
        return []
    if isinstance(saved, _Stub):
        if saved.kind == TreeCodec.kind and saved.meta.get("stateful") is True and is_stateful(live):
            return [f"{_path_str(path)}: {p}" for p in state_problems(saved.meta, live)]
        return []
    out: list[str] = []
    if isinstance(saved, dict) and isinstance(live, dict):
        for k, v in saved.items():
            if k in live:
                out.extend(_nested_problems(v, live[k], (*path, k)))
    elif isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)) and len(saved) == len(live):
        for i, (a, b) in enumerate(zip(saved, live)):
            out.extend(_nested_problems(a, b, (*path, i)))
    return out


def restore_into(existing: Any, state: Any) -> Any:
    """Restore ``existing`` in place from ``state`` with its ``load_state_dict``.

    Shapes are compared first against ``existing.state_dict()`` so that nothing is touched
    when they differ; a rejection by ``load_state_dict`` itself becomes a
    :class:`BlobMismatchError` too. The loader adds the blob name to the message.
    """
    try:
        live = existing.state_dict()
    except Exception:  # an object that cannot report its state yet: let load_state_dict judge
        live = None
    problems: list[str] = []
    _shape_mismatches(state, live, (), problems, _strict(existing))
    what = _type_name(existing)
    if problems:
        raise BlobMismatchError(f"state dict does not fit the live {what}: " + "; ".join(problems))
    try:
        existing.load_state_dict(state)
    except BlobMismatchError:
        raise
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise BlobMismatchError(f"the live {what} rejected the state dict: {e}") from e
    return existing


# ---------------------------------------------------------------- the codec
class TreeCodec:
    """dict/list/tuple trees and stateful objects (as their state dict). See module docstring."""

    kind = "tree"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, (dict, list, tuple)) or is_stateful(value)

    def encode(self, value: Any) -> Encoded:
        stateful = not isinstance(value, (dict, list, tuple))
        if stateful:
            state = value.state_dict()
            if is_stateful(state) or not isinstance(state, (dict, list, tuple)):
                raise UnsupportedBlobError(
                    f"state_dict() of {_type_name(value)} returned a {_type_name(state)}, "
                    "not a dict"
                )
        else:
            state = value
        enc = _Encoder()
        root = enc.node(state, ())
        meta: dict[str, Any] = {"v": 1, "root": root, "leaves": enc.leaves}
        if stateful:
            meta["stateful"] = True
            meta["type"] = _type_name(value)  # informational only; never used to build objects
        return Encoded(self.kind, meta, enc.segments)

    def allocate(self, meta: dict[str, Any], sizes: Sequence[int]) -> list[memoryview]:
        leaves = _check_leaves(meta.get("leaves"))
        if sum(n for _, _, n in leaves) != len(sizes):
            raise ValueError(
                f"the tree's leaves need {sum(n for _, _, n in leaves)} segments, "
                f"the blob has {len(sizes)}"
            )
        out: list[memoryview] = []
        off = 0
        for kind, leaf_meta, n in leaves:
            bufs = codecs.codec_for_kind(kind).allocate(leaf_meta, sizes[off : off + n])
            if len(bufs) != n:
                raise ValueError(f"codec {kind!r} allocated {len(bufs)} buffers for {n} segments")
            out.extend(bufs)
            off += n
        return out

    def inplace_targets(
        self, meta: dict[str, Any], sizes: Sequence[int], existing: Any
    ) -> list[memoryview | None] | None:
        """For a live stateful object that may be restored in place (see the module doc):
        per segment, the live state tensor's memory its leaf codec offers, or None."""
        pairs = _live_pairs(meta, existing)
        if not pairs:
            return None
        leaves = _check_leaves(meta.get("leaves"))
        if sum(n for _, _, n in leaves) != len(sizes):
            return None
        out: list[memoryview | None] = [None] * len(sizes)
        off = 0
        for i, (kind, leaf_meta, n) in enumerate(leaves):
            live = pairs.get(i)
            fn = getattr(codecs.codec_for_kind(kind), "inplace_targets", None) if live is not None else None
            if fn is not None:
                try:
                    got = fn(leaf_meta, sizes[off : off + n], live)
                except BlobMismatchError:  # e.g. another dtype: load_state_dict converts it
                    got = None
                if got is not None and len(got) == n:
                    out[off : off + n] = got
            off += n
        return out if any(t is not None for t in out) else None

    def check(self, meta: dict[str, Any], existing: Any) -> None:
        """BlobMismatchError when the blob cannot be restored into ``existing`` (see
        :func:`state_problems`); nothing is written."""
        problems = state_problems(meta, existing)
        if problems:
            raise BlobMismatchError(
                f"state dict does not fit the live {_type_name(existing)}: " + "; ".join(problems)
            )

    def decode(
        self, meta: dict[str, Any], buffers: Sequence[memoryview], existing: Any = None
    ) -> Any:
        if meta.get("v") != 1:
            raise ValueError(f"unknown tree version {meta.get('v')!r}")
        stateful = meta.get("stateful") is True
        pairs = _live_pairs(meta, existing) if stateful else None
        dec = _Decoder(meta.get("leaves"), buffers, pairs)
        # A state dict decodes into fresh values (load_state_dict copies them over); a plain
        # container may hand live stateful objects down to nested stateful leaves.
        tree = dec.node(meta.get("root"), 0, None if stateful else existing)
        if stateful and is_stateful(existing):
            return restore_into(existing, tree)
        return tree


register_codec(TreeCodec())
