"""Does a checkpoint fit the live objects? The one check every load runs before it writes.

A load restores some blobs in place (modules, optimizers, samplers, torch tensors, a state
dict held in the state) and replaces the others (plain values). Before any byte reaches a
live object, every blob of the load is compared with its live counterpart from the db's
index alone (kind, shapes, dtypes, key sets, parameter groups): one mismatch anywhere
refuses the whole load, naming every blob that does not fit. The formats' readers and the
checkpoint layer's load steps call :func:`check_all_live`; integrations register what their
objects' ``load_state_dict`` would refuse (:func:`~.live.register_state_check`) and are
imported here, from the live objects' types, before anything is judged: the check must not
depend on whether this process happened to save a tensor first.

Strictness (``LoadOptions.strict``, default True, as torch's ``load_state_dict``): a dict of
tensors held in the state (``{"model": model.state_dict()}``) must have the checkpoint's key
set exactly; with ``strict=False`` the keys both have are restored, the others keep their live
values, and the differences are recorded in ``LoadOptions.keys`` (a :class:`KeyReport`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ...errors import BlobMismatchError
from . import codecs

__all__ = ["BLOB", "KeyReport", "check_all_live", "check_live", "in_place_container", "load_integrations_for"]

#: the name of the blob being checked (the paths of a :class:`KeyReport` start with it)
BLOB: ContextVar[str] = ContextVar("epochal_checked_blob", default="")


@dataclass
class KeyReport:
    """What a non-strict load found of the key sets (as torch's ``_IncompatibleKeys``), per
    blob: ``missing``, the keys the live dict has and the checkpoint lacks (they keep their
    values); ``unexpected``, the checkpoint's keys the live dict lacks (not restored). A key
    below the blob's top level is named by its path (``['inner']['w']``)."""

    missing: dict[str, list[str]] = field(default_factory=dict)
    unexpected: dict[str, list[str]] = field(default_factory=dict)

    def add(self, blob: str, missing: Iterable[str], unexpected: Iterable[str]) -> None:
        for into, keys in ((self.missing, missing), (self.unexpected, unexpected)):
            for k in keys:
                got = into.setdefault(blob, [])
                if k not in got:
                    got.append(k)


def load_integrations_for(value: Any, _depth: int = 0) -> None:
    """Import the integrations registered for the packages that ``value``'s type (or one of
    its bases: a user's ``nn.Module`` subclass in ``__main__``) or the values it holds come
    from, so their checks are in place before a live object is judged."""
    pending = {e.module: e for e in codecs.lazy_integrations() if e.value_package and e.module not in sys.modules}
    if pending:
        _walk(value, pending, 0)


def _walk(value: Any, pending: dict[str, codecs.LazyCodecs], depth: int) -> None:
    packages = {(c.__module__ or "").split(".")[0] for c in type(value).__mro__}
    for module, entry in list(pending.items()):
        if entry.value_package in packages:
            del pending[module]
            try:
                importlib.import_module(module)
            except ImportError:  # the integration is not installed: its codecs say so on use
                pass
    if not pending or depth > 4:
        return
    if isinstance(value, dict):
        items: Iterable[Any] = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return
    for i, v in enumerate(items):
        if i >= 64 or not pending:  # the first values of a container tell its packages
            return
        _walk(v, pending, depth + 1)


def in_place_container(live: Any) -> bool:
    """Whether the live dict is restored in place rather than replaced: it holds a value a
    codec copies into (a torch tensor: a state dict held in the state aliases its module's
    parameters) or a stateful object. Its key set must then be the checkpoint's."""
    if not isinstance(live, dict):
        return False
    for v in live.values():
        if isinstance(v, codecs.PLAIN_VALUES) or isinstance(v, (dict, list, tuple)):
            continue
        if _stateful(v):
            return True
        try:
            if getattr(codecs.codec_for_value(v), "inplace_leaf", False):
                return True
        except Exception:  # noqa: BLE001 - a value no codec takes is judged where it is loaded
            continue
    return False


def check_all_live(blobs: Iterable[tuple[str, str, dict[str, Any], Any]], where: str) -> None:
    """:func:`check_live` for every ``(name, kind, meta, live object)`` whose live object is
    restored in place (not one of PLAIN_VALUES), all before any is touched: one
    BlobMismatchError listing every blob that does not fit, ``"<where> does not fit the live
    objects; nothing was restored: blob 'a': ...; blob 'b': ..."``."""
    problems = []
    for name, kind, meta, live in blobs:
        if isinstance(live, codecs.PLAIN_VALUES):
            continue
        try:
            token = BLOB.set(name)
            try:
                check_live(kind, meta, live)
            finally:
                BLOB.reset(token)
        except BlobMismatchError as ex:
            problems.append(f"blob {name!r}: {ex}")
    if problems:
        raise BlobMismatchError(
            f"{where} does not fit the live objects; nothing was restored: " + "; ".join(problems)
        )


def check_live(kind: str, meta: dict[str, Any], existing: Any) -> None:
    """Raise :class:`BlobMismatchError` when a saved blob (``kind``, ``meta``) cannot be
    restored into the live object ``existing`` (keys, shapes, dtypes, layout), without
    touching it. Loaders call this for every blob before any live object is written, so a
    mismatch in one blob never leaves another half-restored. Codecs opt in with a
    ``check(meta, existing)`` method; the others accept anything. A live stateful object
    (module, optimizer, sampler, RNGState) only takes a tree blob: any other kind would
    replace it, so it is refused."""
    load_integrations_for(existing)
    if kind != "tree" and _stateful(existing):
        raise BlobMismatchError(
            f"the checkpoint holds a {kind} where the live object is a {type(existing).__name__}: a "
            "stateful object is restored in place (load_state_dict) or not at all, never replaced"
        )
    fn = getattr(codecs.codec_for_kind(kind), "check", None)
    if fn is not None:
        fn(meta, existing)


def _stateful(value: Any) -> bool:
    """Objects that restore themselves through a state dict (as ``storage.skeleton.is_stateful``)."""
    return (
        not isinstance(value, (dict, list, tuple, type))
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )
