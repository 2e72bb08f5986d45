#!/usr/bin/env python
"""Benchmark: a Lightning checkpoint saved and resumed through epochal's CheckpointIO
(epochal.integrations.lightning) and through Lightning's own TorchCheckpointIO, same model,
same checkpoint dict, paired.

    python bench/bench_lightning.py --mib 256 --rounds 7 --dir /tmp/epochal_bench_lightning

The model is ``--mib`` MiB of float32 Linear layers in a LightningModule, fitted one step
with AdamW (so its state holds two more copies of every parameter: about 3x ``--mib`` per
checkpoint). The checkpoint dict is the one Lightning's ModelCheckpoint hands to its
CheckpointIO (``dump_checkpoint``); each variant writes it to a new file, as ModelCheckpoint
does. Timed, per round:

* ``save``: ``save_checkpoint(dict, path)``. epochal's ends durable (temp file, fsync,
  rename, directory fsync); Lightning's (``torch.save`` into memory, then an fsspec
  transaction: a temp file in the system temp directory, moved into place) does not fsync,
  so it is also timed followed by an fsync of the file and its directory (``torch+fsync``);
* ``load``: ``load_checkpoint(path)`` as a resume calls it, the file in the page cache
  (read twice beforehand) and, ``cold``, evicted from it (``posix_fadvise(DONTNEED)``);
* ``resume``: the load plus what Lightning's restore does with the weights and optimizer
  state (``model.load_state_dict``, ``optimizer.load_state_dict``), warm.

Variants alternate (the order flips every round); the table gives medians of the times and
the median of the per-round paired ratios epochal / torch.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import evict, fsync_path, warm  # noqa: E402

from epochal.integrations.lightning import EpochalCheckpointIO  # noqa: E402
from epochal.storage.io import atomic  # noqa: E402


class Big(L.LightningModule):
    def __init__(self, mib: float, width: int) -> None:
        super().__init__()
        layers = max(1, round(mib * 2**20 / ((width * width + width) * 4)))
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=256, help="parameters, MiB (the file is ~3x)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default="/tmp/epochal_bench_lightning")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = Big(args.mib, args.width)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, args.width)), batch_size=8)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(model, data)
    ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    opt = trainer.optimizers[0]
    nbytes = sum(p.numel() * 4 for p in model.parameters()) * 3
    os.makedirs(args.dir, exist_ok=True)
    ios = {"epochal": EpochalCheckpointIO(), "torch": TorchCheckpointIO()}

    def torch_fsync(path: str) -> None:
        ios["torch"].save_checkpoint(ckpt, path)
        fsync_path(path)
        atomic.fsync_dir(args.dir)

    saves: dict[str, Callable[[str], None]] = {
        "epochal": lambda p: ios["epochal"].save_checkpoint(ckpt, p),
        "torch": lambda p: ios["torch"].save_checkpoint(ckpt, p),
        "torch+fsync": torch_fsync,
    }

    def resume(io: str, path: str) -> None:
        c = ios[io].load_checkpoint(path)
        model.load_state_dict(c["state_dict"])
        opt.load_state_dict(c["optimizer_states"][0])

    times: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    for r in range(args.rounds):
        order = ["epochal", "torch"] if r % 2 == 0 else ["torch", "epochal"]
        got: dict[str, float] = {}
        paths = {}
        for v in (order + ["torch+fsync"]) if r % 2 == 0 else (["torch+fsync"] + order):
            path = os.path.join(args.dir, f"r{r}-{v.replace('+', '_')}.ckpt")
            got[f"save {v}"], _ = timed(lambda: saves[v](path))  # noqa: B023
            paths[v] = path
        for v in order:
            warm(paths[v])
            got[f"load {v}"], _ = timed(lambda: ios[v].load_checkpoint(paths[v]))  # noqa: B023
        for v in order:
            warm(paths[v])
            got[f"resume {v}"], _ = timed(lambda: resume(v, paths[v]))  # noqa: B023
        for v in order:
            evict(paths[v])
            got[f"load cold {v}"], _ = timed(lambda: ios[v].load_checkpoint(paths[v]))  # noqa: B023
        for k, t in got.items():
            times.setdefault(k, []).append(t)
        for step in ("save", "load", "resume", "load cold"):
            ratios.setdefault(f"{step} epochal/torch", []).append(got[f"{step} epochal"] / got[f"{step} torch"])
        ratios.setdefault("save epochal/torch+fsync", []).append(got["save epochal"] / got["save torch+fsync"])
        for p in paths.values():
            os.unlink(p)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v:.3f}s" for k, v in got.items()), flush=True)
    size = nbytes / 2**20
    print(f"\nLightning {L.__version__}, torch {torch.__version__}; checkpoint ~{size:.0f} MiB "
          f"({args.mib:g} MiB of parameters + AdamW state), {args.rounds} rounds, dir {args.dir}\n")
    print("| step | median s | MB/s |")
    print("|---|---:|---:|")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"| {k} | {m:.3f} | {nbytes / 1e6 / m:.0f} |")
    print("\n| paired ratio | median | min..max |")
    print("|---|---:|---|")
    for k, v in ratios.items():
        print(f"| {k} | {statistics.median(v):.2f} | {min(v):.2f}..{max(v):.2f} |")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
