"""Matching a saved tree against a live object: shape checks before anything is touched,
the live leaves a format may read straight into (in-place loads), and the restore through
``load_state_dict`` (see :mod:`epochal.storage.encoding.tree`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ...errors import BlobMismatchError
from . import codecs
from .fit import BLOB, KeyReport, in_place_container
from .skeleton import MAX_DEPTH, Decoder, check_leaves, is_stateful, path_str, type_name

__all__ = ["live_pairs", "register_fixed_shapes", "register_inplace_stateful", "register_state_check", "restore_into",
           "skeleton", "state_problems"]


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
        where = str(path[0]) if len(path) == 1 and isinstance(path[0], str) else path_str(path)
        out.append(f"{where}: checkpoint shape {tuple(a)}, live object shape {tuple(b)}")


_SHAPED_KINDS = ("torch.tensor", "ndarray", "torch.chunked_tensor")


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
        self.keys = Decoder([], [])
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
                    where = str(path[0]) if len(path) == 1 and isinstance(path[0], str) else path_str(path)
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


def live_pairs(meta: dict[str, Any], existing: Any) -> dict[int, Any] | None:
    """Leaf index -> live leaf, when ``existing`` may be restored in place; raises
    BlobMismatchError (the message of :func:`restore_into`) for a shape mismatch."""
    if meta.get("v") != 1 or meta.get("stateful") is not True or not is_stateful(existing):
        return None
    try:
        live = existing.state_dict()
    except Exception:
        return None
    match = _LiveMatch(check_leaves(meta.get("leaves")), _strict(existing))
    match.walk(meta.get("root"), live, ())
    if match.problems:
        raise BlobMismatchError(
            f"state dict does not fit the live {type_name(existing)}: " + "; ".join(match.problems)
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


class _SkeletonDecoder(Decoder):
    """Decodes a tree's structure with every leaf as a :class:`_Stub` (reads no buffer)."""

    def __init__(self, leaves: Any) -> None:
        super().__init__(leaves, [None] * sum(n for _, _, n in check_leaves(leaves)))  # type: ignore[list-item]

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
    if meta.get("stateful") is not True or not is_stateful(existing):
        return _nested_problems(saved, existing, ())
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
        if saved.kind == "tree" and saved.meta.get("stateful") is True and is_stateful(live):
            return [f"{path_str(path)}: {p}" for p in state_problems(saved.meta, live)]
        if live is not None:  # a leaf copied into its live counterpart (torch tensors)
            try:
                codec = codecs.codec_for_kind(saved.kind)
                check = getattr(codec, "check", None)
                if getattr(codec, "inplace_leaf", False) and check is not None:
                    check(saved.meta, live)
            except BlobMismatchError as ex:
                return [f"{path_str(path) or 'the value'}: {ex} (it is restored in place)"]
            except (ValueError, KeyError, ImportError):
                return []
        return []
    out: list[str] = []
    if isinstance(saved, dict) and isinstance(live, dict):
        if {"state", "param_groups"} <= saved.keys() and {"state", "param_groups"} <= live.keys():
            out.extend(_optimizer_dict_problems(saved, live, path))
        elif in_place_container(live):
            out.extend(_key_set_problems(saved, live, path))
        for k, v in saved.items():
            if k in live:
                out.extend(_nested_problems(v, live[k], (*path, k)))
    elif isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)) and len(saved) == len(live):
        for i, (a, b) in enumerate(zip(saved, live)):
            out.extend(_nested_problems(a, b, (*path, i)))
    return out


def _key_set_problems(saved: dict[Any, Any], live: dict[Any, Any], path: tuple[Any, ...]) -> list[str]:
    """A dict restored in place (a state dict held in the state) must have the checkpoint's
    keys, as ``load_state_dict(strict=True)``; with ``strict=False`` (the load's options) the
    differences are recorded in the options' :class:`~.fit.KeyReport` instead."""
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if not missing and not unexpected:
        return []
    opts = codecs.LOAD_OPTIONS.get()
    if not opts.strict:
        if isinstance(opts.keys, KeyReport):
            def named(k: Any) -> str:
                return path_str((*path, k)) if path else str(k)
            opts.keys.add(BLOB.get(), map(named, missing), map(named, unexpected))
        return []
    parts = []
    if missing:
        parts.append("keys missing from the checkpoint: " + _keys(missing))
    if unexpected:
        parts.append("keys the live dict lacks: " + _keys(unexpected))
    where = f"{path_str(path)}: " if path else ""
    return [where + "; ".join(parts) + " (restore(..., strict=False) restores the keys both have)"]


def _keys(keys: list[Any]) -> str:
    shown = ", ".join(map(str, keys[:8]))
    return shown + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def _same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) or (a != a and b != b)  # NaN hyperparameters are the same
    except Exception:  # noqa: BLE001 - a value that does not compare: not known to differ
        return True


def _optimizer_dict_problems(saved: Any, live: Any, path: tuple[Any, ...]) -> list[str]:
    """An optimizer's ``state_dict()`` held in the state (``{"opt": opt.state_dict()}``):
    its tensors alias the optimizer's state, restored in place, but its ``param_groups``
    are copies, and a fresh optimizer has no state to copy into. So it is restored in place
    only when nothing is lost: every saved parameter state has a live one and every
    hyperparameter is already the saved value; otherwise the load is refused."""
    where = path_str(path) or "the value"
    hint = ("an optimizer's state_dict() held in the state cannot be restored in place (it is a copy): "
            "hold the optimizer itself (state = {'opt': opt})")
    sstate, lstate = saved["state"], live["state"]
    if isinstance(sstate, dict) and isinstance(lstate, dict):
        missing = [k for k in sstate if k not in lstate]
        if missing:
            return [f"{where}: no live state for parameters {missing[:5]} (none before a first step); {hint}"]
    sg, lg = saved["param_groups"], live["param_groups"]
    if isinstance(sg, list) and isinstance(lg, list):
        if len(sg) != len(lg):
            return [f"{where}: {len(sg)} parameter groups in the checkpoint, {len(lg)} live; {hint}"]
        for i, (a, b) in enumerate(zip(sg, lg)):
            if not isinstance(a, dict) or not isinstance(b, dict):
                continue
            for k, v in a.items():
                if k == "params" or isinstance(v, _Stub):
                    continue
                if k not in b or not _same_value(v, b[k]):
                    return [f"{where}: param_groups[{i}][{k!r}] is {v!r} in the checkpoint, "
                            f"{b.get(k)!r} live; {hint}"]
    return []


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
    what = type_name(existing)
    if problems:
        raise BlobMismatchError(f"state dict does not fit the live {what}: " + "; ".join(problems))
    try:
        if not codecs.LOAD_OPTIONS.get().strict and _takes_strict(existing):
            existing.load_state_dict(state, strict=False)  # the key differences were recorded
        else:
            existing.load_state_dict(state)
    except BlobMismatchError:
        raise
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise BlobMismatchError(f"the live {what} rejected the state dict: {e}") from e
    return existing


def _takes_strict(obj: Any) -> bool:
    """Whether ``obj.load_state_dict`` takes ``strict=`` (``nn.Module``'s does)."""
    try:
        return "strict" in inspect.signature(obj.load_state_dict).parameters
    except (TypeError, ValueError):
        return False
