#!/usr/bin/env python
"""Benchmark: a Hugging Face Trainer checkpoint, saved and resumed by transformers' own
``Trainer`` and by ``epochal.integrations.transformers.Trainer``, in one process.

    python bench/bench_hf.py --rounds 7 --dir /tmp/epochal_bench_hf

The model is a GPT-2 built from a config (no download; ``--embd 256 --layers 6 --vocab 8192``:
about 7 M parameters, 28 MB of float32 weights, 56 MB of AdamW state after one step).

* save: ``trainer._save_checkpoint`` (what ``train()`` calls at each ``save_steps``), a new
  ``checkpoint-<N>`` each round, removed after. Variants: ``hf`` (transformers as it is: no
  fsync), ``hf+fsync`` (the same, then every file and the folder fsynced: what a durable
  checkpoint needs), ``epochal`` (temp folder, fsyncs, CRC-32C of the weights, rename).
* resume: the reads ``train(resume_from_checkpoint=...)`` makes of one checkpoint, warm in
  the page cache: the weights (``_load_from_checkpoint``), ``trainer_state.json``, the
  optimizer and scheduler, the RNG state; epochal's reads the folder whole first, checking
  every byte (its dbs and the CRC-32C of every other file), and the loads take from that.

Variants alternate (the order rotates every round; resumes run three times ``--rounds``); the
figures are medians over the rounds of the per-round times and of the per-round paired ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _fsync_tree(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dir", default="/tmp/epochal_bench_hf")
    a = ap.parse_args()

    import _hf_train as H
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.trainer_callback import TrainerState

    from epochal.integrations import hf_folder

    transformers.logging.set_verbosity_error()
    shutil.rmtree(a.dir, ignore_errors=True)

    def model():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=a.vocab, n_positions=16, n_embd=a.embd,
                                          n_layer=a.layers, n_head=4))

    data = H.TokenSet(8, vocab=a.vocab)
    trainers = {}
    for kind in ("hf", "epochal"):
        t = H.make_trainer(os.path.join(a.dir, kind), kind, 1, 1, model=model(), dataset=data, save_strategy="no")
        t.train()  # one step: the optimizer holds its moments
        trainers[kind] = t
    nparams = sum(p.numel() for p in trainers["hf"].model.parameters())
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, GPT-2 of {nparams / 1e6:.1f} M "
          f"parameters, {a.rounds} rounds")

    def save(kind: str, step: int) -> float:
        t = trainers["epochal" if kind == "epochal" else "hf"]
        t.state.global_step = step
        t.args.save_strategy = "steps"
        start = time.perf_counter()
        t._save_checkpoint(t.model, None)
        folder = os.path.join(t.args.output_dir, f"checkpoint-{step}")
        if kind == "hf+fsync":
            _fsync_tree(folder)
        return time.perf_counter() - start

    def resume(kind: str, folder: str) -> float:
        t = trainers[kind]
        start = time.perf_counter()
        if kind == "epochal":  # as train() does: the folder read whole and checked, then loaded
            t._epochal_read = hf_folder.read_checkpoint(folder)
        t._load_from_checkpoint(folder)
        TrainerState.load_from_json(os.path.join(folder, "trainer_state.json"))
        t._load_optimizer_and_scheduler(folder)
        t._load_rng_state(folder)
        t._epochal_read = None
        return time.perf_counter() - start

    kinds = ["hf", "hf+fsync", "epochal"]
    saves: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(a.rounds + 1):  # round 0 warms up
        order = kinds[r % 3:] + kinds[:r % 3]
        for k in order:
            dt = save(k, 1000 + r * 10 + kinds.index(k))
            if r:
                saves[k].append(dt)
        for k in ("hf", "epochal"):
            for name in os.listdir(trainers[k].args.output_dir):
                if name.startswith("checkpoint-"):
                    shutil.rmtree(os.path.join(trainers[k].args.output_dir, name))

    folders = {}
    for k in ("hf", "epochal"):
        save(k, 5)
        folders[k] = os.path.join(trainers[k].args.output_dir, "checkpoint-5")
    size = {k: sum(os.path.getsize(os.path.join(f, n)) for n in os.listdir(f)) for k, f in folders.items()}
    loads: dict[str, list[float]] = {"hf": [], "epochal": []}
    for r in range(3 * a.rounds + 1):  # resumes are short: three times the rounds
        for k in (("hf", "epochal") if r % 2 else ("epochal", "hf")):
            dt = resume(k, folders[k])
            if r:
                loads[k].append(dt)

    def row(label: str, times: dict[str, list[float]], bases: list[str]) -> None:
        for k, ts in times.items():
            ratios = "   ".join(f"x{statistics.median(x / y for x, y in zip(ts, times[b])):.2f} vs {b}"
                               for b in bases if b != k)
            print(f"  {label:7} {k:9} median {statistics.median(ts) * 1e3:8.1f} ms   {ratios}")

    print(f"checkpoint size: hf {size['hf'] / 1e6:.1f} MB, epochal {size['epochal'] / 1e6:.1f} MB")
    row("save", saves, ["hf", "hf+fsync"])
    row("resume", loads, ["hf"])
    shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
