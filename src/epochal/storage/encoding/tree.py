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

from collections.abc import Sequence
from typing import Any

from ...errors import BlobMismatchError, UnsupportedBlobError
from . import codecs
from .codecs import Encoded, register_codec
from .live import (
    live_pairs,
    register_fixed_shapes,
    register_inplace_stateful,
    register_state_check,
    restore_into,
    skeleton,
    state_problems,
)
from .skeleton import MAX_DEPTH, TREE_KIND, Decoder, Encoder, check_leaves, is_stateful, type_name

__all__ = ["MAX_DEPTH", "TreeCodec", "is_stateful", "register_fixed_shapes", "register_inplace_stateful", "register_state_check",
           "restore_into"]


# ---------------------------------------------------------------- the codec
class TreeCodec:
    """dict/list/tuple trees and stateful objects (as their state dict). See module docstring."""

    kind = TREE_KIND

    def accepts(self, value: Any) -> bool:
        return isinstance(value, (dict, list, tuple)) or is_stateful(value)

    def encode(self, value: Any) -> Encoded:
        stateful = not isinstance(value, (dict, list, tuple))
        if stateful:
            state = value.state_dict()
            if is_stateful(state) or not isinstance(state, (dict, list, tuple)):
                raise UnsupportedBlobError(
                    f"state_dict() of {type_name(value)} returned a {type_name(state)}, "
                    "not a dict"
                )
        else:
            state = value
        enc = Encoder()
        root = enc.node(state, ())
        meta: dict[str, Any] = {"v": 1, "root": root, "leaves": enc.leaves}
        if stateful:
            meta["stateful"] = True
            meta["type"] = type_name(value)  # informational only; never used to build objects
        return Encoded(self.kind, meta, enc.segments)

    def allocate(self, meta: dict[str, Any], sizes: Sequence[int]) -> list[memoryview]:
        leaves = check_leaves(meta.get("leaves"))
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
        pairs = live_pairs(meta, existing)
        if not pairs:
            return None
        leaves = check_leaves(meta.get("leaves"))
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
        :func:`~epochal.storage.encoding.live.state_problems`); nothing is written. A plain tree
        saved where the live object is stateful must be a dict (its state dict, restored
        through ``load_state_dict``): a list or tuple would replace the live object."""
        if meta.get("stateful") is not True and is_stateful(existing):
            if not isinstance(skeleton(meta), dict):
                raise BlobMismatchError(
                    f"the checkpoint holds a {type_name(skeleton(meta))} where the live object is a "
                    f"{type_name(existing)}: it is restored in place from a state dict or not at all"
                )
            meta = {**meta, "stateful": True}
        problems = state_problems(meta, existing)
        if problems:
            raise BlobMismatchError(
                f"state dict does not fit the live {type_name(existing)}: " + "; ".join(problems)
            )

    def decode(
        self, meta: dict[str, Any], buffers: Sequence[memoryview], existing: Any = None
    ) -> Any:
        if meta.get("v") != 1:
            raise ValueError(f"unknown tree version {meta.get('v')!r}")
        stateful = meta.get("stateful") is True
        if not stateful and is_stateful(existing):  # a state dict saved as a plain dict
            state = Decoder(meta.get("leaves"), buffers).node(meta.get("root"), 0)
            if not isinstance(state, dict):
                raise BlobMismatchError(
                    f"the checkpoint holds a {type_name(state)} where the live object is a "
                    f"{type_name(existing)}: it is restored in place from a state dict or not at all"
                )
            return restore_into(existing, state)
        pairs = live_pairs(meta, existing) if stateful else None
        dec = Decoder(meta.get("leaves"), buffers, pairs)
        # A state dict decodes into fresh values (load_state_dict copies them over); a plain
        # container (also the live state dict a module's state is restored into) hands its
        # live leaves down: nested stateful objects, and tensors copied into in place.
        tree = dec.node(meta.get("root"), 0, None if stateful and is_stateful(existing) else existing)
        if stateful and is_stateful(existing):
            return restore_into(existing, tree)
        return tree


register_codec(TreeCodec())
