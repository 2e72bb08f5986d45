"""Save and load throughput to a local S3 server (moto, a separate process on 127.0.0.1)
against a plain s3fs ``put_file``/``cat_file`` of the same bytes to the same server (and,
with ``--local``, against the local disk), for 1, 2 and 3 nodes.

Each node is a process of its own (as on a cluster: every node writes and reads its own db)
started once per node count; a round times all nodes' saves together (wall clock from the
start signal to the last node done), then their loads, for each variant:

* ``s3``: ``native`` db write (encode, every CRC computed) and full read (every CRC checked)
  at an ``s3://`` URL, as a checkpoint save/load does;
* ``plain``: s3fs ``put_file`` of a local file holding that very db's bytes, and
  ``cat_file`` of the object (no checksum of ours);
* ``local`` (``--local``): the native write and read on the local disk.

The variants alternate within each round (the order rotates every round); ratios are
per-round paired ratios of throughput, s3 / plain (>= 1: ours as fast as plain s3fs) and
s3 / local, medians over N rounds with their min..max.

    .venv/bin/python bench/bench_remote.py --mib 64 --rounds 7
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _requests import moto_server  # noqa: E402


def _node(conn: Any, opts: dict[str, Any] | None, mib: int, node: int) -> None:
    """A node's process: on each (variant, prefix, phase) message, save or load its own db."""
    from epochal.storage.formats.base import get_db_type
    from epochal.storage.io.remote.fsspec_store import filesystem_for, set_storage_options

    backend = get_db_type("native")
    blobs = {"w": np.random.default_rng(node).standard_normal(mib * (1 << 20) // 8), "step": 3}
    raw = os.path.join(tempfile.mkdtemp(prefix="epochal-bench-plain-"), "db")
    backend.write(raw, blobs)  # the plain variant moves these very bytes
    nbytes = os.path.getsize(raw)
    while True:
        msg = conn.recv()
        if msg is None:
            shutil.rmtree(os.path.dirname(raw), ignore_errors=True)
            return
        variant, prefix, phase = msg
        if "://" in prefix and opts:
            set_storage_options(prefix, opts)
        path = f"{prefix}/trainer_{node}.0"
        t = time.perf_counter()
        if variant == "plain":
            fs, key = filesystem_for(path, opts)
            if phase == "save":
                fs.put_file(raw, key)
            else:
                assert len(fs.cat_file(key)) == nbytes
        elif phase == "save":
            backend.write(path, blobs)
        else:
            got = backend.read(path)  # every checksum verified
            assert got["w"].nbytes == blobs["w"].nbytes
        conn.send(time.perf_counter() - t)


def _round(conns: list[Any], variant: str, prefix: str, phase: str) -> float:
    t = time.perf_counter()
    for c in conns:
        c.send((variant, prefix, phase))
    for c in conns:
        c.recv()
    return time.perf_counter() - t


def _paired(times: dict[tuple[str, str], list[float]], phase: str, base: str) -> tuple[float, float, float]:
    """Median (min, max) over rounds of base time / s3 time: our throughput over base's."""
    r = [b / s for s, b in zip(times[("s3", phase)], times[(base, phase)])]
    return statistics.median(r), min(r), max(r)


def _load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64, help="MiB per node's db")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--nodes", default="1,2,3")
    ap.add_argument("--local", action="store_true", help="also the local disk")
    args = ap.parse_args()
    server, opts = moto_server()
    endpoint = opts["endpoint_url"]
    local_root = tempfile.mkdtemp(prefix="epochal-bench-remote-")
    variants = ["s3", "plain"] + (["local"] if args.local else [])
    print(f"{args.mib} MiB per node, N = {args.rounds} rounds, moto_server at {endpoint}; {_load()}")
    cols = "| nodes | plain save MB/s | s3 save MB/s | save s3/plain | plain load MB/s | s3 load MB/s | load s3/plain |"
    if args.local:
        cols += " save s3/local | load s3/local |"
    print(cols)
    print("|" + "---:|" * (cols.count("|") - 1))
    ctx = mp.get_context("spawn")
    try:
        for k in [int(x) for x in args.nodes.split(",")]:
            pipes = [ctx.Pipe() for _ in range(k)]
            procs = [ctx.Process(target=_node, args=(child, opts, args.mib, i)) for i, (_, child) in enumerate(pipes)]
            for p in procs:
                p.start()
            conns = [parent for parent, _ in pipes]
            times: dict[tuple[str, str], list[float]] = {}
            total_mb = k * args.mib * (1 << 20) / 1e6
            for r in range(args.rounds + 1):  # round 0 warms up (imports, connections)
                order = variants[r % len(variants):] + variants[:r % len(variants)]
                if (r // len(variants)) % 2:
                    order.reverse()
                for variant in order:
                    prefix = (os.path.join(local_root, f"k{k}r{r}") if variant == "local"
                              else f"s3://bench/{variant}/k{k}r{r}")
                    if variant == "local":
                        os.makedirs(prefix, exist_ok=True)
                    for phase in ("save", "load"):
                        dt = _round(conns, variant, prefix, phase)
                        if r:
                            times.setdefault((variant, phase), []).append(dt)
                    if variant == "local":
                        shutil.rmtree(prefix)
            for c in conns:
                c.send(None)
            for p in procs:
                p.join()

            mb = {key: total_mb / statistics.median(v) for key, v in times.items()}
            row = f"| {k} |"
            for phase in ("save", "load"):
                med, lo, hi = _paired(times, phase, "plain")
                row += f" {mb['plain', phase]:.0f} | {mb['s3', phase]:.0f} | {med:.2f} ({lo:.2f}..{hi:.2f}) |"
            if args.local:
                for phase in ("save", "load"):
                    med, lo, hi = _paired(times, phase, "local")
                    row += f" {med:.2f} ({lo:.2f}..{hi:.2f}) |"
            print(row, flush=True)
        print(_load())
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(local_root, ignore_errors=True)


if __name__ == "__main__":
    main()
