"""A tiny Lightning run for tests/test_lightning.py and bench/bench_lightning.py: a model, its
data, and :func:`run`, which fits it with a ModelCheckpoint (every N steps, last, top-k) through
epochal's CheckpointIO or Lightning's own, optionally resuming and optionally killing itself
with SIGKILL at a chosen point (between saves, or inside one)."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from epochal.integrations.lightning import EpochalCheckpointIO, RNGStateCallback

N_SAMPLES, BATCH = 40, 4  # 10 steps a pass


class TinyModule(L.LightningModule):
    """An MLP regression with AdamW and a StepLR schedule (their states are in the checkpoint)."""

    def __init__(self, hidden: int = 16, lr: float = 0.05, label: str = "tiny", dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Dropout(dropout),
                                       torch.nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, 6, generator=g)
    return torch.utils.data.TensorDataset(x, torch.sin(x).sum(1, keepdim=True))


def loader(stateful: bool = False) -> Any:
    ds = dataset()
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import RandomSampler

        return StatefulDataLoader(ds, batch_size=BATCH, generator=torch.Generator(),
                                  sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(7)))
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True)


class _KillAt(Callback):
    """SIGKILL this process at the start of training step ``step`` (after the saves of the
    steps before it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class _StartStep(Callback):
    def __init__(self, r: Run) -> None:
        self.r = r

    def on_train_start(self, trainer: Any, *args: Any) -> None:
        self.r.started_at = trainer.global_step


def kill_inside_saves(save_no: int, where: str, name: str = "last.ckpt") -> None:
    """SIGKILL this process inside its ``save_no``-th write (1-based) of a checkpoint file
    called ``name``: ``"commit"`` once the temp file is written, before its rename; ``"write"``
    (epochal's IO only) after its first bytes. Lightning's torch IO (an fsspec transaction)
    and epochal's (AtomicFile) both put the final name in place with os.rename/os.replace."""
    from epochal.storage.io import atomic

    count = {"saves": 0}
    real_replace, real_rename, real_init = os.replace, os.rename, atomic.AtomicFile.__init__

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def started(self: Any, path: Any, *a: Any, **kw: Any) -> None:
        real_init(self, path, *a, **kw)
        if os.path.basename(str(path)) == name:
            count["saves"] += 1
            if where == "write" and count["saves"] == save_no:
                real_write = self.write

                def write(buf: Any) -> int:
                    n = real_write(buf)
                    die()
                    return n

                self.write = write

    def renamed(real: Any) -> Any:
        def fn(src: Any, dst: Any, *a: Any, **kw: Any) -> Any:
            if os.path.basename(str(dst)) == name:
                if ".tmp." not in os.path.basename(str(src)):  # torch IO's temp (mkstemp)
                    count["saves"] += 1
                if where == "commit" and count["saves"] == save_no:
                    die()
            return real(src, dst, *a, **kw)
        return fn

    atomic.AtomicFile.__init__ = started  # type: ignore[method-assign]
    os.replace = renamed(real_replace)
    os.rename = renamed(real_rename)


@dataclass
class Run:
    """One fit: ``io`` "epochal" or "torch"; ``ckpt_path`` for the resume (None: from scratch)."""

    directory: str
    io: str = "epochal"
    max_steps: int = 25
    every: int = 3
    top_k: int = 2
    ckpt_path: str | None = None
    stateful_loader: bool = False
    kill_step: int | None = None
    dropout: float = 0.0
    rng: bool = False
    #: set by :func:`run`: the global step training started from (the resumed checkpoint's)
    started_at: int | None = None
    extra_callbacks: list[Any] = field(default_factory=list)


def run(r: Run) -> tuple[L.Trainer, TinyModule]:
    torch.manual_seed(0)
    model = TinyModule(dropout=r.dropout)
    ckpt = ModelCheckpoint(dirpath=r.directory, every_n_train_steps=r.every, save_last=True,
                           save_top_k=r.top_k, monitor="train_loss")
    callbacks: list[Any] = [ckpt, _StartStep(r), *r.extra_callbacks]
    if r.rng:
        callbacks.append(RNGStateCallback())
    if r.kill_step is not None:
        callbacks.append(_KillAt(r.kill_step))
    plugins = [EpochalCheckpointIO()] if r.io == "epochal" else []
    trainer = L.Trainer(max_steps=r.max_steps, callbacks=callbacks, plugins=plugins, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, deterministic=True, accelerator="cpu", devices=1)
    trainer.fit(model, loader(r.stateful_loader), ckpt_path=r.ckpt_path)
    return trainer, model


def params(model: torch.nn.Module) -> dict[str, bytes]:
    """The raw bytes of every parameter (a bit-for-bit comparison)."""
    return {k: v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for k, v in model.state_dict().items()}
