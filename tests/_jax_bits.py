"""The processes of tests/test_jax.py: each save or restore runs here, in a fresh process with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before jax is imported.

``python _jax_bits.py chain DIR K IN OUT``: restore step IN (``-``: none) onto a mesh of K
devices and compare every value bit for bit, then save what it holds as step OUT (``-``: no
save); prints one JSON line (``leaves`` compared, ``emb_read``: bytes read of one leaf).
``torch_save DIR``, ``torch_restore DIR`` (no jax), ``jax_save_cross DIR``,
``jax_restore_cross DIR K``: the cross-framework state, saved or restored by either side;
``torch_save_named``, ``jax_restore_named DIR K``, ``jax_save_named``, ``torch_restore_named``:
a torch ``{"model": {"fc.weight", ...}}`` against a flax-style pytree under a name mapping;
``dcp_save DIR WORLD`` (``dcp.save`` with EpochalStorageWriter, 1 process without a process
group or WORLD ranks), ``jax_restore_dcp DIR K``: that step restored onto K devices;
``big_save DIR``, ``big_restore_rss DIR K CHUNK``: 96 MiB restored, its peak host RSS;
``v1_save DIR HOW``, ``v1_load DIR HOW K``: through Orbax's v1 API (HOW: local or global
registry). Those last are in tests/_jax_bits_more.py.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("EPOCHAL_QUIET", "1")

import numpy as np  # noqa: E402

#: mesh shape of each device count: rows x columns
MESHES = {8: (4, 2), 4: (2, 2), 2: (1, 2), 1: (1, 1)}


def bf16_bits(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random bf16 bit patterns (NaN payloads, -0.0 and subnormals included), as uint16."""
    return np.random.default_rng(seed).integers(0, 1 << 16, size=shape, dtype=np.uint16)


def values() -> dict[str, Any]:
    """The chain's pytree as numpy (the expected values): float32 from random bit patterns,
    bf16, a list level and plain values."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    f32 = rng.integers(0, 1 << 32, size=(64, 48), dtype=np.uint32).view(np.float32)
    return {
        "params": {"w": f32, "emb": bf16_bits((256, 32), 1).view(ml_dtypes.bfloat16),
                   "b": np.arange(40, dtype=np.float32) - 7.5},
        "opt": [{"mu": f32[::-1].copy()}, {"count": 3}],
        "lr": 0.5,
    }


def specs() -> dict[str, Any]:
    from jax.sharding import PartitionSpec as P

    return {"params": {"w": P("x", "y"), "emb": P("x"), "b": P("y")},
            "opt": [{"mu": P("y", "x")}, {"count": None}], "lr": None}


def mesh(k: int) -> Any:
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:k]).reshape(MESHES[k]), ("x", "y"))


def abstract(k: int) -> Any:
    import jax
    from jax.sharding import NamedSharding

    m = mesh(k)
    return jax.tree_util.tree_map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(m, s))
        if isinstance(v, np.ndarray) else v,
        values(), specs(), is_leaf=lambda x: x is None)


def same_bits(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def chain(directory: str, k: int, step_in: str, step_out: str) -> None:
    import jax

    import epochal.jax as ej
    from epochal.jax import host
    from epochal.storage.formats.native.reads import ranges

    host.BLOCK_BYTES = 1024  # many row blocks in small arrays, edges inside shards
    reads: list[tuple[int, int]] = []
    orig = ranges.RangedFile.read_into

    def counted(self: Any, view: memoryview, offset: int, blob: Any = None) -> None:
        reads.append((offset, view.nbytes))
        orig(self, view, offset, blob)

    ranges.RangedFile.read_into = counted  # type: ignore[method-assign]
    want = values()
    out: dict[str, Any] = {"devices": len(jax.devices())}
    if step_in != "-":
        tree = ej.restore(directory, abstract(k), step=int(step_in))
        flat_w, _ = jax.tree_util.tree_flatten(want)
        flat_t, _ = jax.tree_util.tree_flatten(tree)
        flat_a, _ = jax.tree_util.tree_flatten(abstract(k))
        assert len(flat_w) == len(flat_t)
        for w, t, a in zip(flat_w, flat_t, flat_a):
            if isinstance(w, np.ndarray):
                assert isinstance(t, jax.Array) and t.sharding == a.sharding, (t, a)
                assert same_bits(w, t), "values differ"
                for sh in t.addressable_shards:  # each shard holds its own region
                    assert same_bits(w[sh.index], sh.data)
            else:
                assert type(t) is type(w) and t == w, (t, w)
        out["leaves"] = len(flat_t)
        from epochal.jax.reads import stored_leaves

        db = os.path.join(directory, f"local.{step_in}")
        with ranges.RangedFile(db) as f:
            segs = stored_leaves(f)[("params", "emb")].segs  # one, or one per block of each chunk
        assert sum(length for _, length, _ in segs) == want["params"]["emb"].nbytes
        out["emb_read"] = sum(max(0, min(o + n, off + length) - max(o, off)) for o, n in reads
                              for off, length, _ in segs)
    else:
        tree = jax.tree_util.tree_map(lambda v, a: jax.device_put(v, a.sharding) if isinstance(v, np.ndarray) else v,
                                      want, abstract(k))
    if step_out != "-":
        ej.save(directory, int(step_out), tree)
    print(json.dumps(out))


def cross_values() -> dict[str, np.ndarray]:
    return {"w": bf16_bits((64, 48), 2), "b": np.arange(40, dtype=np.float32) / 3}


def torch_save(directory: str) -> None:
    import torch

    import epochal

    v = cross_values()
    state = {"params": {"w": torch.from_numpy(v["w"].view(np.int16)).view(torch.bfloat16),
                        "b": torch.from_numpy(v["b"])}, "step": 7}
    with epochal.Checkpointer(directory) as ckpt:
        ckpt.save(7, state)
    assert "jax" not in sys.modules
    print(json.dumps({"saved": 7}))


def torch_restore(directory: str) -> None:
    import torch

    import epochal

    state = {"params": {"w": torch.zeros(64, 48, dtype=torch.bfloat16), "b": torch.zeros(40)}, "step": 0}
    with epochal.Checkpointer(directory) as ckpt:
        step = ckpt.restore(state)
    v = cross_values()
    w, b = state["params"]["w"], state["params"]["b"]  # type: ignore[index]
    assert isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and b.dtype == torch.float32
    assert w.view(torch.int16).numpy().view(np.uint16).tobytes() == v["w"].tobytes()
    assert b.numpy().tobytes() == v["b"].tobytes()
    assert "jax" not in sys.modules
    print(json.dumps({"restored": step, "step": state["step"]}))


def cross_abstract(k: int) -> Any:
    import jax
    import ml_dtypes
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    m = mesh(k)
    return {"params": {"w": jax.ShapeDtypeStruct((64, 48), ml_dtypes.bfloat16, sharding=NamedSharding(m, P("x", "y"))),
                       "b": jax.ShapeDtypeStruct((40,), np.float32, sharding=NamedSharding(m, P("y")))},
            "step": 0}


def jax_save_cross(directory: str) -> None:
    import jax

    import epochal.jax as ej

    v = cross_values()
    import ml_dtypes

    a = cross_abstract(8)
    tree = {"params": {"w": jax.device_put(v["w"].view(ml_dtypes.bfloat16), a["params"]["w"].sharding),
                       "b": jax.device_put(v["b"], a["params"]["b"].sharding)}, "step": 7}
    ej.save(directory, 7, tree)
    assert "torch" not in sys.modules
    print(json.dumps({"saved": 7}))


def jax_restore_cross(directory: str, k: int) -> None:
    import epochal.jax as ej

    tree = ej.restore(directory, cross_abstract(k))
    v = cross_values()
    assert np.asarray(tree["params"]["w"]).view(np.uint16).tobytes() == v["w"].tobytes()
    assert np.asarray(tree["params"]["b"]).tobytes() == v["b"].tobytes()
    assert len(tree["params"]["w"].addressable_shards) == k
    assert "torch" not in sys.modules
    print(json.dumps({"restored": 7, "step": tree["step"]}))


def named_values() -> dict[str, np.ndarray]:
    """The torch side of the name-mapping case, as bit patterns: a Linear's weight (out, in)
    in bf16, its bias in fp32, an embedding in float8_e4m3fn (uint8 bits)."""
    return {"fc.weight": bf16_bits((48, 64), 3), "fc.bias": np.arange(48, dtype=np.float32) / 7,
            "emb.weight": np.random.default_rng(4).integers(0, 256, (32, 16), dtype=np.uint8)}


#: flax-style leaf -> torch name; the kernel is the weight's transpose
NAMES = {"params/Dense_0/kernel": ("model/fc.weight", True), "params/Dense_0/bias": ("model/fc.bias", False),
         "params/Embed_0/embedding": ("model/emb.weight", False)}


def jax_names() -> dict[str, Any]:
    from epochal.jax import transposed

    return {k: transposed(v) if t else v for k, (v, t) in NAMES.items()}


def named_abstract(k: int) -> Any:
    import jax
    import ml_dtypes
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    m = mesh(k)

    def sds(shape: tuple[int, ...], dt: Any, spec: Any) -> Any:
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(m, spec))

    return {"params": {"Dense_0": {"kernel": sds((64, 48), ml_dtypes.bfloat16, P("x", "y")),
                                   "bias": sds((48,), np.float32, P("y"))},
                       "Embed_0": {"embedding": sds((32, 16), ml_dtypes.float8_e4m3fn, P(None, "y"))}},
            "step": 0}


def named_expected() -> dict[str, np.ndarray]:
    """The flax-side values, as raw bits: the kernel is the weight transposed."""
    import ml_dtypes

    v = named_values()
    return {"kernel": np.ascontiguousarray(v["fc.weight"].T).view(ml_dtypes.bfloat16),
            "bias": v["fc.bias"], "embedding": v["emb.weight"].view(ml_dtypes.float8_e4m3fn)}


def torch_save_named(directory: str) -> None:
    import torch

    import epochal

    v = named_values()
    model = {"fc.weight": torch.from_numpy(v["fc.weight"].view(np.int16)).view(torch.bfloat16),
             "fc.bias": torch.from_numpy(v["fc.bias"]),
             "emb.weight": torch.from_numpy(v["emb.weight"]).view(torch.float8_e4m3fn)}
    with epochal.Checkpointer(directory) as ckpt:
        ckpt.save(7, {"model": model, "step": 7})
    assert "jax" not in sys.modules
    print(json.dumps({"saved": 7}))


def jax_restore_named(directory: str, k: int) -> None:
    import jax

    import epochal.jax as ej

    tree = ej.restore(directory, named_abstract(k), names=jax_names())
    want = named_expected()
    got = {"kernel": tree["params"]["Dense_0"]["kernel"], "bias": tree["params"]["Dense_0"]["bias"],
           "embedding": tree["params"]["Embed_0"]["embedding"]}
    a = named_abstract(k)["params"]
    shardings = {"kernel": a["Dense_0"]["kernel"].sharding, "bias": a["Dense_0"]["bias"].sharding,
                 "embedding": a["Embed_0"]["embedding"].sharding}
    for name, w in want.items():
        t = got[name]
        assert isinstance(t, jax.Array) and t.sharding == shardings[name], name
        assert same_bits(w, t), name
        for sh in t.addressable_shards:
            assert same_bits(w[sh.index], sh.data), name
    assert "torch" not in sys.modules
    print(json.dumps({"restored": sorted(got), "step": tree["step"]}))


def jax_save_named(directory: str) -> None:
    import jax

    import epochal.jax as ej

    a = named_abstract(8)
    w = named_expected()
    tree = {"params": {"Dense_0": {"kernel": jax.device_put(w["kernel"], a["params"]["Dense_0"]["kernel"].sharding),
                                   "bias": jax.device_put(w["bias"], a["params"]["Dense_0"]["bias"].sharding)},
                       "Embed_0": {"embedding": jax.device_put(w["embedding"],
                                                               a["params"]["Embed_0"]["embedding"].sharding)}},
            "step": 7}
    ej.save(directory, 7, tree, names=jax_names())
    assert "torch" not in sys.modules
    print(json.dumps({"saved": 7}))


def torch_restore_named(directory: str) -> None:
    import torch

    import epochal

    model = {"fc.weight": torch.zeros(48, 64, dtype=torch.bfloat16), "fc.bias": torch.zeros(48),
             "emb.weight": torch.zeros(32, 16, dtype=torch.float8_e4m3fn)}
    state = {"model": model, "step": 0}
    with epochal.Checkpointer(directory) as ckpt:
        step = ckpt.restore(state)
    v = named_values()
    assert model["fc.weight"].dtype == torch.bfloat16 and model["emb.weight"].dtype == torch.float8_e4m3fn
    assert model["fc.weight"].view(torch.int16).numpy().view(np.uint16).tobytes() == v["fc.weight"].tobytes()
    assert model["fc.bias"].numpy().tobytes() == v["fc.bias"].tobytes()
    assert model["emb.weight"].view(torch.uint8).numpy().tobytes() == v["emb.weight"].tobytes()
    assert "jax" not in sys.modules
    print(json.dumps({"restored": step, "step": state["step"]}))


def orbax_save(directory: str) -> None:
    import jax
    import orbax.checkpoint as ocp

    from epochal.jax.orbax import EpochalSave

    tree = jax.tree_util.tree_map(lambda v, a: jax.device_put(v, a.sharding) if isinstance(v, np.ndarray) else v,
                                  values(), abstract(8))
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=2)) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, args=EpochalSave({**tree, "lr": step / 2}))
        mngr.wait_until_finished()
        print(json.dumps({"steps": list(mngr.all_steps())}))


def orbax_restore(directory: str, k: int) -> None:
    import jax
    import orbax.checkpoint as ocp

    from epochal.jax.orbax import EpochalRestore

    with ocp.CheckpointManager(directory) as mngr:
        tree = mngr.restore(mngr.latest_step(), args=EpochalRestore(abstract(k)))
    want = values()
    for w, t in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(tree)):
        if isinstance(w, np.ndarray):
            assert same_bits(w, t) and len(t.addressable_shards) == k
    print(json.dumps({"lr": tree["lr"]}))


if __name__ == "__main__":
    import _jax_bits_more as more
    import _jax_bits_save as saves

    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "chain":
        chain(args[0], int(args[1]), args[2], args[3])
    elif cmd == "torch_save":
        torch_save(args[0])
    elif cmd == "torch_restore":
        torch_restore(args[0])
    elif cmd == "jax_save_cross":
        jax_save_cross(args[0])
    elif cmd == "jax_restore_cross":
        jax_restore_cross(args[0], int(args[1]))
    elif cmd in ("torch_save_named", "jax_save_named", "torch_restore_named"):
        globals()[cmd](args[0])
    elif cmd == "jax_restore_named":
        jax_restore_named(args[0], int(args[1]))
    elif cmd == "dcp_save":
        more.dcp_save(args[0], int(args[1]))
    elif cmd == "jax_restore_dcp":
        more.jax_restore_dcp(args[0], int(args[1]))
    elif cmd == "big_save":
        more.big_save(args[0])
    elif cmd == "big_restore_rss":
        more.big_restore_rss(args[0], int(args[1]), int(args[2]))
    elif cmd == "v1_save":
        more.v1_save(args[0], args[1])
    elif cmd == "v1_load":
        more.v1_load(args[0], args[1], int(args[2]))
    elif cmd == "orbax_save":
        orbax_save(args[0])
    elif cmd == "orbax_restore":
        orbax_restore(args[0], int(args[1]))
    elif cmd in ("stream_save", "stream_restore", "stream_torch", "orbax_torch_save"):
        getattr(saves, cmd)(*args)
    elif cmd == "orbax_names":
        saves.orbax_names(args[0], int(args[1]))
    else:
        raise SystemExit(f"unknown command {cmd}")
