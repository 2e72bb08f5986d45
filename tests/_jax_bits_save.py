"""Processes of tests/test_jax.py for a sharded save (run through tests/_jax_bits.py): a
256 MiB pytree saved shard by shard from 8 devices, its peak host RSS, restored onto
8, 4, 2 and 1 devices and into PyTorch; a torch state restored through an Orbax
``CheckpointManager`` under a name mapping."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
from _jax_bits import bf16_bits, mesh, same_bits


def stream_values() -> dict[str, np.ndarray]:
    """256 MiB as bit patterns: a 128 MiB fp32 weight, a 128 MiB bf16 embedding (uint16 bits)
    and a small fp32 bias."""
    rng = np.random.default_rng(21)
    return {"w": rng.integers(0, 1 << 32, (4096, 8192), dtype=np.uint32).view(np.float32),
            "e": bf16_bits((8192, 8192), 22), "b": np.arange(1000, dtype=np.float32) / 3}


def _specs() -> dict[str, Any]:
    from jax.sharding import PartitionSpec as P

    return {"w": P("x", "y"), "e": P("x"), "b": P()}


def _abstract(k: int) -> dict[str, Any]:
    import jax
    import ml_dtypes
    from jax.sharding import NamedSharding

    m, sp = mesh(k), _specs()
    dts = {"w": np.float32, "e": ml_dtypes.bfloat16, "b": np.float32}
    shapes = {"w": (4096, 8192), "e": (8192, 8192), "b": (1000,)}
    return {"params": {n: jax.ShapeDtypeStruct(shapes[n], dts[n], sharding=NamedSharding(m, sp[n])) for n in sp},
            "step": 0}


def stream_save(directory: str) -> None:
    """Save the 256 MiB pytree from 8 devices (a warm-up save first); the peak host RSS of
    the save above the RSS before it, and each leaf's record kind and chunk count."""
    import gc

    import jax
    import ml_dtypes
    from _jax_bits_more import _hwm_mib, _rss_now_mib

    import epochal.jax as ej
    from epochal.jax.reads import stored_leaves
    from epochal.storage.formats.native.reads.ranges import RangedFile

    v = stream_values()
    a = _abstract(8)["params"]
    tree = {"params": {n: jax.device_put(v[n].view(ml_dtypes.bfloat16) if n == "e" else v[n], a[n].sharding)
                       for n in v}, "step": 3}
    jax.block_until_ready(tree)
    del v
    ej.save(os.path.join(directory, "warm"), 1, {"x": jax.device_put(np.ones((64, 64), np.float32),
                                                                     a["w"].sharding)})
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _rss_now_mib()
    ej.save(directory, 3, tree)
    peak = _hwm_mib() - base
    with RangedFile(os.path.join(directory, "local.3")) as f:
        s = stored_leaves(f)
        kinds = {n[1]: s[n].kind for n in s if n[0] == "params"}
        chunks = {n[1]: len(s[n].meta.get("chunks", [])) for n in s if n[0] == "params"}
    print(json.dumps({"peak_mib": round(peak, 1), "kinds": kinds, "chunks": chunks}))


def stream_restore(directory: str) -> None:
    """Restore the saved pytree onto 8, 4, 2 and 1 devices, every shard compared bit for bit."""
    import ml_dtypes

    import epochal.jax as ej

    v = stream_values()
    v["e"] = v["e"].view(ml_dtypes.bfloat16)
    done = []
    for k in (8, 4, 2, 1):
        a = _abstract(k)
        tree = ej.restore(directory, a)
        assert tree["step"] == 3
        for n, want in v.items():
            t = tree["params"][n]
            assert t.sharding == a["params"][n].sharding and same_bits(want, t), (k, n)
            for sh in t.addressable_shards:
                assert same_bits(want[sh.index], sh.data), (k, n)
        del tree
        done.append(k)
    print(json.dumps({"restored_on": done}))


def stream_torch(directory: str) -> None:
    """Restore the saved pytree into PyTorch: into live tensors (in place) and as fresh ones."""
    import torch

    import epochal

    v = stream_values()
    live = {"params": {"w": torch.zeros(4096, 8192), "e": torch.zeros(8192, 8192, dtype=torch.bfloat16),
                       "b": torch.zeros(1000)}, "step": 0}
    fresh: dict[str, Any] = {"params": None, "step": 0}
    with epochal.Checkpointer(directory) as ckpt:
        assert ckpt.restore(live) == 3
        ckpt.restore(fresh)
    for state in (live, fresh):
        p = state["params"]
        assert p["e"].dtype == torch.bfloat16 and p["w"].dtype == torch.float32
        assert p["w"].numpy().tobytes() == v["w"].tobytes()
        assert p["e"].view(torch.int16).numpy().view(np.uint16).tobytes() == v["e"].tobytes()
        assert p["b"].numpy().tobytes() == v["b"].tobytes()
    assert "jax" not in sys.modules
    print(json.dumps({"restored": sorted(fresh["params"]), "step": fresh["step"]}))


def orbax_torch_save(root: str) -> None:
    """A torch state saved by a PyTorch Checkpointer where an Orbax CheckpointManager keeps
    its step 7 (``<root>/7/default``: epochal's step 0 there, as the handler writes it)."""
    import torch
    from _jax_bits import named_values

    import epochal

    v = named_values()
    model = {"fc.weight": torch.from_numpy(v["fc.weight"].view(np.int16)).view(torch.bfloat16),
             "fc.bias": torch.from_numpy(v["fc.bias"]),
             "emb.weight": torch.from_numpy(v["emb.weight"]).view(torch.float8_e4m3fn)}
    with epochal.Checkpointer(os.path.join(root, "7", "default")) as ckpt:
        ckpt.save(0, {"model": model, "step": 7})
    assert "jax" not in sys.modules
    print(json.dumps({"saved": sorted(os.listdir(os.path.join(root, "7", "default")))}))


def orbax_names(root: str, k: int) -> None:
    """Through an Orbax CheckpointManager under the flax <-> torch name mapping: restore the
    torch-saved step 7 onto K devices (every shard compared), save it back as step 8 (the
    kernel stored transposed under the torch name) and restore that, and the same through Orbax's v1 API
    (``local_registry(names=...)``) into ``<root>/v1``."""
    import jax
    import orbax.checkpoint as ocp
    import orbax.checkpoint.experimental.v1 as ocp1
    from _jax_bits import jax_names, named_abstract, named_expected

    from epochal.jax.orbax import EpochalRestore, EpochalSave
    from epochal.jax.orbax_v1 import local_registry
    from epochal.jax.reads import stored_leaves
    from epochal.storage.formats.native.reads.ranges import RangedFile

    want, a = named_expected(), named_abstract(k)

    def check(tree: Any) -> None:
        got = {"kernel": tree["params"]["Dense_0"]["kernel"], "bias": tree["params"]["Dense_0"]["bias"],
               "embedding": tree["params"]["Embed_0"]["embedding"]}
        for name, w in want.items():
            assert same_bits(w, got[name]) and len(got[name].addressable_shards) == k, name
        assert tree["step"] == 7

    with ocp.CheckpointManager(root) as mngr:
        tree = mngr.restore(mngr.latest_step(), args=EpochalRestore(a, names=jax_names()))
        check(tree)
        mngr.save(8, args=EpochalSave(tree, names=jax_names()))
        mngr.wait_until_finished()
        steps = list(mngr.all_steps())
        check(mngr.restore(8, args=EpochalRestore(a, names=jax_names())))  # the kernel's chunks, transposed
    with RangedFile(os.path.join(root, "8", "default", "local.0")) as f:
        stored = sorted("/".join(n) for n in stored_leaves(f))
    ctx = ocp1.Context()
    ctx.checkpointables.registry = local_registry("state", names=jax_names())
    with ctx:
        ocp1.save(os.path.join(root, "v1"), tree)
        check(ocp1.load_checkpointables(os.path.join(root, "v1"), {"state": a})["state"])
    with RangedFile(os.path.join(root, "v1", "state", "local.0")) as f:
        assert sorted("/".join(n) for n in stored_leaves(f)) == stored
    print(json.dumps({"steps": steps, "stored": stored, "jax": jax.device_count()}))
