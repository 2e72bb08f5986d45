#!/usr/bin/env python
"""Benchmark: save and restore a pytree of ``--mib`` MiB (bf16 and fp32 leaves) on an 8-device
CPU mesh with epochal (``epochal.jax``) and with Orbax's ``StandardCheckpointer``,
on the same disk, and the restore resharded from 8 devices to 2.

    python bench/bench_jax.py --mib 1024 --dir /tmp/epochal_bench_jax

Each phase runs in a fresh process (``XLA_FLAGS=--xla_force_host_platform_device_count=8``):
it builds its pytree (a save) or its abstract pytree (a restore), records its RSS, runs the
phase and reports the wall time and its peak RSS (``ru_maxrss``) above that baseline: the
host memory the phase itself needed, the restored arrays included. Leaves are 2-D, sharded
``P("x", "y")`` on a 4x2 mesh (8 devices) or ``P(None, "y")`` on 1x2 (2 devices: column
slices), half bf16, half fp32, about 8 MiB each. Saves end durable for both (epochal fsyncs;
Orbax waits for its commit). Restores read a file just written (page cache warm for both).
Every restored value is compared with the saved one. Data under ``--dir`` is removed.
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


def peak_mib() -> float:
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

    mesh = Mesh(np.array(jax.devices()[:k]).reshape((4, 2) if k == 8 else (1, 2)), ("x", "y"))
    spec = P("x", "y") if k == 8 else P(None, "y")
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


def run(args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "EPOCHAL_QUIET": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--dir", default="/tmp/epochal_bench_jax")
    ap.add_argument("--child", nargs=5, metavar=("PHASE", "LIB", "DIR", "MIB", "K"))
    a = ap.parse_args()
    if a.child:
        phase, lib, d, mib, k = a.child
        print(json.dumps(child(phase, lib, d, int(mib), int(k))))
        return
    d = os.path.join(a.dir, f"run{os.getpid()}")
    os.makedirs(d)
    total = sum(s[0] * s[1] * (2 if dt == "bfloat16" else 4) for _, s, dt in tree_spec(a.mib)) / 2**20
    print(f"pytree: {len(tree_spec(a.mib))} leaves, {total:.0f} MiB; dir {d}")
    import epochal.jax as ej

    bound = total + ej.api.READ_THREADS * ej.DEFAULT_CHUNK / 2**20
    print(f"epochal's restore bound: the arrays + {ej.api.READ_THREADS} x chunk_bytes = {bound:.0f} MiB")
    rows = []
    try:
        for phase, k in (("save", 8), ("restore", 8), ("restore", 2)):
            for lib in ("orbax", "epochal"):
                r = run([phase, lib, d, str(a.mib), str(k)])
                rows.append(r)
                print(f"{phase:8s} {k} dev  {lib:8s} {r['seconds']:8.3f} s  peak +{r['peak_mib']:8.1f} MiB")
        for phase, k in (("save", 8), ("restore", 8), ("restore", 2)):
            o = next(r for r in rows if (r["phase"], r["devices"], r["lib"]) == (phase, k, "orbax"))
            e = next(r for r in rows if (r["phase"], r["devices"], r["lib"]) == (phase, k, "epochal"))
            print(f"{phase} {k} dev: epochal/orbax time {e['seconds'] / o['seconds']:.2f}x, "
                  f"peak RSS {e['peak_mib'] / max(o['peak_mib'], 0.1):.2f}x"
                  + (f"; epochal's peak / the arrays {e['peak_mib'] / total:.2f}x, Orbax's "
                     f"{o['peak_mib'] / total:.2f}x" if phase == "restore" else ""))
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
