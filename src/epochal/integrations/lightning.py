"""Lightning: every checkpoint file Lightning writes is an epochal checkpoint, by one plugin.

::

    from epochal.integrations.lightning import EpochalCheckpointIO, load_lightning_module

    trainer = L.Trainer(plugins=[EpochalCheckpointIO()],
                        callbacks=[ModelCheckpoint(dirpath="ckpt", save_last=True, save_top_k=2,
                                                   monitor="val_loss", every_n_train_steps=500)])
    trainer.fit(model, ckpt_path="last")                 # resumes from ckpt/last.ckpt, if any
    model = load_lightning_module(MyModule, "ckpt/last.ckpt", map_location="cpu")   # inference

:class:`EpochalCheckpointIO` is a Lightning ``CheckpointIO``: Lightning (its
``ModelCheckpoint``, ``Trainer.save_checkpoint``, Fabric's ``save``) decides when and under
which name a checkpoint is written and which ones are deleted; this plugin decides how the
bytes go to disk. Each file (``*.ckpt``, at the path Lightning gives) is one native db
(docs/format.md): written to a temp name, fsynced, renamed into place (a kill at any instant
leaves the previous file whole), a CRC-32C on every byte, and no pickle: one blob per key of
Lightning's checkpoint dict (``state_dict``, ``optimizer_states``, ``lr_schedulers``,
``loops``, ``callbacks``, ``hyper_parameters``, ...), each stored by epochal's codecs
(tensors raw, containers as a JSON skeleton). A value no codec stores without pickle (an
object in the hyper-parameters, say) fails the save with
:class:`~epochal.errors.UnsupportedBlobError` naming its key path; earlier files are untouched.

Loading (a resume, ``load_checkpoint``, :func:`load_lightning_module`) checks every checksum
before anything is decoded and never runs code from the file. Lightning's own
``LightningModule.load_from_checkpoint`` calls ``torch.load`` and cannot read these files:
use :func:`load_lightning_module`. FSDP and ModelParallel strategies write distributed
checkpoints through ``torch.distributed.checkpoint`` and do not call a ``CheckpointIO`` for
them: not covered yet (see docs/lightning.md).

No manifests or epochal retention: Lightning's ``ModelCheckpoint`` owns the names, top-k and
``last``; each file verifies on its own (``epochal verify/inspect/export`` take it directly).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.callbacks import Callback
except ImportError as _ex:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"epochal.integrations.lightning needs Lightning 2.6 (the `lightning` package): "
        f"pip install 'epochal[lightning]' ({_ex})"
    ) from _ex

from ..checkpoint.location.lock import pid_alive
from ..errors import BlobMismatchError, CheckpointError, UnsupportedBlobError
from ..storage.encoding.codecs import LoadOptions, load_options
from ..storage.encoding.skeleton import is_stateful, path_str, type_name
from ..storage.formats.base import get_db_type, sniff_db_type
from ..storage.io import atomic
from ..storage.io.seam import is_url, local_path, store_for
from .rng import RNGState
from .state_check import keys_of, state_fit

__all__ = ["EpochalCheckpointIO", "RNGStateCallback", "load_checkpoint", "load_lightning_module"]

logger = logging.getLogger("epochal")

DB_TYPE = "native"

#: Lightning's private helpers :func:`load_lightning_module` relies on (module, name): the one
#: place to change when a Lightning release moves them.
_LOAD_STATE = ("lightning.pytorch.core.saving", "_load_state")
_MIGRATE = ("lightning.pytorch.utilities.migration.utils", "_pl_migrate_checkpoint")


def _check_plain(value: Any, path: tuple[Any, ...]) -> None:
    """Refuse objects that epochal would store as their state dict (they would come back as
    a dict, not as the object ``torch.save`` pickles): :class:`UnsupportedBlobError` naming
    the key path. Containers are walked; other leaves are left to the codecs (which name the
    path of anything they cannot store)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, path)]
    seen: set[int] = set()
    while stack:
        v, p = stack.pop()
        if isinstance(v, dict):
            if id(v) in seen:
                continue
            seen.add(id(v))
            stack.extend((x, (*p, k)) for k, x in v.items())
        elif isinstance(v, (list, tuple)):
            if id(v) in seen:
                continue
            seen.add(id(v))
            stack.extend((x, (*p, i)) for i, x in enumerate(v))
        elif is_stateful(v):
            raise UnsupportedBlobError(
                f"checkpoint{path_str(p)} is a {type_name(v)}, which epochal stores only as its "
                "state dict (it would load back as a dict, not the object): leave it out of the "
                "checkpoint (for hyper-parameters: save_hyperparameters(ignore=[...]))"
            )


def _blobs(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The blobs of one Lightning checkpoint dict: one per top-level key (str keys only)."""
    if not isinstance(checkpoint, dict):
        raise UnsupportedBlobError(f"a Lightning checkpoint is a dict, got a {type_name(checkpoint)}")
    for key, value in checkpoint.items():
        if not isinstance(key, str) or not key:
            raise UnsupportedBlobError(
                f"checkpoint key {key!r}: the top-level keys of a checkpoint must be non-empty str"
            )
        _check_plain(value, (key,))
    return checkpoint


def _clean_temp(folder: str) -> list[str]:
    """Remove temp files of killed saves in ``folder`` (``*.tmp.<host>.<pid>.<token>`` of this
    host whose process is gone); another host's are never touched."""
    me, removed = atomic.hostname(), list[str]()
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        parsed = atomic.parse_temp_path(name)
        if parsed is None:
            continue
        _, host, pid = parsed
        if host != me or pid == os.getpid() or pid_alive(pid):
            continue
        try:
            os.unlink(os.path.join(folder, name))
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as ex:
            logger.warning("Cannot remove the leftover temp file %s: %s", os.path.join(folder, name), ex)
    if removed:
        logger.info("Removed %d leftover temp file(s) of killed saves in %s: %s", len(removed), folder, removed)
    return removed


def load_checkpoint(path: str | os.PathLike[str], *, map_location: Any = None) -> dict[str, Any]:
    """The checkpoint dict of the epochal checkpoint file ``path``, as Lightning saved it.

    Every checksum is verified before anything is decoded; nothing is unpickled.
    ``map_location``: a device, a device string, or a dict from saved device to device (a
    callable is refused: epochal runs no code to place tensors); None puts each tensor on
    the device it was saved from, or on the CPU when this process lacks it (with a warning).
    FileNotFoundError when ``path`` does not exist (as Lightning's own IO), CheckpointError
    when it is not an epochal checkpoint (a ``torch.save`` file, say),
    :class:`~epochal.errors.CheckpointCorruptError` naming the file and blob when damaged.
    """
    p = os.fspath(path)
    if callable(map_location):
        raise TypeError(
            f"load_checkpoint({p!r}): map_location must be a device, a device string or a dict "
            "of them; epochal does not call a function to place tensors"
        )
    if not store_for(p).exists(p):
        raise FileNotFoundError(f"Checkpoint file not found: {p}")
    kind = sniff_db_type(p)
    if kind is not None and kind != DB_TYPE:
        raise CheckpointError(f"{p} is not a Lightning checkpoint written by epochal (it is a {kind} db)")
    if kind is None and _head(p).startswith(_TORCH_SAVE_HEADS):
        raise CheckpointError(
            f"{p} is not an epochal checkpoint (torch.save wrote it: Lightning's own "
            "TorchCheckpointIO); resume it without this plugin"
        )
    # (any other head: the native reader names the damage, e.g. a damaged superblock)
    with load_options(LoadOptions(map_location=map_location, where=f"Lightning checkpoint {p}")):
        return dict(get_db_type(DB_TYPE).read(p))


#: the first bytes of a torch.save file: a zip archive, or a legacy pickle stream
_TORCH_SAVE_HEADS = (b"PK\x03\x04", b"\x80")


def _head(path: str) -> bytes:
    src = store_for(path).open_read(path, what="checkpoint")
    try:
        return bytes(src.read(min(4, src.size()), 0))
    finally:
        src.close()


class EpochalCheckpointIO(CheckpointIO):
    """Lightning's checkpoint files as epochal checkpoints (see the module doc):
    ``Trainer(plugins=[EpochalCheckpointIO()])`` or ``Fabric(plugins=[...])``.

    ``save_checkpoint`` writes the whole checkpoint dict as one native db at ``path``
    (parent directories created; temp file, fsync, rename, directory fsync; the temp files
    of saves killed earlier in that directory are removed on its first save);
    ``load_checkpoint`` reads it back, every checksum verified first, no pickle;
    ``remove_checkpoint`` deletes it as Lightning's own IO does (top-k, ``last``).
    """

    def __init__(self) -> None:
        super().__init__()
        self._cleaned: set[str] = set()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically and durably. ``storage_options`` is
        refused (TypeError), as by Lightning's TorchCheckpointIO. Raises
        :class:`~epochal.errors.UnsupportedBlobError` naming the key path of a value that
        cannot be stored without pickle (nothing is written then)."""
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                f"`{type(self).__name__}`"
            )
        p = local_path(path)  # file:// is the local disk
        blobs = _blobs(checkpoint)
        if not is_url(p):
            folder = os.path.dirname(os.path.abspath(p))
            os.makedirs(folder, exist_ok=True)
            if folder not in self._cleaned:
                self._cleaned.add(folder)
                _clean_temp(folder)
        get_db_type(DB_TYPE).write(p, blobs)

    def load_checkpoint(
        self,
        path: Any,
        map_location: Callable[..., Any] | Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The checkpoint dict at ``path`` (see :func:`load_checkpoint`). ``weights_only`` is
        accepted and needs nothing: nothing is ever unpickled. A callable ``map_location``
        (Lightning passes none on a resume) is treated as "where saved".

        Called by a Trainer's strategy to resume, the checkpoint's ``state_dict`` is checked
        against the live LightningModule before it is returned (keys, unless the module sets
        ``strict_loading = False``, and shapes always): Lightning's own ``load_state_dict``
        would copy the keys that fit before raising. A misfit is a BlobMismatchError naming
        the keys, with nothing written."""
        checkpoint = load_checkpoint(path, map_location=None if callable(map_location) else map_location)
        module = _resuming_module(sys._getframe(1))
        if module is not None and isinstance(checkpoint.get("state_dict"), dict):
            fit = state_fit(keys_of(checkpoint["state_dict"].items()), module)
            if not getattr(module, "strict_loading", True):
                fit.missing, fit.unexpected = [], []  # strict=False: only the shapes must fit
            if not fit.ok:
                raise BlobMismatchError(fit.message(f"Lightning checkpoint {os.fspath(path)}",
                                                    f"the live {type(module).__name__}"))
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` if it exists (as Lightning's TorchCheckpointIO)."""
        from lightning.fabric.utilities.cloud_io import get_filesystem

        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)
            logger.debug("Removed checkpoint: %s", path)


def _resuming_module(frame: Any) -> Any:
    """The LightningModule of the strategy whose ``load_checkpoint`` called this IO (a few
    frames up: Lightning gives a CheckpointIO no reference to its strategy); None when the
    caller is not a strategy (a user's own call, Fabric) or it holds no module."""
    from lightning.pytorch.strategies import Strategy

    for _ in range(4):
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if isinstance(caller, Strategy):
            return caller.lightning_module
        frame = frame.f_back
    return None


class RNGStateCallback(Callback):
    """The random generators (Python, numpy, torch CPU and CUDA) in every checkpoint, set
    again on a resume: Lightning saves none, so without it a resumed run draws other dropout
    masks and augmentations than the uninterrupted one. ``Trainer(callbacks=[RNGStateCallback(),
    ...])``; any CheckpointIO. With a stateful data loader it makes a mid-epoch resume
    exact (docs/lightning.md)."""

    def state_dict(self) -> dict[str, Any]:
        return RNGState(torch=True).state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        RNGState(torch=True).load_state_dict(state_dict)


def _lightning_attr(spec: tuple[str, str]) -> Any:
    import importlib

    module, name = spec
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as ex:
        raise ImportError(
            f"load_lightning_module needs {module}.{name}, which this Lightning version lacks "
            f"({ex}); epochal.integrations.lightning names it in _LOAD_STATE/_MIGRATE"
        ) from None


def load_lightning_module(
    cls: Any,
    path: str | os.PathLike[str],
    *,
    map_location: Any = None,
    strict: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path, ...)`` for an epochal checkpoint file: a
    ``LightningModule`` (or ``LightningDataModule``) subclass built from the saved
    hyper-parameters (``kwargs`` override them, as in Lightning) with the saved weights
    loaded (``strict`` as in Lightning), on the device of the saved tensors (after
    ``map_location``, see :func:`load_checkpoint`). Lightning's ``load_from_checkpoint``
    calls ``torch.load`` and cannot read these files; this does what it does after reading,
    with Lightning's own helpers, and never unpickles."""
    import lightning.pytorch as pl
    import torch

    p = os.fspath(path)
    checkpoint = load_checkpoint(p, map_location=map_location)
    checkpoint = _lightning_attr(_MIGRATE)(checkpoint, checkpoint_path=p)
    key = cls.CHECKPOINT_HYPER_PARAMS_KEY
    hparams = checkpoint.get(key)
    checkpoint[key] = dict(hparams) if isinstance(hparams, dict) else {}
    checkpoint[key].update(kwargs)
    load_state = _lightning_attr(_LOAD_STATE)
    if issubclass(cls, pl.LightningDataModule):
        return load_state(cls, checkpoint, **kwargs)
    if not issubclass(cls, pl.LightningModule):
        raise TypeError(f"load_lightning_module: {cls!r} is not a LightningModule or LightningDataModule subclass")
    model = load_state(cls, checkpoint, strict=strict, **kwargs)
    state_dict = checkpoint.get("state_dict") or {}
    device = next((t.device for t in state_dict.values() if isinstance(t, torch.Tensor)), None)
    return model.to(device) if device is not None else model
