"""One process of a JAX job of NPROC processes for tests/test_jax_multiprocess.py.

``python _jax_mp_bits.py ACTION DIR NPROC PID PORT STEP SEED``: with NPROC 2, 4 CPU devices
in this process and ``jax.distributed`` over ``127.0.0.1:PORT`` (process PID); with NPROC 1,
8 devices alone. Either way the global mesh is 2 x 4 (``x`` spans the processes).

* ``save``: save the pytree of SEED (:func:`values`) as STEP, sharded by :func:`specs`;
* ``restore``: restore STEP (``-``: the newest) onto the specs, then onto other ones (every
  spec transposed: each shard then read from pieces of several processes' dbs), comparing
  every addressable shard bit for bit with the values of SEED;
* ``differ``: a save of STEP whose plain value differs between the processes;
* ``die``: a save of STEP in which process 1 exits (code 17) once its db is written, before
  the processes agree to commit;
* ``keep``: saves of steps 1..STEP (step ``s`` the pytree of seed ``s``) with
  ``keep_last=SEED``;
* ``mixed``: a save of STEP, async on process 1 only;
* ``best``: saves of steps 1..4 with losses 3, 1, 4, 2, ``keep_best=1`` by ``loss`` and
  ``keep_last=1``;
* ``async``: an async save of STEP whose writes wait until every live shard buffer was
  overwritten in place (as a donated buffer is reused on an accelerator), then joined;
* ``async_exit``: an async save of STEP, and the process ends without joining it;
* ``async_die``: an async save of STEP in which process 1 exits (code 17) in its write, the
  background agreements waiting 5 s at most;
* ``async_fail``: an async save of STEP whose write fails on process 1, joined (the error
  printed), then a save of STEP + 1.

DIR may be a URL: the fsspec options that reach it are the JSON of ``JAX_MP_OPTS``.

Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

ACTION, DIR, NPROC, PID, PORT, STEP, SEED = sys.argv[1:8]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // int(NPROC)}"
os.environ.setdefault("EPOCHAL_QUIET", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

if int(NPROC) > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{PORT}", num_processes=int(NPROC),
                               process_id=int(PID))

import ml_dtypes  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import epochal.jax as ej  # noqa: E402

#: fsspec's options for a URL DIR (None: a local directory)
OPTS = json.loads(os.environ.get("JAX_MP_OPTS", "null"))


def values(seed: int) -> dict[str, Any]:
    """The pytree as numpy: fp32 from random bit patterns, bf16 bit patterns (NaN payloads,
    -0.0, subnormals), a replicated fp32 vector, an array on one device of each process (no
    sharding: restored onto this process's first device) and a plain scalar."""
    rng = np.random.default_rng(seed)
    return {
        "params": {"w": rng.integers(0, 1 << 32, size=(16, 32), dtype=np.uint32).view(np.float32),
                   "e": rng.integers(0, 1 << 16, size=(8, 64), dtype=np.uint16).view(ml_dtypes.bfloat16)},
        "b": np.arange(40, dtype=np.float32) * (seed + 1) - 7.5,
        "one": np.arange(15, dtype=np.float32).reshape(3, 5) + seed,
        "count": 7 + seed,
    }


def specs(flip: bool) -> dict[str, Any]:
    xy = P("y", "x") if flip else P("x", "y")
    return {"params": {"w": xy, "e": xy}, "b": P("y") if flip else P(), "count": None}


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))


def tree(seed: int, flip: bool, abstract: bool) -> dict[str, Any]:
    m, want = mesh(), values(seed)
    sp = specs(flip)

    def leaf(v: Any, spec: Any) -> Any:
        if spec is None:
            return v
        sh = NamedSharding(m, spec)
        if abstract:
            return jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh)
        return jax.make_array_from_callback(v.shape, sh, lambda idx: v[idx])

    one = (jax.ShapeDtypeStruct(want["one"].shape, want["one"].dtype) if abstract
           else jax.device_put(want["one"], jax.local_devices()[0]))
    return {"params": {k: leaf(v, sp["params"][k]) for k, v in want["params"].items()},
            "b": leaf(want["b"], sp["b"]), "one": one, "count": want["count"]}


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def compare(got: dict[str, Any], seed: int) -> int:
    """Every addressable shard of every array leaf against the values, bit for bit; the
    number of shards compared."""
    want, n = values(seed), 0
    assert got["count"] == want["count"], got["count"]
    for name, g, w in [("w", got["params"]["w"], want["params"]["w"]), ("e", got["params"]["e"], want["params"]["e"]),
                       ("b", got["b"], want["b"]), ("one", got["one"], want["one"])]:
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape)
        for s in g.addressable_shards:
            assert np.array_equal(bits(np.asarray(s.data)), bits(w[s.index])), (name, s.index)
            n += 1
    return n


def main() -> None:
    step = None if STEP == "-" else int(STEP)
    seed = int(SEED)
    if ACTION == "save":
        assert step is not None
        ej.save(DIR, step, tree(seed, False, False), storage_options=OPTS)
        print(json.dumps({"saved": step, "process": jax.process_index()}))
    elif ACTION == "restore":
        shards = [compare(ej.restore(DIR, tree(seed, flip, True), step, storage_options=OPTS), seed) for flip in (False, True)]
        print(json.dumps({"shards": shards, "process": jax.process_index()}))
    elif ACTION in ("zsave", "zrestore", "isave", "irestore"):  # with a compressible array sharded over both processes
        assert step is not None  # (isave: incremental saves of steps 1..step, z the same in all)
        inc = ACTION in ("isave", "irestore")  # (shards of 256 KiB: chunked for reuse, over 64 KiB)
        z = (np.random.default_rng(0 if inc else seed).normal(0, 0.02, (2048, 512) if inc else (512, 256))
             .astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)
        sh = NamedSharding(mesh(), P("x", "y"))
        if ACTION == "isave":
            for s in range(1, step + 1):
                t = tree(s, False, False)
                t["z"] = jax.make_array_from_callback(z.shape, sh, lambda idx: z[idx])
                ej.save(DIR, s, t, incremental=True, keep_last=2, async_save=s % 2 == 0,
                        storage_options=OPTS)
            ej.wait()
            print(json.dumps({"saved": step, "process": jax.process_index()}))
        elif ACTION == "zsave":
            t = tree(seed, False, False)
            t["z"] = jax.make_array_from_callback(z.shape, sh, lambda idx: z[idx])
            ej.save(DIR, step, t, compression="zstd", keep_last=2)
            print(json.dumps({"saved": step, "process": jax.process_index()}))
        else:
            t = tree(seed, False, True)
            t["z"] = jax.ShapeDtypeStruct(z.shape, z.dtype, sharding=sh)
            got = ej.restore(DIR, t, step)
            n = compare(got, seed)
            for s in got["z"].addressable_shards:
                assert np.array_equal(bits(np.asarray(s.data)), bits(z[s.index])), s.index
                n += 1
            print(json.dumps({"shards": n, "process": jax.process_index()}))
    elif ACTION == "differ":
        assert step is not None
        t = tree(seed, False, False)
        t["count"] += jax.process_index()
        ej.save(DIR, step, t)
    elif ACTION == "die":
        from epochal.jax import multiprocess

        real = multiprocess.write_native

        def write_then_die(path: str, blobs: Any, **kw: Any) -> int:
            size = real(path, blobs, **kw)
            if jax.process_index() == 1:
                os._exit(17)  # written, durable, never agreed to commit
            return size

        multiprocess.write_native = write_then_die  # type: ignore[assignment]
        assert step is not None
        ej.save(DIR, step, tree(seed, False, False))
        print(json.dumps({"saved": step}))
    elif ACTION == "keep":
        assert step is not None
        for s in range(1, step + 1):
            ej.save(DIR, s, tree(s, False, False), keep_last=seed, storage_options=OPTS)
        print(json.dumps({"saved": list(range(1, step + 1)), "process": jax.process_index()}))
    elif ACTION == "mixed":
        assert step is not None
        ej.save(DIR, step, tree(seed, False, False), async_save=jax.process_index() == 1)
    elif ACTION == "best":
        for s, loss in zip(range(1, 5), (3.0, 1.0, 4.0, 2.0)):
            ej.save(DIR, s, tree(s, False, False), keep_last=1, keep_best=1, metric="loss", metrics={"loss": loss})
        try:  # a typo in the metric's name: refused on every process before anything is written
            ej.save(DIR, 5, tree(5, False, False), keep_best=1, metric="loss", metrics={"los": 0.5})
        except Exception as ex:
            print(json.dumps({"saved": [1, 2, 3, 4], "process": jax.process_index(), "typo": type(ex).__name__}))
    elif ACTION == "async_exit":
        assert step is not None
        ej.save(DIR, step, tree(seed, False, False), async_save=True)
        print(json.dumps({"left": step, "process": jax.process_index()}))
    elif ACTION in ("async", "async_fail", "async_die"):
        assert step is not None
        print(json.dumps(background(step, seed)))
        if ACTION == "async_die":  # (JAX's own shutdown would wait for the dead process's heartbeat)
            sys.stdout.flush()
            os._exit(0)
    else:
        raise SystemExit(f"unknown action {ACTION}")


def overwrite(x: Any) -> None:
    """Every addressable shard buffer of ``x`` filled with 0x5a bytes in place."""
    import ctypes

    for s in x.addressable_shards:
        ctypes.memset(s.data.unsafe_buffer_pointer(), 0x5A, s.data.nbytes)


def background(step: int, seed: int) -> dict[str, Any]:
    import threading

    from epochal.jax import multiprocess

    real, go = multiprocess.write_native, threading.Event()

    def held_write(path: str, blobs: Any, **kw: Any) -> int:
        assert go.wait(120), "the save never let the write go"
        if ACTION == "async_die" and jax.process_index() == 1:
            os._exit(17)
        if ACTION == "async_fail" and jax.process_index() == 1:
            raise OSError(28, "No space left on device (injected)", path)
        return real(path, blobs, **kw)

    multiprocess.write_native = held_write  # type: ignore[assignment]
    if ACTION == "async_die":
        from epochal.jax import background as bg

        bg.AGREE_SECONDS = 5.0
    t = tree(seed, False, False)
    pending = ej.save(DIR, step, t, async_save=True, storage_options=OPTS)
    assert pending is not None and not pending.done()
    out: dict[str, Any] = {"process": jax.process_index()}
    if ACTION == "async":
        for x in (t["params"]["w"], t["params"]["e"], t["b"], t["one"]):
            overwrite(x)
        live = np.asarray(t["params"]["w"].addressable_shards[0].data).view(np.uint32)
        out["live"] = sorted({hex(v) for v in live.reshape(-1).tolist()})
    go.set()
    try:
        pending.wait()
        out["waited"] = "ok"
    except Exception as ex:
        out["waited"] = f"{type(ex).__name__}: {ex}"
    if ACTION == "async_fail":
        multiprocess.write_native = real  # type: ignore[assignment]
        ej.wait()  # (the error was taken: nothing more to raise)
        ej.save(DIR, step + 1, tree(seed, False, False))
        out["next"] = step + 1
    return out


if __name__ == "__main__":
    main()
