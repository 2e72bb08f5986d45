"""One state dict out of a checkpoint, as a safetensors file other tools load without epochal.

:func:`export_safetensors` reads one blob (a module's state dict, or a dict of tensors) from a
db, verified, and writes it with ``safetensors.torch.save_model``'s own handling of shared
tensors: each group of tensors sharing memory (tied weights) is stored once, under the name
``save_model`` keeps, and the dropped names are recorded in the metadata as ``save_model``
does. So ``safetensors.torch.load_model(model, out)`` (strict) restores the model, and
``safetensors.torch.load_file(out)`` gives every tensor under its state-dict key, dtype (bf16,
fp16, float8 ...) and bits. Tied weights are shared again after the load because the
checkpoint keeps them as one tensor (:mod:`epochal.storage.encoding.tree`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError, MissingBlobError

__all__ = ["export_safetensors"]


class _StateDictOf:
    """What ``save_model`` asks of a model: its state dict (a fresh dict each time)."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self._tensors = tensors

    def state_dict(self) -> dict[str, Any]:
        return dict(self._tensors)


def _db_type_of(path: str) -> str:
    """The db type of the file ``path``, sniffed from its head by each backend (which open
    without blocking and refuse a FIFO, a device or a socket, naming it)."""
    from ..storage.formats.base import sniff_db_type

    found = sniff_db_type(path)
    return found if found is not None else "safetensors"


def _source(ckpt: str, blob: str) -> tuple[str, str]:
    """``(db path, db_type)`` of ``ckpt``: a db, or a checkpoint directory's newest committed
    epoch (the db of the node that holds ``blob``)."""
    if not os.path.isdir(ckpt):
        if not os.path.exists(ckpt):
            raise CheckpointNotFoundError(f"{ckpt}: no such checkpoint (a db, or a checkpoint directory)")
        return ckpt, _db_type_of(ckpt)
    from ..checkpoint.location.view import CheckpointDirectory
    from ..storage.formats.base import get_db_type

    d = CheckpointDirectory(ckpt)
    committed = d.committed_epochs()
    if not committed:
        raise CheckpointNotFoundError(f"{ckpt}: no committed checkpoint to export")
    epoch = committed[-1]
    manifest = d.read_manifest(epoch)
    backend = get_db_type(manifest.db_type)
    holders = []
    for node in manifest.nodes:
        path = d.db_path(node, epoch)
        if any(info.name == blob for info in backend.describe(path)):
            holders.append(path)
    if len(holders) != 1:
        what = "no db" if not holders else f"{len(holders)} dbs ({', '.join(holders)})"
        raise MissingBlobError(
            f"{ckpt}: {what} of the newest committed epoch {epoch} hold blob {blob!r}"
            + ("; export one of them by its path" if holders else "")
        )
    return holders[0], manifest.db_type


def _tensors(value: Any, where: str) -> dict[str, Any]:
    """The state dict ``value`` as ``{key: CPU tensor}``; an error naming the first entry
    that is not a tensor (safetensors holds tensors only)."""
    import numpy as np
    import torch

    if not isinstance(value, Mapping) or not value:
        raise CheckpointError(f"{where} is a {type(value).__name__}, not a state dict (a dict of tensors)")
    out: dict[str, Any] = {}
    for key, t in value.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{where}: key {key!r} is not a str (safetensors names tensors by str)")
        if isinstance(t, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(t))
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(
                f"{where}[{key!r}] is a {type(t).__name__}, not a tensor (safetensors holds tensors only)"
            )
        out[key] = t.detach().cpu() if t.device.type != "cpu" else t.detach()
    return out


def export_safetensors(
    ckpt: str | os.PathLike[str], blob: str, out: str | os.PathLike[str], *, metadata: dict[str, str] | None = None
) -> list[str]:
    """Write the state dict stored as ``blob`` in ``ckpt`` to the safetensors file ``out``.

    ``ckpt``: a db file (native or safetensors), or a checkpoint directory (its newest
    committed epoch, the db of the node holding ``blob``; a step written by ranks: ``blob``'s
    tensors gathered whole from every rank's chunks). ``metadata``: extra string
    entries for the file's header. Returns the keys written (a shared tensor's other names
    are left out, and listed in the metadata, as ``save_model`` does). The db is verified
    before anything is written; ``out`` is replaced atomically.
    """
    try:
        from safetensors.torch import save_model
    except ImportError:
        raise ImportError("export_safetensors needs safetensors and torch: pip install 'epochal[safetensors,torch]'") from None
    from ..storage.formats.base import get_db_type
    from ..storage.io import atomic
    from .distributed.world import written_by_ranks

    atomic.check_regular_output(os.fspath(out))  # a FIFO would block the writer for ever
    if os.path.isdir(os.fspath(ckpt)) and written_by_ranks(ckpt):
        # a step written by ranks: each tensor gathered whole from every rank's chunks
        from .dcp.gather import gather_state_dict

        step, tensors = gather_state_dict(ckpt, blob)
        path = os.path.join(os.fspath(ckpt), f"dcp.{step}")
    else:
        path, db_type = _source(os.fspath(ckpt), blob)
        value = get_db_type(db_type).read(path, [blob])[blob]
        tensors = _tensors(value, f"{path}, blob {blob!r}")
    meta = {"format": "pt", "source": os.path.basename(path), "blob": blob, "exported_by": "epochal"}
    meta.update(metadata or {})
    target = os.fspath(out)
    # save_model writes a temp file (mode 0644 less the umask, as every file epochal writes),
    # then fsync and rename into place: an earlier file at ``target`` survives a failure
    try:
        atomic.write_via_temp(target, lambda tmp: save_model(_StateDictOf(tensors), tmp, metadata=meta))  # type: ignore[arg-type]
    except OSError as ex:
        if ex.filename is None:
            raise OSError(ex.errno, ex.strerror or str(ex), target) from ex
        raise
    except Exception as ex:  # SafetensorError("I/O error: No space left on device") and kin
        raise CheckpointError(f"cannot write {target}: {ex}") from ex
    from safetensors import safe_open

    with safe_open(target, framework="pt") as f:
        return list(f.keys())
