"""Hugging Face ``transformers.Trainer`` with epochal checkpoints: change one import.

::

    from epochal.integrations.transformers import Trainer     # was: from transformers import Trainer

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.train(resume_from_checkpoint=True)                 # the newest intact checkpoint

For a subclass of your own (TRL's ``SFTTrainer`` ...)::

    class MyTrainer(EpochalTrainerMixin, SFTTrainer): ...

Each ``checkpoint-<N>`` folder the Trainer writes in ``output_dir`` keeps transformers' model
files as transformers writes them (``model.safetensors``, ``config.json`` ...: ``from_pretrained``
reads the folder) and ``trainer_state.json``; the optimizer, LR scheduler, grad scaler and
each process's RNG state go into epochal native dbs (``rank<i>.<N>``) instead of pickles, and
process 0's db records the size and CRC-32C of every other file. The folder is written under a
temp name and renamed when complete (:mod:`epochal.integrations.hf_folder`), so a kill during
a save never leaves a ``checkpoint-<N>`` that a resume would pick and then fail on.

``train(resume_from_checkpoint=True)`` takes the newest folder that verifies whole (a damaged
or foreign newer one is skipped with a warning naming it); a path is verified before use.
From there transformers' own resume runs unchanged (its batch skipping, its RNG restore
points), with every load replaced by a checked, pickle-free one. Not covered: DeepSpeed, FSDP,
XLA/TPU and SageMaker model parallelism (their checkpoints are their own; a clear error).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import safetensors.torch
import transformers
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, sort_checkpoints

from ..checkpoint.tasks.steps import LoadBlobs
from ..errors import CheckpointError
from ..storage.formats.base import get_db_type
from . import hf_folder
from .rng import RNGState
from .state_check import check_weights_fit, safetensors_header

__all__ = ["EpochalTrainerMixin", "Trainer", "TESTED_TRANSFORMERS", "OVERRIDDEN", "CALLED"]

logger = logging.getLogger("epochal")

#: the transformers release this module is tested against (docs/huggingface.md)
TESTED_TRANSFORMERS = "5.24.0"
#: transformers.Trainer's private methods this module overrides ...
OVERRIDDEN = (
    "_save_checkpoint",
    "_load_from_checkpoint",
    "_load_best_model",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_load_rng_state",
)
#: ... and those it calls: a transformers release that changes one is a change to this module
CALLED = ("store_flos", "_get_output_dir", "_push_from_checkpoint", "_issue_warnings_after_load")

_missing = [n for n in OVERRIDDEN + CALLED if not callable(getattr(transformers.Trainer, n, None))]
if _missing:
    raise ImportError(
        f"epochal.integrations.transformers was written for transformers {TESTED_TRANSFORMERS}; "
        f"transformers {transformers.__version__}'s Trainer lacks {', '.join(_missing)}"
    )

TRAINER_STATE_NAME = "trainer_state.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
_BIN_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def _is_peft(model: Any) -> bool:
    return type(model).__name__.startswith("Peft") or hasattr(model, "peft_config")


class EpochalTrainerMixin:
    """Put before ``transformers.Trainer`` (or a subclass of it) in the bases: its checkpoints
    become epochal checkpoints (see the module doc). Everything else is the Trainer's."""

    # -- resume
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``transformers.Trainer.train``; ``resume_from_checkpoint=True`` picks the newest
        checkpoint of ``output_dir`` that verifies whole (damaged newer ones are skipped with
        a warning), a path is verified first (CheckpointError naming the file when it fails)."""
        targs = self.args  # type: ignore[attr-defined]
        if targs.should_save and targs.process_index == 0:
            hf_folder.remove_stale(targs.output_dir)
        read: hf_folder.CheckpointRead | None = None
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            self._epochal_check_supported()
            read = hf_folder.find_resume_checkpoint(targs.output_dir, targs.process_index)
            if read is None:
                raise ValueError(f"No valid checkpoint found in output directory ({targs.output_dir})")
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            self._epochal_check_supported()
            read = hf_folder.read_checkpoint(os.fspath(resume_from_checkpoint), targs.process_index)
        if read is not None:
            resume_from_checkpoint = read.folder
            logger.info("Resuming from %s", read.folder)
        self._epochal_read = read  # what the loads take, so that each byte is read once
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._epochal_read = None

    def _epochal_take(self, folder: str, name: str, process_index: int = 0) -> tuple[bool, Any]:
        """``(True, value)`` from the checkpoint train() read and checked, once per blob;
        ``(False, None)`` when the loads must read ``folder`` themselves."""
        read: hf_folder.CheckpointRead | None = getattr(self, "_epochal_read", None)
        if read is None or os.path.normpath(read.folder) != os.path.normpath(folder):
            return False, None
        return read.take(name, process_index)

    def _epochal_check_supported(self) -> None:
        t: Any = self
        if t.is_deepspeed_enabled or t.is_fsdp_enabled or getattr(t, "is_fsdp_xla_enabled", False):
            raise CheckpointError(
                "epochal's Trainer does not cover DeepSpeed or FSDP checkpoints yet: use "
                "transformers.Trainer for those runs"
            )
        from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

        if is_sagemaker_mp_enabled() or is_torch_xla_available():
            raise CheckpointError("epochal's Trainer does not cover SageMaker model parallelism or XLA")
        if t.args.save_on_each_node and t.args.world_size > 1:
            raise CheckpointError(
                "epochal's Trainer commits each checkpoint from process 0 into a folder all processes "
                "share: save_on_each_node (a disk per node) is not covered"
            )

    def _epochal_require(self, folder: str) -> None:
        if not hf_folder.is_epochal_checkpoint(folder):
            raise CheckpointError(
                f"{folder}: not a checkpoint written by epochal (transformers' own checkpoints hold "
                "pickles, which epochal does not load): resume it with transformers.Trainer once"
            )

    # -- saving
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """transformers' ``_save_checkpoint``, writing into a temp folder committed by a rename."""
        t: Any = self
        args = t.args
        self._epochal_check_supported()
        step = int(t.state.global_step)
        if t.hp_search_backend is None and trial is None:
            t.store_flos()
        run_dir = t._get_output_dir(trial=trial)
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        temp = hf_folder.temp_folder(run_dir, step)
        writer = args.should_save and args.process_index == 0
        if writer:
            hf_folder.remove_stale_path(temp)
        t.accelerator.wait_for_everyone()
        os.makedirs(temp, exist_ok=True)
        t.save_model(temp, _internal_call=True)
        self._epochal_best_checkpoint(run_dir, step)
        blobs: dict[str, Any] = {}
        if not args.save_only_model:
            blobs["rng"] = RNGState(torch=True)
            if args.should_save:
                blobs["optimizer"], blobs["scheduler"] = t.optimizer, t.lr_scheduler
                scaler = getattr(t.accelerator, "scaler", None)
                if scaler is not None:
                    blobs["scaler"] = scaler
        if args.should_save:
            for cb in [c for c in t.callback_handler.callbacks + [t.control] if isinstance(c, ExportableState)]:
                name, cb_state = cb.__class__.__name__, cb.state()
                if isinstance(t.state.stateful_callbacks[name], list):
                    t.state.stateful_callbacks[name].append(cb_state)
                else:
                    t.state.stateful_callbacks[name] = cb_state
            t.state.save_to_json(os.path.join(temp, TRAINER_STATE_NAME))
        backend = get_db_type(hf_folder.DB_TYPE)
        if not writer and blobs:
            backend.write(hf_folder.db_path(temp, args.process_index, step), blobs)
        t.accelerator.wait_for_everyone()
        if writer:
            ranks = re.compile(rf"^rank\d+\.{step}$")
            blobs[hf_folder.FILES_BLOB] = hf_folder.record_files(
                temp, skip={n for n in os.listdir(temp) if ranks.match(n)})
            self._epochal_write(backend, hf_folder.db_path(temp, 0, step), blobs)
            hf_folder.commit_folder(temp, final)
        t.accelerator.wait_for_everyone()
        if args.push_to_hub:
            t._push_from_checkpoint(final)
        if args.should_save:
            self._epochal_rotate(run_dir)

    def _epochal_write(self, backend: Any, path: str, blobs: dict[str, Any]) -> None:
        """Process 0's db, the last file of the folder (a seam for tests that kill mid-save)."""
        backend.write(path, blobs)

    def _epochal_best_checkpoint(self, run_dir: str, step: int) -> None:
        """transformers' bookkeeping of the best checkpoint's folder (the folder being saved is
        not under its name yet: it counts as existing)."""
        t: Any = self
        if t.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and t.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{t.state.best_global_step}")
            if t.state.best_global_step == step or os.path.exists(best):
                t.state.best_model_checkpoint = best

    def _epochal_rotate(self, run_dir: str) -> None:
        """transformers' ``rotate_checkpoints`` (keep ``save_total_limit``, the newest and the
        best), deleting each folder by renaming it away first."""
        t: Any = self
        limit = t.args.save_total_limit
        if limit is None or limit <= 0:
            return
        checkpoints = sort_checkpoints(run_dir, use_mtime=True)
        if len(checkpoints) <= limit:
            return
        protected = {checkpoints[-1]}
        if t.state.best_model_checkpoint is not None:
            protected.add(os.path.normpath(t.state.best_model_checkpoint))
        keep, remaining = max(limit, len(protected)), len(checkpoints)
        for folder in checkpoints:
            if remaining <= keep:
                break
            if os.path.normpath(folder) not in protected:
                hf_folder.remove_folder(folder)
                remaining -= 1

    # -- loading
    def _epochal_load(self, folder: str, process_index: int, live: dict[str, Any]) -> list[str]:
        """Restore the live objects ``live`` from a db of ``folder`` (the values train() read,
        or the file, checked before anything is touched); returns the names the db lacks."""
        missing, rest = [], {}
        for name, obj in live.items():
            cached, value = self._epochal_take(folder, name, process_index)
            if not cached:
                rest[name] = obj
            elif value is None:
                missing.append(name)
            else:
                obj.load_state_dict(value)
        if not rest:
            return missing
        db = hf_folder.db_path(folder, process_index)
        if not os.path.exists(db):
            return missing + list(rest)
        load = LoadBlobs(db, hf_folder.DB_TYPE, list(rest), node=f"rank{process_index}",
                         epoch=hf_folder.checkpoint_step(folder) or 0, allow_incomplete=True)
        load(dict(rest))
        return missing + load.missing

    def _epochal_load_weights(self, folder: str, model: Any) -> bool:
        """Load ``model.safetensors`` of ``folder`` into ``model``, its bytes checked against the
        checkpoint's record (read once: by train(), or here); False when the folder has no such
        single file or the model is an adapter model (transformers' own loader then runs)."""
        t: Any = self
        if not os.path.isfile(os.path.join(folder, SAFE_WEIGHTS_NAME)) or _is_peft(model):
            if any(os.path.exists(os.path.join(folder, n)) for n in _BIN_WEIGHTS):
                raise CheckpointError(f"{folder}: the weights are pickles (pytorch_model.bin), which epochal does not load")
            return False
        _, data = self._epochal_take(folder, "weights")
        if data is None:
            data = hf_folder.read_file_checked(folder, SAFE_WEIGHTS_NAME)
        # the checkpoint's keys and shapes (its header alone) against the live model, before
        # any tensor of it is written: load_state_dict(strict=False) below copies the keys
        # that fit and then raises, or drops the rest without a word
        check_weights_fit(os.path.join(folder, SAFE_WEIGHTS_NAME), safetensors_header(data), model)
        state_dict = safetensors.torch.load(data)
        del data
        result = model.load_state_dict(state_dict, False)
        del state_dict
        t._issue_warnings_after_load(result)
        return True

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        self._epochal_check_supported()
        self._epochal_require(resume_from_checkpoint)
        t: Any = self
        model = t.model if model is None else model
        logger.info("Loading model from %s", resume_from_checkpoint)
        if not self._epochal_load_weights(resume_from_checkpoint, model):
            # sharded safetensors or adapters: train() verified the folder whole; transformers'
            # safetensors loaders read it
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]

    def _load_best_model(self) -> None:
        t: Any = self
        best = t.state.best_model_checkpoint
        if best is None or not hf_folder.is_epochal_checkpoint(best):
            raise CheckpointError(f"{best}: the best checkpoint is not an epochal checkpoint folder")
        self._epochal_check_supported()
        logger.info("Loading best model from %s (score: %s)", best, t.state.best_metric)
        if not self._epochal_load_weights(best, t.model):
            hf_folder.verify_checkpoint(best)
            super()._load_best_model()  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self._epochal_check_supported()
        self._epochal_require(checkpoint)
        t: Any = self
        missing = self._epochal_load(checkpoint, 0, {"optimizer": t.optimizer, "scheduler": t.lr_scheduler})
        if len(missing) == 1:  # none: a save_only_model checkpoint (transformers loads none either)
            raise CheckpointError(f"{hf_folder.db_path(checkpoint, 0)} holds no {missing[0]!r}")

    def _load_scaler(self, checkpoint: str | None) -> None:
        t: Any = self
        scaler = getattr(t.accelerator, "scaler", None)
        if checkpoint is None or scaler is None:
            return
        self._epochal_require(checkpoint)
        self._epochal_load(checkpoint, 0, {"scaler": scaler})

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self._epochal_require(checkpoint)
        t: Any = self
        index = t.args.process_index if t.args.world_size > 1 else 0
        if self._epochal_load(checkpoint, index, {"rng": RNGState(torch=True)}):
            logger.info("%s holds no RNG state for process %d: reproducibility is not guaranteed",
                        checkpoint, index)


class Trainer(EpochalTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` whose checkpoints are epochal checkpoints (see the module doc)."""
