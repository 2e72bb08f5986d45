#!/usr/bin/env python
"""Benchmark: save and restore a pytree of ``--mib`` MiB (bf16 and fp32 leaves) on an 8-device
CPU mesh with epochal (``epochal.jax``) and with Orbax's ``StandardCheckpointer``,
on the same disk, and the restore resharded from 8 devices to 2.

    python bench/bench_jax.py --mib 1024 --rounds 3 --dir /tmp/epochal_bench_jax

Each phase runs in a fresh process (``XLA_FLAGS=--xla_force_host_platform_device_count=8``):
it builds its pytree (a save) or its abstract pytree (a restore), resets the process's
high-water mark of RSS to its RSS now (``/proc/self/clear_refs``), runs the phase and
reports the wall time and the peak RSS above that baseline (``VmHWM``): the host memory
the phase itself needed, the restored arrays included. Rounds alternate which library
goes first; the summary gives the median time of each and the median (min..max) of the
paired ratios. Leaves are 2-D, sharded
``P("x", "y")`` on a 4x2 mesh (8 devices) or ``P(None, "y")`` on 1x2 (2 devices: column
slices), half bf16, half fp32, about 8 MiB each. Saves end durable for both (epochal fsyncs;
Orbax waits for its commit). Before each restore the files of both libraries are read
once (``--cache warm``, the default: epochal writes a db of 512 MiB or more around the page
cache, with O_DIRECT, so without this it would read from the disk what Orbax reads from
memory) or dropped from the page cache (``--cache cold``: ``posix_fadvise(DONTNEED)`` on
each file, after an ``fsync``).
Every restored value is compared with the saved one. Data under ``--dir`` is removed.

``--gpu``: the same on one accelerator (JAX's default backend, a 1x1 mesh): the arrays live on
the device, so a save copies them to the host and a restore copies them back; the peak RSS is
then the host memory each library passes the bytes through.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from typing import Any

LEAF_MIB = 8


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak() -> None:
    """The high-water mark of RSS := RSS now (Linux); where that is refused, ``ru_maxrss``
    stays the process's peak so far."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tree_spec(mib: int) -> list[tuple[str, tuple[int, int], str]]:
    """(name, shape, dtype) of each leaf: ``mib`` MiB in leaves of about 8 MiB."""
    out = []
    for i in range(max(2, mib // LEAF_MIB)):
        if i % 2:
            out.append((f"l{i:03d}", (2048, 1024), "float32"))
        else:
            out.append((f"l{i:03d}", (4096, 1024), "bfloat16"))
    return out


def child(phase: str, lib: str, directory: str, mib: int, k: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    shape = {8: (4, 2), 2: (1, 2), 1: (1, 1)}[k]
    mesh = Mesh(np.array(jax.devices()[:k]).reshape(shape), ("x", "y"))
    spec = P(None, "y") if k == 2 else P("x", "y")
    sh = NamedSharding(mesh, spec)
    leaves = tree_spec(mib)

    def value(i: int, shape: tuple[int, int], dtype: str) -> Any:
        return (jax.random.normal(jax.random.key(i), shape, dtype=jnp.float32) * (i + 1)).astype(dtype)

    params: dict[str, Any] = {}
    if phase == "save":
        for i, (name, shape, dt) in enumerate(leaves):
            params[name] = jax.device_put(value(i, shape, dt), sh)
        jax.block_until_ready(params)
    else:
        for name, shape, dt in leaves:
            params[name] = jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=sh)
    tree = {"params": params, "step": 1}
    path = os.path.join(directory, lib)
    import gc

    gc.collect()
    reset_peak()
    base = rss_mib()
    t0 = time.perf_counter()
    if lib == "epochal":
        import epochal.jax as ej

        if phase == "save":
            ej.save(path, 1, tree)
        else:
            got = ej.restore(path, tree)
    else:
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()
        if phase == "save":
            ckptr.save(os.path.join(path, "1"), tree)
            ckptr.wait_until_finished()
        else:
            got = ckptr.restore(os.path.join(path, "1"), tree)
        ckptr.close()
    seconds = time.perf_counter() - t0
    peak = peak_mib() - base
    if phase == "restore":  # every value compared (outside the timing)
        for i, (name, shape, dt) in enumerate(leaves):
            a = got["params"][name]
            assert a.sharding == sh and np.array_equal(np.asarray(a), np.asarray(value(i, shape, dt))), name
    return {"phase": phase, "lib": lib, "devices": k, "seconds": round(seconds, 3), "peak_mib": round(peak, 1)}


def set_cache(directory: str, how: str) -> None:
    """Every file under ``directory`` read once (``warm``) or dropped from the page cache
    (``cold``)."""
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                if how == "warm":
                    while os.read(fd, 8 << 20):
                        pass
                else:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run(args: list[str], gpu: bool = False) -> dict[str, Any]:
    env = {**os.environ, "EPOCHAL_QUIET": "1"}
    if gpu:  # (JAX takes 75% of the device's memory at its start unless told not to)
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    else:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


PHASES = (("save", 8), ("restore", 8), ("restore", 2))
GPU_PHASES = (("save", 1), ("restore", 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cache", choices=("warm", "cold"), default="warm")
    ap.add_argument("--dir", default="/tmp/epochal_bench_jax")
    ap.add_argument("--gpu", action="store_true", help="one accelerator device (see the module doc)")
    ap.add_argument("--child", nargs=5, metavar=("PHASE", "LIB", "DIR", "MIB", "K"))
    a = ap.parse_args()
    phases = GPU_PHASES if a.gpu else PHASES
    if a.child:
        phase, lib, d, mib, k = a.child
        print(json.dumps(child(phase, lib, d, int(mib), int(k))))
        return
    total = sum(s[0] * s[1] * (2 if dt == "bfloat16" else 4) for _, s, dt in tree_spec(a.mib)) / 2**20
    print(f"pytree: {len(tree_spec(a.mib))} leaves, {total:.0f} MiB; page cache {a.cache} before each restore; "
          f"load average {os.getloadavg()[0]:.1f}")
    import epochal.jax as ej

    bound = total + ej.api.READ_THREADS * ej.DEFAULT_CHUNK / 2**20
    print(f"epochal's restore bound: the arrays + {ej.api.READ_THREADS} x chunk_bytes = {bound:.0f} MiB")
    rows: list[dict[str, Any]] = []
    for rnd in range(a.rounds):
        d = os.path.join(a.dir, f"run{os.getpid()}_{rnd}")
        os.makedirs(d)
        order = ("orbax", "epochal") if rnd % 2 == 0 else ("epochal", "orbax")
        try:
            for phase, k in phases:
                for lib in order:
                    if phase == "restore":
                        set_cache(d, a.cache)
                    r = run([phase, lib, d, str(a.mib), str(k)], a.gpu)
                    r["round"] = rnd
                    rows.append(r)
                    print(f"round {rnd}  {phase:8s} {k} dev  {lib:8s} {r['seconds']:8.3f} s  "
                          f"peak +{r['peak_mib']:8.1f} MiB")
        finally:
            shutil.rmtree(d, ignore_errors=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    for phase, k in phases:
        def get(lib: str, rnd: int, phase: str = phase, k: int = k) -> dict[str, Any]:
            return next(r for r in rows if (r["phase"], r["devices"], r["lib"], r["round"]) == (phase, k, lib, rnd))

        t = [get("epochal", i)["seconds"] / get("orbax", i)["seconds"] for i in range(a.rounds)]
        m = [get("epochal", i)["peak_mib"] / max(get("orbax", i)["peak_mib"], 0.1) for i in range(a.rounds)]
        med = {lib: _median([get(lib, i)["seconds"] for i in range(a.rounds)]) for lib in ("orbax", "epochal")}
        peak = {lib: _median([get(lib, i)["peak_mib"] for i in range(a.rounds)]) for lib in ("orbax", "epochal")}
        print(f"{phase} {k} dev: median s orbax {med['orbax']:.3f}, epochal {med['epochal']:.3f}; "
              f"epochal/orbax time {_median(t):.2f}x ({min(t):.2f}..{max(t):.2f}); "
              f"peak RSS orbax +{peak['orbax']:.1f}, epochal +{peak['epochal']:.1f} MiB, "
              f"{_median(m):.2f}x ({min(m):.2f}..{max(m):.2f})")


if __name__ == "__main__":
    main()
