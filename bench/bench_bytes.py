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
zstd at level 3, so its ratio is this one), and the ``zipnn`` package when it is installed
(``pip install --no-deps zipnn safetensors``; ZipNN with ``threads=1`` on the tensor, in the
process's CPU time, since its C code may run threads of its own; its ``compress`` reorders
the bytes of the tensor it is given in place, so each round gets a copy, made outside the
timing). Speeds are logical bytes per second, divided by the threads used ("per core"): on
one thread (t=1, and zstd -3) the thread's CPU time, so that a loaded machine does not count
the time others ran; on several, wall time. Each figure is the median of ``--rounds`` runs.
epochal's codec is timed as saves in a loop run it (``comp/core``: each round's output buffer
given back for the next, as the writer does once a file is written) and as a process's first
save does (``comp first``: into fresh memory every round).

Then a save (fsynced) and a load (every checksum checked) of the bf16 and fp32 tensors with
compression off and on, in paired rounds, on this disk (``--dir``) and with ``--s3`` at an
``s3://`` URL served by a local moto server (a separate process).

With ``--against TREE`` (another checkout of epochal), the N(0, 0.02) tensors are first
compressed by this tree's codec and by TREE's, loaded side by side in this process, in
alternating rounds on one thread (thread CPU time), each as saves in a loop use it: the
medians of the paired speed ratios; then one compressed save of twice ``--mib`` of bf16 (8 MiB
tensors) in a fresh process per tree, alternating: the growth of its peak RSS over the
state, its wall and CPU time (a process's first save: what holding every compressed
segment until the write costs, against compressing each as the write reaches it).

    .venv/bin/python bench/bench_bytes.py --mib 64 --rounds 3 --s3
    .venv/bin/python bench/bench_bytes.py --mib 256 --rounds 9 --against ../main --only-against
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from epochal.storage.encoding import compress  # noqa: E402
from epochal.storage.encoding.compress import WriteOptions  # noqa: E402
from epochal.storage.encoding.planes import SPARES  # noqa: E402
from epochal.storage.io.checksum import checksum_function, default_algorithm  # noqa: E402


def _median(fn: Callable[[], Any], rounds: int, clock: Callable[[], float] = time.perf_counter) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(rounds):
        t0 = clock()
        out = fn()
        times.append(clock() - t0)
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
        # one thread: its CPU time (what a core spends, whatever else the machine runs);
        # several: wall time divided by the threads
        clock = time.thread_time if t == 1 else time.perf_counter
        opts = WriteOptions("zstd", threads=t)

        def save_in_a_loop(o: WriteOptions = opts, fresh: bool = False,
                           clock: Callable[[], float] = clock) -> tuple[float, Any]:
            # as saves in a loop do: each round's output buffer given back once "written"
            # (outside the timing), for the next round to reuse; fresh=True: none kept, so
            # every round compresses into fresh memory (a process's first save)
            times, got = [], None
            for _ in range(rounds):
                t0 = clock()
                got = compress.compress_segment(mv, width, o, fn)
                times.append(clock() - t0)
                if got is not None and (fresh or len(times) < rounds):  # (the last one is decoded next)
                    SPARES.clear() if fresh else SPARES.give_back([got.buffer])
            return statistics.median(times), got

        if t == 1:
            s, _ = save_in_a_loop(fresh=True)
            row["comp first t=1"] = n / s / 1e9
        s, c = save_in_a_loop()
        stored = c.nbytes if c is not None else n
        row["ratio"] = n / stored
        row[f"comp/core t={t}"] = n / s / t / 1e9
        if c is not None:
            out = memoryview(bytearray(n))
            streams = [memoryview(x) for x in c.streams]
            s, _ = _median(lambda t=t, c=c, streams=streams, out=out: compress.decode_frames(
                c.codec, c.planes, c.frame_bytes, c.logical, 0, streams, out, t), rounds, clock)
            row[f"dec/core t={t}"] = n / s / t / 1e9
    row.update(bench_zipnn(data, width, rounds))
    z = zstandard.ZstdCompressor(level=3)
    s, blob = _median(lambda: z.compress(mv), rounds, time.thread_time)
    row["zstd3 ratio"] = n / len(blob)
    row["zstd3 comp"] = n / s / 1e9
    d = zstandard.ZstdDecompressor()
    s, _ = _median(lambda: d.decompress(blob), rounds, time.thread_time)
    row["zstd3 dec"] = n / s / 1e9
    return row


def bench_zipnn(data: np.ndarray, width: int, rounds: int) -> dict[str, float]:
    """The ``zipnn`` package on the same bytes as a torch tensor of its dtype (bf16 or fp32):
    ratio, compress and decompress GB/s in the process's CPU time, every round's output
    checked bit-exact; {} when zipnn is not installed."""
    try:
        import torch
        from zipnn import ZipNN
    except ImportError:
        return {}
    dtype = {2: torch.bfloat16, 4: torch.float32}.get(width)
    if dtype is None:
        return {}
    original = torch.from_numpy(data.copy()).view(dtype)
    z = ZipNN(input_format="torch", threads=1)
    n = data.nbytes
    comp, dec, blob = [], [], b""
    for _ in range(rounds):
        t = original.clone()  # (compress reorders its input's bytes in place)
        t0 = time.process_time()
        blob = z.compress(t)
        comp.append(time.process_time() - t0)
        t0 = time.process_time()
        back = z.decompress(blob)
        dec.append(time.process_time() - t0)
        if not torch.equal(back.view(torch.uint8), original.view(torch.uint8)):
            raise AssertionError("zipnn did not give the bytes back")
    return {"zipnn ratio": n / len(blob), "zipnn comp": n / statistics.median(comp) / 1e9,
            "zipnn dec": n / statistics.median(dec) / 1e9}


_ONE_SAVE = """
import os, sys, tempfile, time
import numpy as np, torch
from epochal.storage.encoding.compress import WriteOptions, write_options
from epochal.storage.formats.native import write_native

def hwm():  # this process's peak RSS, MiB (VmHWM: ru_maxrss keeps a parent's across exec)
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmHWM")) / 1024

torch.manual_seed(0)
n = int(sys.argv[1])
blobs = {f"w{i}": (torch.randn(4 << 20) * 0.02).to(torch.bfloat16).view(torch.int16).numpy().view(np.float16)
         for i in range(n // 8)}  # (bf16 bits; a 2-byte float dtype, so split into byte planes)
before = hwm()
with tempfile.TemporaryDirectory(dir=sys.argv[2]) as d:
    t, c = time.perf_counter(), time.process_time()
    with write_options(WriteOptions("zstd")):
        write_native(os.path.join(d, "a.db"), blobs)
    print(hwm() - before, time.perf_counter() - t, time.process_time() - c,
          os.path.getsize(os.path.join(d, "a.db")) / 2**20)
"""


def bench_memory(mib: int, trees: dict[str, str], rounds: int, where: str | None) -> None:
    """One compressed save of ``mib`` MiB of bf16 (tensors of 8 MiB) in a fresh process per
    tree (alternating): the growth of its peak RSS over the state it saves, wall and CPU time."""
    import subprocess

    print(f"\none compressed save of {mib} MiB of bf16 (8 MiB tensors) in a fresh process, {rounds} rounds"
          " (peak RSS growth MiB, wall s, CPU s, file MiB)")
    got: dict[str, list[list[float]]] = {k: [] for k in trees}
    for r in range(rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            env = dict(os.environ, PYTHONPATH=str(Path(trees[name]) / "src"))
            out = subprocess.run([sys.executable, "-c", _ONE_SAVE, str(mib), where or tempfile.gettempdir()],
                                 env=env, capture_output=True, text=True, check=True)
            got[name].append([float(x) for x in out.stdout.split()])
    for name, rows in got.items():
        a = np.array(rows)
        print(f"  {name:10} RSS +{np.median(a[:, 0]):.0f} MiB, {np.median(a[:, 1]):.2f} s wall, "
              f"{np.median(a[:, 2]):.2f} s CPU, file {a[0, 3]:.0f} MiB; rounds: "
              + "; ".join(f"+{x[0]:.0f} {x[1]:.2f} {x[2]:.2f}" for x in rows))


def load_codec(tree: str) -> Any:
    """The compression module of the epochal checkout at ``tree``, as a module of its own:
    its packages are made without running their ``__init__`` (the codec needs only its own
    folder and a few standalone modules above it, such as ``knobs`` and ``errors``)."""
    import importlib
    import types

    root = Path(tree).resolve() / "src" / "epochal"
    for name, path in (("epochal_against", root), ("epochal_against.storage", root / "storage"),
                       ("epochal_against.storage.encoding", root / "storage" / "encoding")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    return importlib.import_module("epochal_against.storage.encoding.compress")


def bench_against(data: dict[str, tuple[np.ndarray, int]], other: Any, rounds: int) -> None:
    """This tree's codec against ``other`` (:func:`load_codec`) on the N(0, 0.02) tensors,
    one thread, alternating rounds, as saves in a loop use them (a codec with spare output
    buffers gets each round's back once it is "written", outside the timing): speed per
    round and medians of the paired ratios."""
    fn = checksum_function(default_algorithm())
    print(f"\nthis codec against {other.__file__}, one thread, {rounds} alternating rounds (GB/s, thread CPU time)")
    spares = {"this": SPARES, "other codec": getattr(sys.modules.get("epochal_against.storage.encoding.planes"), "SPARES", None)}
    for name, (arr, width) in data.items():
        if "N(0" not in name:
            continue
        mv, n = memoryview(arr), arr.nbytes

        def ours(mv: memoryview = mv, width: int = width) -> Any:
            return compress.compress_segment(mv, width, WriteOptions("zstd", threads=1), fn)

        def theirs(mv: memoryview = mv, width: int = width) -> Any:
            return other.compress_segment(mv, width, other.WriteOptions("zstd", threads=1), fn)

        runs: dict[str, list[float]] = {"this": [], "other codec": []}
        fns = {"this": ours, "other codec": theirs}
        sizes = {}
        for r in range(rounds):
            for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                t = time.thread_time()
                c = fns[k]()
                runs[k].append(time.thread_time() - t)
                sizes[k] = c.nbytes
                if spares[k] is not None and getattr(c, "buffer", None) is not None:
                    spares[k].give_back([c.buffer])
                del c
        print(f"  {name}: ratio this {n / sizes['this']:.4f}, other {n / sizes['other codec']:.4f}")
        for k, ts in runs.items():
            print(f"    {k:20} median {n / statistics.median(ts) / 1e9:.3f}  rounds {' '.join(f'{n / x / 1e9:.2f}' for x in ts)}")
        pr = [b / a for a, b in zip(runs["this"], runs["other codec"])]
        print(f"    this / other codec: speed {statistics.median(pr):.3f}x ({min(pr):.2f}-{max(pr):.2f})")


def bench_disk(where: dict[str, str], data: dict[str, tuple[np.ndarray, int]], rounds: int) -> None:
    """A save and a load of the N(0, 0.02) tensors with compression off and on, at each
    place of ``where`` (label -> folder or URL), in paired rounds (the order flipped each
    round); medians of the per-round on / off ratios."""
    import torch

    from epochal.storage.encoding.compress import write_options
    from epochal.storage.formats.base import get_db_type

    backend = get_db_type("native")
    blobs = {k: torch.from_numpy(v.copy()).view(torch.bfloat16 if w == 2 else torch.float32)
             for k, (v, w) in data.items() if "N(0" in k}
    logical = sum(t.numel() * t.element_size() for t in blobs.values())
    print(f"\nsave and load of {logical / 2**20:.0f} MiB (bf16 and fp32 N(0,0.02)), compression off and on, "
          f"{rounds} paired rounds")
    for label, folder in where.items():
        times: dict[tuple[str | None, str], list[float]] = {}
        for mode in (None, "zstd"):  # (a warm-up of each: connections, first writes)
            with write_options(WriteOptions(mode)):
                backend.write(f"{folder}/bytes.{mode}", blobs)
        for r in range(rounds):
            for mode in ((None, "zstd") if r % 2 == 0 else ("zstd", None)):
                path = f"{folder}/bytes.{mode}"
                t = time.perf_counter()
                with write_options(WriteOptions(mode)):
                    backend.write(path, blobs)
                times.setdefault((mode, "save"), []).append(time.perf_counter() - t)
                t = time.perf_counter()
                got = backend.read(path)  # every checksum checked
                times.setdefault((mode, "load"), []).append(time.perf_counter() - t)
                assert all(got[k].view(torch.uint8).numpy().tobytes() == v.view(torch.uint8).numpy().tobytes()
                           for k, v in blobs.items())
        for phase in ("save", "load"):
            off, on = times[(None, phase)], times[("zstd", phase)]
            ratio = [b / a for a, b in zip(off, on)]
            print(f"  {label:5} {phase}: off {statistics.median(off):6.3f} s ({logical / statistics.median(off) / 1e9:.2f} GB/s)"
                  f"  on {statistics.median(on):6.3f} s ({logical / statistics.median(on) / 1e9:.2f} GB/s)"
                  f"  on/off {statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})"
                  f"  rounds off {' '.join(f'{x:.3f}' for x in off)} on {' '.join(f'{x:.3f}' for x in on)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="MiB of each N(0, 0.02) tensor")
    ap.add_argument("--steps", type=int, default=300, help="AdamW steps of the small model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dir", default=None, help="where the save/load files go (default: a temp dir)")
    ap.add_argument("--s3", action="store_true", help="also save and load at S3 (a local moto server)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke run)")
    ap.add_argument("--against", default=None, help="another epochal checkout: its codec side by side first")
    ap.add_argument("--only-against", action="store_true", help="with --against: only that comparison")
    a = ap.parse_args()
    if a.quick:
        a.mib, a.steps, a.rounds = 4, 5, 1
    data = workloads(a.mib, a.steps)
    if a.against:
        bench_against(data, load_codec(a.against), a.rounds)
        bench_memory(a.mib * 2, {"this": str(Path(__file__).resolve().parents[1]), "other": a.against},
                     a.rounds, a.dir)
        if a.only_against:
            return
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
        where = {"disk": d}
        server = None
        if a.s3:
            from _requests import moto_server

            from epochal.storage.io.remote.fsspec_store import set_storage_options

            server, opts = moto_server()
            where["s3"] = "s3://bench/bytes"
            set_storage_options(where["s3"], opts)
        try:
            bench_disk(where, data, a.rounds)
        finally:
            if server is not None:
                server.terminate()


if __name__ == "__main__":
    main()
