#!/usr/bin/env python
"""Train a small decoder-only language model; kill it at any moment, rerun it, and it ends
bit-identical to an uninterrupted run (model, optimizer, schedule, loss curve, data order).

    python examples/torch_lm.py --ckpt-dir /tmp/lm                # a plain loop on Checkpointer
    python examples/torch_lm.py --ckpt-dir /tmp/lm_job --api job  # the same, as an epochal Job

Kill it (Ctrl-C, kill -9, SIGTERM from a scheduler), run the same command again: it resumes
from the newest intact checkpoint, also from the middle of a pass over the data. The last line,
"final ... sha256 ...", is the digest of the final checkpoint file: compare it with an
uninterrupted run's (in a fresh --ckpt-dir). See docs/pytorch.md for why each piece is there.

The model is real, only small: tied input/output embeddings, pre-norm causal self-attention
blocks with dropout, AdamW with weight decay on matrices only, linear warmup then cosine decay
(LambdaLR), bf16 autocast on the CPU, gradient clipping, and a seeded shuffling DataLoader over
a corpus generated from a fixed Markov chain. A few steps take well under a second.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import epochal
from epochal.integrations.torch import ResumableSampler

VOCAB, BLOCK, DIM, HEADS, LAYERS = 48, 16, 32, 2, 2


# ------------------------------------------------------------------------------ data
def make_corpus(n_seq: int, seed: int) -> torch.Tensor:
    """``n_seq`` token sequences of length BLOCK + 1 from a seeded first-order Markov chain
    (a "language" with structure to learn). Rebuilt identically by every run: not state."""
    g = torch.Generator().manual_seed(seed)
    probs = (torch.randn(VOCAB, VOCAB, generator=g) * 2.5).softmax(-1)
    seqs = torch.empty(n_seq, BLOCK + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(VOCAB, (n_seq,), generator=g)
    for t in range(1, BLOCK + 1):
        seqs[:, t] = torch.multinomial(probs[seqs[:, t - 1]], 1, generator=g).squeeze(1)
    return seqs


class Sequences(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """(input tokens, next tokens, index): the index lets the run log its data order."""

    def __init__(self, seqs: torch.Tensor) -> None:
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.seqs[i, :-1], self.seqs[i, 1:], i


# ------------------------------------------------------------------------------ model
class CausalSelfAttention(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(p)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = CausalSelfAttention(p)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM), nn.Dropout(p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class TinyLM(nn.Module):
    """A GPT-style decoder whose output projection is the token embedding (tied weights)."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(BLOCK, DIM)
        self.drop = nn.Dropout(p)
        self.blocks = nn.Sequential(*(Block(p) for _ in range(LAYERS)))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied: one tensor, stored once, tied after a load

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        return self.head(self.ln_f(self.blocks(x)))  # type: ignore[no-any-return]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: matrices (and embeddings) decay, biases and norm weights do not."""
    params = dict(model.named_parameters())  # a tied parameter appears once
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class WarmupCosine:
    """LR factor: linear warmup, then cosine decay to ``floor``. A callable object (not a
    lambda), so LambdaLR's state dict records its settings."""

    def __init__(self, warmup: int, total: int, floor: float = 0.1) -> None:
        self.warmup, self.total, self.floor = warmup, total, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------ training
class Trainer:
    """The model, optimizer, schedule and data, and the training step both APIs share."""

    def __init__(self, args: argparse.Namespace) -> None:
        # Seed every generator RNGState records (model init and dropout use torch's); on a
        # resume the checkpoint overrides them all.
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)
        self.args = args
        data = Sequences(make_corpus(args.seqs, seed=1234))
        self.val = make_corpus(16, seed=4321)
        self.model = TinyLM()
        self.opt = torch.optim.AdamW(param_groups(self.model, 0.1), lr=args.lr, betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, WarmupCosine(args.warmup, args.steps))
        self.sampler = ResumableSampler(data, shuffle=True, seed=args.seed)
        # generator=: iter(loader) draws a seed from it, not from the global RNG that dropout
        # uses (a loop resumed mid-epoch calls iter() once more than an uninterrupted one)
        self.loader = torch.utils.data.DataLoader(
            data, batch_size=args.batch_size, sampler=self.sampler, generator=torch.Generator()
        )

    def state(self) -> dict[str, Any]:
        """Everything a resume needs: live objects (restored in place) and plain values."""
        return {
            "model": self.model, "opt": self.opt, "sched": self.sched, "sampler": self.sampler,
            "rng": epochal.RNGState(), "step": 0, "epoch": 0, "history": {"loss": [], "batches": []},
        }

    def train_step(self, state: Any, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> float:
        self.model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        state["step"] += 1
        history = state["history"]
        history["loss"].append(loss.item())
        history["batches"].append(idx.tolist())
        print(f"step {state['step']} epoch {state['epoch']} loss {loss.item():.4f} "
              f"lr {self.sched.get_last_lr()[0]:.2e}", flush=True)
        if self.args.step_sleep:
            time.sleep(self.args.step_sleep)
        return float(loss.item())

    def train_until(self, state: Any, until: int, after_step: Any = None) -> None:
        """Train until ``state["step"] == until``; ``after_step(state)`` returning True stops
        early. The loop's epoch counter (in the state) drives the sampler (set_epoch)."""
        while state["step"] < until:
            self.sampler.set_epoch(state["epoch"])
            for x, y, idx in self.loader:
                self.train_step(state, x, y, idx)
                if (after_step is not None and after_step(state)) or state["step"] >= until:
                    return
            state["epoch"] += 1  # the pass over the data ended

    @torch.no_grad()
    def val_loss(self) -> float:
        self.model.eval()  # no dropout: draws nothing from the RNGs
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.model(self.val[:, :-1])
        return float(F.cross_entropy(logits.float().reshape(-1, VOCAB), self.val[:, 1:].reshape(-1)))


def sha256_of(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run_loop(args: argparse.Namespace) -> int:
    """The plain loop on :class:`epochal.Checkpointer`."""
    trainer = Trainer(args)
    with epochal.Checkpointer(args.ckpt_dir, keep_last=args.keep_last, keep_best=2, metric="val_loss",
                              async_save=args.async_save) as ckpt:
        state = trainer.state()
        resumed = ckpt.restore(state)
        print("new run" if resumed is None else f"resumed at step {resumed}", flush=True)

        def after_step(s: dict[str, Any]) -> bool:
            if ckpt.due(s["step"], every=args.save_every) or s["step"] == args.steps:
                ckpt.save(s["step"], s, metrics={"val_loss": trainer.val_loss()})
                print(f"saved step {s['step']}", flush=True)
            return ckpt.preempted

        trainer.train_until(state, args.steps, after_step)
        ckpt.wait()
        if ckpt.preempted:
            print(f"preempted: step {state['step']} is saved; run again to resume", flush=True)
            return 128 + 15
        final = ckpt.db_path(state["step"])
    print(f"final {final} sha256 {sha256_of(final)}", flush=True)
    return 0


class TrainChunk:
    """The Job model's epoch: ``save_every`` training steps (checkpoints fall mid-pass)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def __call__(self, ws: epochal.Workspace) -> None:
        a = self.trainer.args
        self.trainer.train_until(ws, min(ws["step"] + a.save_every, a.steps))


class Progress(epochal.RunListener):
    """Prints what the loop version prints: where the run starts, and each committed save."""

    def __init__(self, save_every: int) -> None:
        self.save_every = save_every

    def on_train_start(self, resume_epoch: int | None, nodes: list[str]) -> None:
        start = "new run" if resume_epoch is None else f"resumed at step {resume_epoch * self.save_every}"
        print(start, flush=True)

    def on_checkpoint(self, event: epochal.CheckpointEvent) -> None:
        if event.action == "checkpoint_save" and event.ok:
            print(f"saved step {event.epoch * self.save_every}", flush=True)


def run_job(args: argparse.Namespace) -> int:
    """The same training as an epochal Job: one job epoch is ``save_every`` steps."""
    trainer = Trainer(args)
    ws = epochal.Workspace()
    for name, value in trainer.state().items():  # in the global workspace before train():
        ws[name] = value  # checkpointed, and restored in place on a resume
    with epochal.Job() as job:
        epochal.Task(step=TrainChunk(trainer), name="train")  # a private workspace (see docs)
    epochal.epoch_limiter(job, args.steps // args.save_every)
    handler = epochal.DirectoryMetadataHandler(keep_last=args.keep_last)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    manager = epochal.CheckpointManager(args.ckpt_dir, "local", db_type="native", metadata_handler=handler)
    runner = epochal.JobRunner(job, manager, listeners=[Progress(args.save_every)], progress=False,
                               raise_on_preempt=True, async_save=args.async_save)
    try:
        with epochal.LocalSession(ws) as session:
            last = runner.train(session)
    except epochal.Preempted as ex:
        print(f"preempted: epoch {ex.epoch} is saved; run again to resume", flush=True)
        return 128 + 15
    final = os.path.join(args.ckpt_dir, f"local.{last}")
    print(f"final {final} sha256 {sha256_of(final)}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-dir", default="/tmp/epochal_torch_lm")
    p.add_argument("--api", choices=("loop", "job"), default="loop")
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--save-every", type=int, default=4, help="steps between checkpoints")
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--seqs", type=int, default=100, help="sequences in the corpus")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a tiny model: 1 is fastest)")
    args = p.parse_args(argv)
    if args.steps % args.save_every:
        p.error("--steps must be a multiple of --save-every")
    torch.set_num_threads(args.threads)
    return run_loop(args) if args.api == "loop" else run_job(args)


if __name__ == "__main__":
    sys.exit(main())
