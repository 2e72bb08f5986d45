"""The demo job of ``make demo``: a numpy MLP trained epoch by epoch, checkpointed every epoch.

Run it, stop it (Ctrl-C finishes the epoch and commits it, a kill loses at most that epoch),
run it again: it resumes from the newest intact checkpoint. Every step is a module-level class,
so the same job could run on a multi-machine session.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import numpy as np

from .checkpoint.tasks.manager import CheckpointManager
from .execution.task import Node, Task
from .execution.workspace import Workspace
from .jobs.events import CheckpointEvent, RunListener
from .jobs.job import Job
from .jobs.runner import JobRunner
from .sessions.local import LocalSession

SIZES = (2, 128, 128, 3)
N_POINTS, BATCH, LR, MOMENTUM = 500_000, 256, 0.005, 0.9


def make_spirals(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Three interleaved noisy spirals: a small problem an MLP needs a few epochs to learn."""
    rng = np.random.default_rng(seed)
    k = rng.integers(0, 3, size=n)
    r = rng.uniform(0.05, 1.0, size=n)
    theta = k * (2 * np.pi / 3) + r * 3 * np.pi + rng.normal(0, 0.2, size=n)
    x = np.stack([r * np.cos(theta), r * np.sin(theta)], axis=1).astype(np.float32)
    return x, k.astype(np.int64)


class InitModel:
    """init_group: the data set, the weights, their momentum buffers and the epoch counter."""

    def __init__(self, seed: int = 0, points: int = N_POINTS) -> None:
        self.seed, self.points = seed, points

    def __call__(self, ws: Workspace) -> None:
        ws["data/x"], ws["data/y"] = make_spirals(self.points, self.seed)
        rng = np.random.default_rng(self.seed + 1)
        for i, (fan_in, fan_out) in enumerate(zip(SIZES[:-1], SIZES[1:])):
            ws[f"model/w{i}"] = (rng.normal(0, 1, (fan_in, fan_out)) * np.sqrt(2 / fan_in)).astype(np.float32)
            ws[f"model/b{i}"] = np.zeros(fan_out, np.float32)
            ws[f"opt/w{i}"] = np.zeros((fan_in, fan_out), np.float32)
            ws[f"opt/b{i}"] = np.zeros(fan_out, np.float32)
        ws["epoch"] = 0
        ws["loss"] = float("nan")
        ws["accuracy"] = 0.0


def _forward(ws: Workspace, x: np.ndarray) -> list[np.ndarray]:
    acts = [x]
    layers = len(SIZES) - 1
    for i in range(layers):
        h = acts[-1] @ ws[f"model/w{i}"] + ws[f"model/b{i}"]
        acts.append(np.maximum(h, 0) if i < layers - 1 else h)
    return acts


class TrainEpoch:
    """epoch_group: one shuffled pass of minibatch SGD with momentum (PRIVATE task: only the
    global blobs it updates persist)."""

    def __init__(self, target_epochs: int) -> None:
        self.target_epochs = target_epochs

    def __call__(self, ws: Workspace) -> None:
        epoch = int(ws["epoch"]) + 1
        x, y = ws["data/x"], ws["data/y"]
        order = np.random.default_rng(1000 + epoch).permutation(len(x))  # reproducible per epoch
        layers = len(SIZES) - 1
        total, correct = 0.0, 0
        for start in range(0, len(x), BATCH):
            idx = order[start:start + BATCH]
            acts = _forward(ws, x[idx])
            logits = acts[-1]
            logits = logits - logits.max(axis=1, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(axis=1, keepdims=True)
            yb = y[idx]
            total += float(-np.log(p[np.arange(len(idx)), yb] + 1e-12).sum())
            correct += int((p.argmax(axis=1) == yb).sum())
            grad = p
            grad[np.arange(len(idx)), yb] -= 1
            grad /= len(idx)
            for i in reversed(range(layers)):
                gw, gb = acts[i].T @ grad, grad.sum(axis=0)
                if i:
                    grad = (grad @ ws[f"model/w{i}"].T) * (acts[i] > 0)
                for name, g in ((f"w{i}", gw), (f"b{i}", gb)):
                    v = ws[f"opt/{name}"]
                    v *= MOMENTUM
                    v += g
                    ws[f"model/{name}"] -= LR * v
        ws["epoch"] = epoch
        ws["loss"] = total / len(x)
        ws["accuracy"] = correct / len(x)
        ws["demo/done"] = np.bool_(epoch >= self.target_epochs)


class DemoPrinter(RunListener):
    """Prints one line per epoch: loss, accuracy, epoch time, checkpoint time and size."""

    def __init__(self, session: LocalSession, out: TextIO | None = None) -> None:
        self.session, self.out = session, out
        self.epoch_seconds = 0.0

    def _say(self, text: str) -> None:
        print(text, file=self.out or sys.stdout, flush=True)

    def on_train_start(self, resume_epoch: int | None, nodes: list[str]) -> None:
        if resume_epoch is None:
            self._say("epochal demo: starting a new job (3-class spirals, numpy MLP 2-128-128-3)")
        else:
            self._say(f"epochal demo: resuming after epoch {resume_epoch}")

    def on_epoch_end(self, epoch: int, seconds: float) -> None:
        self.epoch_seconds = seconds

    def on_checkpoint(self, event: CheckpointEvent) -> None:
        size = f"{event.nbytes / 2**20:.1f} MiB"
        ws = self.session.ws
        if not event.ok:
            self._say(f"  checkpoint of epoch {event.epoch} FAILED: {event.error}")
        elif event.action == "checkpoint_load":
            self._say(f"  loaded checkpoint {event.epoch} ({size}) in {event.seconds * 1e3:.1f} ms")
        elif event.epoch == 0:
            self._say(f"  checkpoint 0 (initial state) saved: {size} in {event.seconds * 1e3:.1f} ms")
        else:
            self._say(
                f"epoch {event.epoch:3d}  loss {float(ws['loss']):.4f}  accuracy {100 * float(ws['accuracy']):5.1f}%"
                f"  epoch {self.epoch_seconds:5.2f} s  checkpoint {event.seconds * 1e3:6.1f} ms {size}"
            )

    def on_epoch_start(self, epoch: int) -> None:
        self.trained = True

    def on_train_end(self, epoch: int, preempted: bool) -> None:
        if preempted:
            self._say(f"stopped after epoch {epoch}, which is committed: run again to resume")
        elif not getattr(self, "trained", False):
            self._say(f"the job already finished at epoch {epoch}: nothing left to train "
                      "(pass a larger --epochs to train on)")


def build_job(epochs: int, seed: int = 0, points: int = N_POINTS) -> tuple[Job, Any]:
    """The demo Job: init (GLOBAL), one training task per epoch, stop after ``epochs``."""
    with Node("trainer"):
        with Job() as job:
            with job.init_group:
                Task(step=InitModel(seed, points), name="init_model")
            task = Task(step=TrainEpoch(epochs), outputs=["demo/done"], name="train")
        job.add_stop_condition(task.outputs()[0])
    return job, task


def run_demo(
    directory: str = "checkpoints",
    epochs: int = 10,
    quiet: bool = False,
    keep_last: int | None = 3,
    points: int = N_POINTS,
    more: int | None = None,
) -> int:
    """Train (or resume) the demo job with checkpoints under ``directory``; return the last epoch.

    ``epochs`` is the job's total; with ``more``, the total is the newest committed epoch plus
    ``more``, so every run resumes the job and trains that many epochs further.
    """
    import os

    from .checkpoint.handler.directory import DirectoryMetadataHandler
    from .checkpoint.location.view import CheckpointDirectory

    os.makedirs(directory, exist_ok=True)
    session = LocalSession()
    handler = DirectoryMetadataHandler(keep_last=keep_last)
    manager = CheckpointManager(directory, "trainer", metadata_handler=handler)
    records = CheckpointDirectory(directory)
    committed = records.committed_epochs()
    if more is not None:
        epochs = (committed[-1] if committed else 0) + more
    job, _ = build_job(epochs, points=points)
    listeners = [] if quiet else [DemoPrinter(session)]
    # A finished job reruns nothing; asked for more epochs, continue from its last one.
    resume = None
    if committed and committed[-1] < epochs and records.read_manifest(committed[-1]).final:
        resume = committed[-1]
    start = time.perf_counter()
    last = JobRunner(job, manager, resume_from_epoch=resume, listeners=listeners, progress=False).train(session)
    if not quiet:
        ws = session.ws
        print(
            f"done: epoch {last}, loss {float(ws['loss']):.4f}, accuracy {100 * float(ws['accuracy']):.1f}% "
            f"({time.perf_counter() - start:.1f} s). Checkpoints in {directory}/ "
            f"(inspect them with `epochal ls {directory}`); run again to resume, "
            f"delete the directory to start over.",
            flush=True,
        )
    return last
