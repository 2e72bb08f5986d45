"""The Hugging Face Trainer's output directories, as the tools see them.

``epochal.integrations.transformers`` commits each ``checkpoint-<N>`` folder with its own
db (``rank0.<N>``: the optimizer, scheduler and RNG state, and the size and CRC-32C of every
other file of the folder, such as ``model.safetensors``). ``epochal ls``, ``verify`` and
``inspect`` take such a folder, or the output directory holding them:
``verify`` checks every file the step records (a truncated ``model.safetensors`` is named),
``ls`` lists the steps, ``inspect`` shows the folder's db.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointError
from ..integrations import hf_folder
from .dbs import verify_file
from .values import iso_time

__all__ = ["hf_checkpoints", "hf_db", "list_hf", "verify_hf"]


def hf_checkpoints(target: str) -> list[str]:
    """The epochal ``checkpoint-<N>`` folders ``target`` is (one) or holds (every one, by
    step); [] for anything else (a URL, a plain checkpoint directory)."""
    if "://" in target or not os.path.isdir(target):
        return []
    if hf_folder.is_epochal_checkpoint(target):
        return [target]
    found = []
    for name in os.listdir(target):
        step = hf_folder.checkpoint_step(name)
        folder = os.path.join(target, name)
        if step is not None and os.path.isdir(folder) and hf_folder.is_epochal_checkpoint(folder):
            found.append((step, folder))
    return [f for _, f in sorted(found)]


def hf_db(path: str) -> str:
    """``path``, or for a checkpoint folder its process-0 db (what ``inspect`` shows)."""
    if os.path.isdir(path) and hf_folder.is_epochal_checkpoint(path):
        return hf_folder.db_path(path, 0)
    return path


def _step(folder: str) -> int:
    step = hf_folder.checkpoint_step(os.path.basename(os.path.normpath(folder)))
    return -1 if step is None else step


def verify_hf(target: str, folders: list[str]) -> dict[str, Any]:
    """``epochal verify`` of checkpoint folders: each folder's dbs (every checksum) and every
    file its record lists (size and CRC-32C), one entry per step."""
    epochs = []
    files = []
    for folder in folders:
        for name in sorted(os.listdir(folder)):  # each process's db, every checksum
            if name.startswith("rank") and os.path.isfile(os.path.join(folder, name)):
                files.append(verify_file(os.path.join(folder, name), hf_folder.DB_TYPE))
        try:
            hf_folder.verify_checkpoint(folder)
            problems: list[str] = []
        except (CheckpointError, OSError) as ex:
            problems = [str(ex)]
        epochs.append({"epoch": _step(folder), "folder": folder, "ok": not problems, "problems": problems})
    ok = all(e["ok"] for e in epochs) and all(f["ok"] for f in files)
    return {"target": target, "ok": ok, "files": files, "epochs": epochs}


def list_hf(target: str, folders: list[str]) -> dict[str, Any]:
    """``epochal ls`` of checkpoint folders: a step each, its files' total size (the record's
    quick check, not the checksums: ``verify`` does those)."""
    epochs = []
    for folder in folders:
        db = hf_folder.db_path(folder, 0)
        files: dict[str, Any] = {}
        size = 0
        for name in sorted(os.listdir(folder)):
            full = os.path.join(folder, name)
            if os.path.isfile(full):
                st = os.stat(full)
                size += st.st_size
                if full == db:
                    files["rank0"] = {"path": full, "present": True, "size": st.st_size,
                                      "modified": iso_time(st.st_mtime)}
        epochs.append({"epoch": _step(folder), "state": "committed", "committed": True, "final": False,
                       "pinned": False, "db_type": hf_folder.DB_TYPE,
                       "created": files.get("rank0", {}).get("modified"), "size": size, "files": files,
                       "missing": [], "folder": folder})
    return {"prefix": target, "records": True, "nodes": ["rank0"], "epochs": epochs}
