"""Save and load throughput to a local S3 server (moto, a separate process on 127.0.0.1)
against the local disk, for 1, 2 and 3 nodes.

Each node is a process of its own (as on a cluster: every node writes and reads its own db)
started once per variant; a round times all nodes' saves together (wall clock from the
start signal to the last node done), then their loads. Local and S3 alternate within each
round (the order flips every round); ratios are per-round paired ratios S3/local (> 1: S3
slower), medians over N rounds.

    .venv/bin/python bench/bench_remote.py --mib 16 --rounds 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(conn: Any, opts: dict[str, Any] | None, mib: int, node: int) -> None:
    """A node's process: on each (kind, prefix) message, save then load its own db."""
    from epochal.storage.formats.base import get_db_type
    from epochal.storage.io.fsspec_store import set_storage_options

    backend = get_db_type("native")
    blobs = {"w": np.random.default_rng(node).standard_normal(mib * (1 << 20) // 8), "step": 3}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        prefix, phase = msg
        if "://" in prefix and opts:
            set_storage_options(prefix, opts)
        path = f"{prefix}/trainer_{node}.0"
        t = time.perf_counter()
        if phase == "save":
            backend.write(path, blobs)
        else:
            got = backend.read(path)
            assert got["w"].nbytes == blobs["w"].nbytes
        conn.send(time.perf_counter() - t)


def _round(conns: list[Any], prefix: str, phase: str) -> float:
    t = time.perf_counter()
    for c in conns:
        c.send((prefix, phase))
    for c in conns:
        c.recv()
    return time.perf_counter() - t


def _paired(times: dict[tuple[str, str], list[float]], phase: str) -> float:
    """Median over rounds of S3 time / local time (paired within a round)."""
    return statistics.median(s / loc for s, loc in zip(times[("s3", phase)], times[("local", phase)]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=16, help="MiB per node's db")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nodes", default="1,2,3")
    args = ap.parse_args()
    port = _free_port()
    server = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/bench", method="PUT")).read()
            break
        except OSError:
            time.sleep(0.1)
    opts = {"endpoint_url": endpoint, "key": "test", "secret": "test",
            "client_kwargs": {"region_name": "us-east-1"}}
    local_root = tempfile.mkdtemp(prefix="epochal-bench-remote-")
    print(f"{args.mib} MiB per node, N = {args.rounds} rounds, moto_server at {endpoint}, local {local_root}")
    print("| nodes | local save MB/s | S3 save MB/s | save S3/local | local load MB/s | S3 load MB/s | load S3/local |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
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
                kinds = ["local", "s3"] if r % 2 == 0 else ["s3", "local"]
                for kind in kinds:
                    prefix = (os.path.join(local_root, f"k{k}r{r}") if kind == "local"
                              else f"s3://bench/k{k}r{r}")
                    if kind == "local":
                        os.makedirs(prefix, exist_ok=True)
                    for phase in ("save", "load"):
                        dt = _round(conns, prefix, phase)
                        if r:
                            times.setdefault((kind, phase), []).append(dt)
                    if kind == "local":
                        shutil.rmtree(prefix)
            for c in conns:
                c.send(None)
            for p in procs:
                p.join()

            mb = {key: total_mb / statistics.median(v) for key, v in times.items()}
            ratio = {phase: _paired(times, phase) for phase in ("save", "load")}
            print(f"| {k} | {mb['local', 'save']:.0f} | {mb['s3', 'save']:.0f} | {ratio['save']:.2f} | "
                  f"{mb['local', 'load']:.0f} | {mb['s3', 'load']:.0f} | {ratio['load']:.2f} |", flush=True)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(local_root, ignore_errors=True)


if __name__ == "__main__":
    main()
