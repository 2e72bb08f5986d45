"""More processes of tests/test_jax.py (run through tests/_jax_bits.py, which dispatches
them): a ``dcp.save`` restored into JAX, a restore's peak host RSS, Orbax's v1 API."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from _jax_bits import abstract, bf16_bits, mesh, same_bits, values


def dcp_values() -> dict[str, np.ndarray]:
    """The state ``dcp.save`` writes, as numpy: a bf16 weight (48, 64), its fp32 bias and an
    8 MiB fp32 weight (stored as row blocks)."""
    return {"fc.weight": bf16_bits((48, 64), 5), "fc.bias": np.arange(48, dtype=np.float32) / 9,
            "big.weight": np.random.default_rng(6).integers(0, 1 << 32, (2048, 1024), dtype=np.uint32)
            .view(np.float32)}


def _dcp_state(mesh: Any) -> dict[str, Any]:
    import torch

    v = dcp_values()
    model: dict[str, Any] = {"fc.weight": torch.from_numpy(v["fc.weight"].view(np.int16)).view(torch.bfloat16),
                             "fc.bias": torch.from_numpy(v["fc.bias"]),
                             "big.weight": torch.from_numpy(v["big.weight"])}
    if mesh is not None:  # w split by columns, big by rows over the ranks; the bias replicated
        from torch.distributed.tensor import Shard, distribute_tensor

        model["fc.weight"] = distribute_tensor(model["fc.weight"], mesh, [Shard(1)])
        model["big.weight"] = distribute_tensor(model["big.weight"], mesh, [Shard(0)])
    return {"model": model, "step": 7}


def dcp_rank_save(rank: int, world: int, directory: str) -> None:
    """One rank of a 2-rank ``dcp.save`` (spawned by tests/_dist_workers.run_ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from epochal.integrations.dcp import EpochalStorageWriter

    dcp.save(_dcp_state(init_device_mesh("cpu", (world,))), storage_writer=EpochalStorageWriter(directory, step=7))


def dcp_save(directory: str, world: int) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    from epochal.integrations.dcp import EpochalStorageWriter

    if world == 1:  # one process, no process group
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
            dcp.save(_dcp_state(None), storage_writer=EpochalStorageWriter(directory, step=7))
    else:
        from _dist_workers import run_ranks

        run_ranks(dcp_rank_save, world, directory)
    print(json.dumps({"saved": sorted(f for f in os.listdir(directory) if not f.startswith("."))}))


def jax_restore_dcp(directory: str, k: int) -> None:
    """Restore the DCP step as a pytree of the same nested dicts, then as a flax-style pytree
    under a name mapping (the kernel transposed), every shard compared bit for bit."""
    import jax
    import ml_dtypes
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import epochal.jax as ej

    m = mesh(k)

    def sds(shape: tuple[int, ...], dt: Any, spec: Any) -> Any:
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(m, spec))

    v = dcp_values()
    w = v["fc.weight"].view(ml_dtypes.bfloat16)
    same = {"model": {"fc.weight": sds((48, 64), ml_dtypes.bfloat16, P("x", "y")),
                      "fc.bias": sds((48,), np.float32, P("y")),
                      "big.weight": sds((2048, 1024), np.float32, P("y", "x"))}, "step": 0}
    flax = {"params": {"Dense_0": {"kernel": sds((64, 48), ml_dtypes.bfloat16, P("x", "y")),
                                   "bias": sds((48,), np.float32, P(None))},
                       "big": sds((2048, 1024), np.float32, P(None, "y"))}, "step": 0}
    names = {"params/Dense_0/kernel": ej.transposed("model.fc.weight"), "params/Dense_0/bias": "model.fc.bias",
             "params/big": "model/big.weight"}
    from epochal.storage.formats.native.reads import ranges

    reads: list[tuple[str, int, int]] = []
    orig = ranges.RangedFile.read_into

    def counted(self: Any, view: memoryview, offset: int, blob: Any = None) -> None:
        if isinstance(blob, str) and blob.startswith("model.big.weight@"):
            reads.append((self.path, offset, view.nbytes))
        orig(self, view, offset, blob)

    ranges.RangedFile.read_into = counted  # type: ignore[method-assign]
    checked = 0
    for tree_abstract, kw, want in (
        (same, {}, {("model", "fc.weight"): w, ("model", "fc.bias"): v["fc.bias"],
                    ("model", "big.weight"): v["big.weight"]}),
        (flax, {"names": names}, {("params", "Dense_0", "kernel"): np.ascontiguousarray(w.T),
                                  ("params", "Dense_0", "bias"): v["fc.bias"], ("params", "big"): v["big.weight"]}),
    ):
        tree = ej.restore(directory, tree_abstract, **kw)
        assert tree["step"] == 7
        for names_, expect in want.items():
            t, a = tree, tree_abstract
            for n in names_:
                t, a = t[n], a[n]
            assert isinstance(t, jax.Array) and t.sharding == a.sharding, names_
            assert same_bits(expect, t), names_
            for sh in t.addressable_shards:
                assert same_bits(expect[sh.index], sh.data), names_
            checked += 1
        if not kw:  # each byte of the big weight read once, for all the shards that hold it
            big_read = sum(n for _, _, n in reads)
            assert len(set(reads)) == len(reads), "a range read twice"
    print(json.dumps({"checked": checked, "big_read": big_read}))


def big_save(directory: str) -> None:
    """A 64 MiB fp32 leaf and a 32 MiB bf16 one, saved from one device."""
    import ml_dtypes

    import epochal.jax as ej

    rng = np.random.default_rng(8)
    ej.save(directory, 1, {"w": rng.integers(0, 1 << 32, (4096, 4096), dtype=np.uint32).view(np.float32),
                           "e": bf16_bits((4096, 4096), 9).view(ml_dtypes.bfloat16)})
    print(json.dumps({"saved": 1}))


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _rss_now_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def big_restore_rss(directory: str, k: int, chunk: int) -> None:
    """Restore big_save's step onto K devices (column slices on 8), the peak host RSS of the
    restore above the RSS before it (the high-water mark reset first)."""
    import jax
    import ml_dtypes
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import epochal.jax as ej

    sh = NamedSharding(mesh(k), P("x", "y"))
    a = {"w": jax.ShapeDtypeStruct((4096, 4096), np.float32, sharding=sh),
         "e": jax.ShapeDtypeStruct((4096, 4096), ml_dtypes.bfloat16, sharding=sh)}
    ej.restore(directory, {"w": jax.ShapeDtypeStruct((4096, 4096), np.float32)}, partial=True)  # warm up
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _rss_now_mib()
    tree = ej.restore(directory, a, chunk_bytes=chunk)
    peak = _hwm_mib() - base
    rng = np.random.default_rng(8)
    assert same_bits(rng.integers(0, 1 << 32, (4096, 4096), dtype=np.uint32).view(np.float32), tree["w"])
    assert same_bits(bf16_bits((4096, 4096), 9).view(ml_dtypes.bfloat16), tree["e"])
    print(json.dumps({"peak_mib": round(peak, 1)}))


def v1_save(directory: str, how: str) -> None:
    """Save the chain's pytree on 8 devices through Orbax's v1 API: ``local`` with
    ``ocp.save`` under epochal's local registry (checkpointable ``state``), ``global`` with
    ``save_checkpointables`` after ``register_handler`` for the name ``params``."""
    import jax
    import orbax.checkpoint.experimental.v1 as ocp

    from epochal.jax.orbax_v1 import EpochalHandler, local_registry

    tree = jax.tree_util.tree_map(lambda v, a: jax.device_put(v, a.sharding) if isinstance(v, np.ndarray) else v,
                                  values(), abstract(8))
    if how == "local":
        ctx = ocp.Context()
        ctx.checkpointables.registry = local_registry()
        with ctx:
            ocp.save(directory, tree)
    else:
        ocp.handlers.register_handler(EpochalHandler, checkpointable_name="params")
        ocp.save_checkpointables(directory, {"params": tree, "other": {"a": np.arange(3)}})
    print(json.dumps({"saved": sorted(os.listdir(directory))}))


def v1_load(directory: str, how: str, k: int) -> None:
    """Load what v1_save wrote onto K devices, every value compared bit for bit."""
    import jax
    import orbax.checkpoint.experimental.v1 as ocp

    from epochal.jax.orbax_v1 import EpochalHandler, local_registry

    if how == "local":
        ctx = ocp.Context()
        ctx.checkpointables.registry = local_registry()
        with ctx:
            # (ocp.load looks for Orbax's own pytree files: load_checkpointables asks the handler)
            tree = ocp.load_checkpointables(directory, {"state": abstract(k)})["state"]
    else:
        ocp.handlers.register_handler(EpochalHandler, checkpointable_name="params")
        tree = ocp.load_checkpointables(directory, {"params": abstract(k)})["params"]
    n = 0
    for w, t, a in zip(jax.tree_util.tree_leaves(values()), jax.tree_util.tree_leaves(tree),
                       jax.tree_util.tree_leaves(abstract(k))):
        if isinstance(w, np.ndarray):
            assert t.sharding == a.sharding and same_bits(w, t)
            for sh in t.addressable_shards:
                assert same_bits(w[sh.index], sh.data)
        else:
            assert t == w
        n += 1
    print(json.dumps({"leaves": n}))
