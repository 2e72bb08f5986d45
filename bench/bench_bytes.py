#!/usr/bin/env python
"""Lossless compression of checkpoint bytes: ratio and speed per core, and what it does to
a save and a load.

Workloads (built in memory by this script):

  bf16 N(0, 0.02)   a bf16 tensor of normal values, as fresh weights of a big model;
  fp32 N(0, 0.02)   the same in fp32;
  trained fp32/bf16 the weights of a small MLP trained with AdamW for ``--steps`` steps;
  AdamW state       its exp_avg and exp_avg_sq (fp32);
  fresh fp32        the MLP's weights at initialisation (uniform: the worst case).

Variants, side by side on the same bytes: epochal's codec
(:mod:`epochal.storage.encoding.compress`: byte planes of floats, sign bit rotated to bit 0,
then zstd, in 4 MiB frames) on one thread and on every core, against zstd level 3 on the raw
buffer (one frame; DCP's ``ZStandard`` extension streams the raw bytes through the same
zstd at level 3, so its ratio is this one). The ``zipnn`` package is not installed here (it
would need a download), so it is not measured. Speeds are logical bytes per second, divided
by the threads used ("per core"); each figure is the median of ``--rounds`` runs.

Then a save (``write_native``, fsynced) and a warm load of the bf16 and fp32 tensors with
compression off and on, on this disk (``--dir``).

    .venv/bin/python bench/bench_bytes.py --mib 64 --rounds 3
    .venv/bin/python bench/bench_bytes.py --quick              # smoke run, seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from epochal.storage.encoding import compress  # noqa: E402
from epochal.storage.encoding.compress import WriteOptions  # noqa: E402
from epochal.storage.io.checksum import checksum_function, default_algorithm  # noqa: E402


def _median(fn: Callable[[], Any], rounds: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def workloads(mib: int, steps: int) -> dict[str, tuple[np.ndarray, int]]:
    """name -> (bytes as uint8, float width for the planes)."""
    import torch

    torch.manual_seed(0)
    n = (mib << 20) // 4
    out: dict[str, tuple[np.ndarray, int]] = {}
    bf16 = (torch.randn(n * 2) * 0.02).to(torch.bfloat16)
    out["bf16 N(0,0.02)"] = (bf16.view(torch.uint8).numpy(), 2)
    fp32 = (torch.randn(n) * 0.02).float()
    out["fp32 N(0,0.02)"] = (fp32.view(torch.uint8).numpy(), 4)
    width = max(64, int((n / 4) ** 0.5))  # two width x width layers: about mib/2 MiB of weights
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width))

    def flat(ts: list[torch.Tensor]) -> np.ndarray:
        return torch.cat([t.detach().reshape(-1).float() for t in ts]).view(torch.uint8).numpy()

    out["fresh fp32 weights"] = (flat(list(model.parameters())), 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, width)
    y = torch.randn(256, width)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    out["trained fp32 weights"] = (flat(list(model.parameters())), 4)
    out["trained bf16 weights"] = (
        torch.cat([p.detach().reshape(-1).to(torch.bfloat16) for p in model.parameters()]).view(torch.uint8).numpy(), 2)
    state = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    out["AdamW state fp32"] = (flat(state), 4)
    return out


def bench_codec(data: np.ndarray, width: int, rounds: int, threads: int) -> dict[str, float]:
    import zstandard

    fn = checksum_function(default_algorithm())
    mv = memoryview(data)
    n = data.nbytes
    row: dict[str, float] = {}
    for t in sorted({1, threads}):
        opts = WriteOptions("zstd", threads=t)
        s, c = _median(lambda o=opts: compress.compress_segment(mv, width, o, fn), rounds)
        stored = c.nbytes if c is not None else n
        row["ratio"] = n / stored
        row[f"comp/core t={t}"] = n / s / t / 1e9
        if c is not None:
            out = memoryview(bytearray(n))
            streams = [memoryview(x) for x in c.streams]
            s, _ = _median(lambda t=t, c=c, streams=streams, out=out: compress.decode_frames(
                c.codec, c.planes, c.frame_bytes, c.logical, 0, streams, out, t), rounds)
            row[f"dec/core t={t}"] = n / s / t / 1e9
    z = zstandard.ZstdCompressor(level=3)
    s, blob = _median(lambda: z.compress(mv), rounds)
    row["zstd3 ratio"] = n / len(blob)
    row["zstd3 comp"] = n / s / 1e9
    d = zstandard.ZstdDecompressor()
    s, _ = _median(lambda: d.decompress(blob), rounds)
    row["zstd3 dec"] = n / s / 1e9
    return row


def bench_disk(directory: str, data: dict[str, tuple[np.ndarray, int]], rounds: int) -> None:
    import torch

    from epochal.storage.formats.native import NativeFile, write_native

    blobs = {k: torch.from_numpy(v.copy()).view(torch.bfloat16 if w == 2 else torch.float32)
             for k, (v, w) in data.items() if "N(0" in k}
    logical = sum(t.numel() * t.element_size() for t in blobs.values())
    print(f"\nsave (fsynced) and warm load of {logical / 2**20:.0f} MiB (bf16 and fp32 N(0,0.02)) in {directory}")
    for mode in (None, "zstd"):
        path = os.path.join(directory, f"bytes.{mode}")
        s, size = _median(lambda m=mode, p=path: write_native(p, blobs, options=WriteOptions(m)), rounds)

        def load(p: str = path) -> None:
            with NativeFile(p, mmap=False) as f:
                f.read()

        s2, _ = _median(load, rounds)
        print(f"  compression={mode!s:5}  file {size / 2**20:7.1f} MiB  save {s:6.3f} s "
              f"({logical / s / 1e9:.2f} GB/s)  load {s2:6.3f} s ({logical / s2 / 1e9:.2f} GB/s)")
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="MiB of each N(0, 0.02) tensor")
    ap.add_argument("--steps", type=int, default=300, help="AdamW steps of the small model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dir", default=None, help="where the save/load files go (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke run)")
    a = ap.parse_args()
    if a.quick:
        a.mib, a.steps, a.rounds = 4, 5, 1
    data = workloads(a.mib, a.steps)
    print(f"compression: epochal byte planes + zstd vs zstd -3 on the raw buffer; GB/s per core; "
          f"{a.rounds} rounds, {a.threads} threads for t={a.threads}")
    head = None
    for name, (arr, width) in data.items():
        row = bench_codec(arr, width, a.rounds, a.threads)
        if head is None:
            head = list(row)
            print(f"{'workload':24} {'MiB':>6} " + " ".join(f"{h:>14}" for h in head))
        print(f"{name:24} {arr.nbytes / 2**20:6.1f} " + " ".join(f"{row.get(h, float('nan')):14.3f}" for h in head))
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        bench_disk(d, data, a.rounds)


if __name__ == "__main__":
    main()
