"""The JAX door (epochal.jax): pytrees saved on one mesh and restored on another,
bit for bit, across PyTorch and JAX, with errors naming the leaf and the step.

Saves and restores between meshes run in fresh processes (tests/_jax_bits.py) with 8 CPU
devices (``XLA_FLAGS`` is set there before jax is imported); the in-process tests use one
device."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tracemalloc
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
jax = pytest.importorskip("jax")
ml_dtypes = pytest.importorskip("ml_dtypes")

import epochal  # noqa: E402
import epochal.jax as ej  # noqa: E402
from epochal.errors import (  # noqa: E402
    BlobMismatchError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    MissingBlobError,
)
from epochal.jax.reads import Stored, read_region, read_regions, stored_leaves  # noqa: E402
from epochal.storage.formats.native.reads.ranges import RangedFile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def run_bits(*args: str) -> dict[str, Any]:
    """One process of tests/_jax_bits.py; its JSON line."""
    out = subprocess.run([sys.executable, os.path.join(HERE, "_jax_bits.py"), *args], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# ---------------------------------------------------------------- across meshes and frameworks
@pytest.mark.system
def test_saved_on_8_restores_on_4_2_1_and_back_to_8(tmp_path: Any) -> None:
    d = str(tmp_path)
    assert run_bits("chain", d, "8", "-", "1") == {"devices": 8}
    emb_bytes = 256 * 32 * 2
    for k, step_in, step_out in (("4", "1", "2"), ("2", "2", "3"), ("1", "3", "4"), ("8", "4", "-")):
        got = run_bits("chain", d, k, step_in, step_out)
        # every leaf compared bit for bit, shard by shard, in the target sharding; a leaf
        # sharded by rows is read once, only its bytes (replicas share one read)
        assert got == {"devices": 8, "leaves": 6, "emb_read": emb_bytes}, (k, got)
    assert sorted(os.listdir(d)) == [".epochal", "local.1", "local.2", "local.3", "local.4"]


@pytest.mark.system
@pytest.mark.parametrize("k", ["2", "8"])
def test_a_torch_checkpoint_restores_into_jax_bf16_and_fp32(tmp_path: Any, k: str) -> None:
    assert run_bits("torch_save", str(tmp_path)) == {"saved": 7}
    assert run_bits("jax_restore_cross", str(tmp_path), k) == {"restored": 7, "step": 7}


@pytest.mark.system
def test_a_jax_checkpoint_restores_into_torch_bf16_and_fp32(tmp_path: Any) -> None:
    assert run_bits("jax_save_cross", str(tmp_path)) == {"saved": 7}
    assert run_bits("torch_restore", str(tmp_path)) == {"restored": 7, "step": 7}


@pytest.mark.system
@pytest.mark.parametrize("k", ["2", "8"])
def test_a_torch_state_restores_into_a_flax_pytree_under_a_name_mapping(tmp_path: Any, k: str) -> None:
    # fc.weight (48, 64) bf16 -> Dense_0/kernel (64, 48), transposed as the mapping says;
    # fp32 bias; a float8_e4m3fn embedding; every shard compared bit for bit
    assert run_bits("torch_save_named", str(tmp_path)) == {"saved": 7}
    assert run_bits("jax_restore_named", str(tmp_path), k) == {"restored": ["bias", "embedding", "kernel"],
                                                               "step": 7}


@pytest.mark.system
def test_a_flax_pytree_saved_under_a_name_mapping_restores_into_torch(tmp_path: Any) -> None:
    assert run_bits("jax_save_named", str(tmp_path)) == {"saved": 7}
    with RangedFile(str(tmp_path / "local.7")) as f:
        assert sorted(stored_leaves(f)) == [("model", "emb.weight"), ("model", "fc.bias"),
                                            ("model", "fc.weight"), ("step",)]
    assert run_bits("torch_restore_named", str(tmp_path)) == {"restored": 7, "step": 7}


@pytest.mark.system
@pytest.mark.parametrize("world, k", [("1", "8"), ("2", "2")])
def test_a_dcp_save_restores_into_jax_on_a_mesh(tmp_path: Any, world: str, k: str) -> None:
    # dcp.save with EpochalStorageWriter, one process without a process group or 2 ranks
    # (the weights split by columns and rows): each rank's db, DCP's metadata db; the 8 MiB
    # weight stored as row blocks. Restored as the same nested dicts and as a flax-style
    # pytree under a mapping (a transposed kernel), every shard compared bit for bit
    d = str(tmp_path / "dcp")
    dbs = ["dcp.7"] + [f"rank{r}.7" for r in range(int(world))]
    assert run_bits("dcp_save", d, world) == {"saved": dbs}
    with RangedFile(os.path.join(d, "rank0.7")) as f:
        assert any(n.startswith("model.big.weight@0,0#b") for n in f.names())
    # every byte of the 8 MiB weight read once, though 4 column slices share each row range on 8
    assert run_bits("jax_restore_dcp", d, k) == {"checked": 6, "big_read": 2048 * 1024 * 4}


@pytest.mark.system
def test_a_damaged_dcp_block_is_refused_naming_the_leaf(tmp_path: Any) -> None:
    d = str(tmp_path / "dcp")
    run_bits("dcp_save", d, "1")
    db = os.path.join(d, "rank0.7")
    with RangedFile(db) as f:
        blob = next(n for n in f.names() if n.startswith("model.big.weight@0,0#b1"))
        off, length, _ = f.find(blob)[2][0]  # type: ignore[index]
    with open(db, "r+b") as fh:  # a data byte: the size and the index's digest still match
        fh.seek(off + length // 2)
        b = fh.read(1)
        fh.seek(off + length // 2)
        fh.write(bytes([b[0] ^ 1]))
    a = {"model": {"big.weight": jax.ShapeDtypeStruct((2048, 1024), np.float32)}}
    with pytest.raises(CheckpointCorruptError) as e:
        ej.restore(d, a, partial=True)
    assert e.value.path.endswith("rank0.7") and e.value.blob == blob and "model/big.weight" in str(e.value)


@pytest.mark.system
@pytest.mark.parametrize("k", ["8", "2"])
def test_a_restore_holds_the_arrays_and_one_chunk_per_thread(tmp_path: Any, k: str) -> None:
    # 96 MiB restored on a 4x2 mesh (column slices) or 1x2: on CPU devices JAX adopts the
    # buffers read into, so the peak host RSS of the restore is the arrays, 4 threads'
    # 1 MiB scratch and a little slack; not the arrays twice
    d = str(tmp_path)
    assert run_bits("big_save", d) == {"saved": 1}
    got = run_bits("big_restore_rss", d, k, str(1 << 20))
    assert got["peak_mib"] <= 96 + ej.api.READ_THREADS * 1 + 4, got


@pytest.mark.system
def test_an_orbax_checkpoint_manager_keeps_epochal_files_and_restores_resharded(tmp_path: Any) -> None:
    pytest.importorskip("orbax.checkpoint")
    d = str(tmp_path)
    assert run_bits("orbax_save", d) == {"steps": [2, 3]}  # Orbax's retention
    item = os.path.join(d, "3", "default")  # epochal's checkpoint inside Orbax's step 3
    assert epochal.CheckpointDirectory(item).committed_epochs() == [0]
    assert "local.0" in os.listdir(item) and not os.path.exists(os.path.join(d, "1"))
    assert run_bits("orbax_restore", d, "2") == {"lr": 1.5}
    _flip(os.path.join(item, "local.0"), ("params", "w"), 0.5)
    out = subprocess.run([sys.executable, os.path.join(HERE, "_jax_bits.py"), "orbax_restore", d, "2"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode != 0 and "CheckpointCorruptError" in out.stderr and "params/w" in out.stderr


@pytest.mark.system
@pytest.mark.parametrize("how, item", [("local", "state"), ("global", "params")])
def test_an_orbax_v1_checkpointable_is_an_epochal_checkpoint_restored_resharded(
        tmp_path: Any, how: str, item: str) -> None:
    pytest.importorskip("orbax.checkpoint.experimental.v1")
    d = str(tmp_path / "v1")
    saved = run_bits("v1_save", d, how)["saved"]
    assert item in saved and "_CHECKPOINT_METADATA" in saved
    assert epochal.CheckpointDirectory(os.path.join(d, item)).committed_epochs() == [0]
    assert sorted(os.listdir(os.path.join(d, item))) == [".epochal", "local.0"]
    assert run_bits("v1_load", d, how, "2") == {"leaves": 6}
    _flip(os.path.join(d, item, "local.0"), ("params", "w"), 0.5)
    out = subprocess.run([sys.executable, os.path.join(HERE, "_jax_bits.py"), "v1_load", d, how, "2"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode != 0 and "CheckpointCorruptError" in out.stderr and "params/w" in out.stderr


# ---------------------------------------------------------------- in one process, one device
def dev_tree() -> dict[str, Any]:
    rng = np.random.default_rng(5)
    return {"params": {"w": jax.numpy.asarray(rng.standard_normal((32, 24)).astype(np.float32)),
                       "e": jax.numpy.asarray(rng.integers(0, 1 << 16, (16, 8), dtype=np.uint16)
                                              .view(ml_dtypes.bfloat16))},
            "count": 3}


def abstract_of(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, tree)


def test_nested_dicts_are_stored_under_a_torch_states_names(tmp_path: Any) -> None:
    torch = pytest.importorskip("torch")
    ej.save(str(tmp_path / "j"), 1, dev_tree())
    with epochal.Checkpointer(str(tmp_path / "t")) as ckpt:
        ckpt.save(1, {"params": {"w": torch.zeros(32, 24), "e": torch.zeros(16, 8, dtype=torch.bfloat16)},
                      "count": 3})
    with RangedFile(str(tmp_path / "j" / "local.1")) as fj, RangedFile(str(tmp_path / "t" / "local.1")) as ft:
        assert sorted(fj.names()) == sorted(ft.names()) == ["count", "params"]
        sj, st = stored_leaves(fj), stored_leaves(ft)
        assert sorted(sj) == sorted(st) == [("count",), ("params", "e"), ("params", "w")]
        for names in sj:
            assert sj[names].kind == st[names].kind
            assert {k: v for k, v in sj[names].meta.items() if k != "row_crc"} == st[names].meta


def test_lists_tuples_and_named_tuples_round_trip_under_key_path_names(tmp_path: Any) -> None:
    State = collections.namedtuple("State", "mu nu")
    x = jax.numpy.arange(12.0).reshape(3, 4)
    tree = {"opt": (State(x, x + 1), [x * 2, 7]), "step": np.int64(9), "name": "run"}
    ej.save(str(tmp_path), 3, tree)
    with RangedFile(str(tmp_path / "local.3")) as f:
        assert sorted(stored_leaves(f)) == [("name",), ("opt", "[0]", ".mu"), ("opt", "[0]", ".nu"),
                                            ("opt", "[1]", "[0]"), ("opt", "[1]", "[1]"), ("step",)]
    got = ej.restore(str(tmp_path), abstract_of(tree))
    assert isinstance(got["opt"][0], State) and isinstance(got["opt"][1], list)
    assert np.array_equal(got["opt"][0].nu, x + 1) and np.array_equal(got["opt"][1][0], x * 2)
    assert got["opt"][1][1] == 7 and got["step"] == 9 and got["name"] == "run"


def test_the_checkpointers_retention_and_async_saves_work_for_pytrees(tmp_path: Any) -> None:
    tree = dev_tree()
    with epochal.Checkpointer(str(tmp_path), keep_last=2, async_save=True) as ckpt:
        for step in (1, 2, 3):
            ej.save(ckpt, step, {**tree, "count": step})
        got = ej.restore(ckpt, abstract_of(tree))  # waits for the pending save
        assert got["count"] == 3
        assert ej.restore(ckpt, abstract_of(tree), step=2)["count"] == 2
        with pytest.raises(CheckpointNotFoundError, match="step 1 is not committed"):
            ej.restore(ckpt, abstract_of(tree), step=1)
    assert epochal.CheckpointDirectory(str(tmp_path)).committed_epochs() == [2, 3]
    assert np.asarray(got["params"]["e"]).tobytes() == np.asarray(tree["params"]["e"]).tobytes()


def test_a_save_to_a_directory_takes_the_checkpointers_retention_and_async_options(tmp_path: Any) -> None:
    import ctypes

    d, tree = str(tmp_path), dev_tree()
    for step in (1, 2, 3):
        assert ej.save(d, step, {**tree, "count": step}, keep_last=2) is None
    assert epochal.CheckpointDirectory(d).committed_epochs() == [2, 3]
    w = tree["params"]["w"]
    before = np.asarray(w).tobytes()
    pending = ej.save(d, 4, {**tree, "count": 4}, keep_last=2, async_save=True)
    assert isinstance(pending, ej.PendingSave) and pending.step == 4
    for s in w.addressable_shards:  # the live buffer reused in place once save returned
        ctypes.memset(s.data.unsafe_buffer_pointer(), 0x5A, s.data.nbytes)
    assert np.asarray(w).tobytes() != before
    ej.wait()  # committed, retention applied
    pending.wait()  # (joined already: nothing more)
    assert epochal.CheckpointDirectory(d).committed_epochs() == [3, 4]
    # a fresh process restores step 4 with the values of the moment save returned
    code = ("import sys, hashlib, numpy as np, jax, epochal.jax as ej\n"
            "a = {'params': {'w': np.empty((32, 24), np.float32), 'e': np.empty((16, 8), 'bfloat16')}, 'count': 0}\n"
            "got = ej.restore(sys.argv[1], a)\n"
            "print(got['count'], hashlib.sha256(got['params']['w'].tobytes()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code, d], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    import hashlib

    assert out.stdout.split() == ["4", hashlib.sha256(before).hexdigest()]
    # a restore joins the async save in flight first: it finds that step committed
    pending = ej.save(d, 5, {**tree, "count": 5}, async_save=True)
    assert ej.restore(d, abstract_of(tree))["count"] == 5 and pending.done()
    with epochal.Checkpointer(str(tmp_path / "c")) as ckpt:
        with pytest.raises(ValueError, match="keep_last, async_save are options of a save to a directory"):
            ej.save(ckpt, 1, tree, keep_last=2, async_save=True)
        assert ckpt.steps() == []


def test_a_save_to_a_directory_compresses_when_asked_and_restores_bit_exact_in_a_fresh_process(tmp_path: Any) -> None:
    import hashlib

    from epochal.storage.formats.native import NativeFile

    rng = np.random.default_rng(5)
    z = (rng.normal(0, 0.02, (256, 256)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    zb = jax.device_put(z.view(ml_dtypes.bfloat16))
    raw, packed = str(tmp_path / "raw"), str(tmp_path / "z")
    ej.save(raw, 1, {"z": zb, "count": 1})
    ej.save(packed, 1, {"z": zb, "count": 1}, compression="zstd")
    (db_raw,), (db_z,) = ([os.path.join(d, f) for f in os.listdir(d) if not f.startswith(".")] for d in (raw, packed))
    with NativeFile(db_z, mmap=False) as f:
        assert f.stat().format_version.startswith("3.")
    assert os.path.getsize(db_z) < 0.8 * os.path.getsize(db_raw)  # bf16 N(0, 0.02): about 1.5x
    code = ("import sys, hashlib, numpy as np, jax, epochal.jax as ej\n"
            "got = ej.restore(sys.argv[1], {'z': np.empty((256, 256), 'bfloat16'), 'count': 0})\n"
            "print(got['count'], hashlib.sha256(got['z'].tobytes()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code, packed], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["1", hashlib.sha256(z.tobytes()).hexdigest()]
    with pytest.raises(ValueError, match="compression must be one of"):
        ej.save(str(tmp_path / "bad"), 1, {"z": zb}, compression="lz4")
    with epochal.Checkpointer(str(tmp_path / "c")) as ckpt:
        with pytest.raises(ValueError, match="compression are options of a save to a directory"):
            ej.save(ckpt, 1, {"z": zb}, compression="zstd")


def test_a_save_to_a_directory_writes_incremental_steps_when_asked(tmp_path: Any) -> None:
    frozen = np.random.default_rng(1).normal(0, 1, (512, 512)).astype(np.float32)  # 1 MiB
    d = str(tmp_path)
    for step in (1, 2, 3):
        ej.save(d, step, {"base": jax.device_put(frozen), "head": np.full(64, float(step), np.float32)},
                incremental=True, keep_last=2)
    files = {f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.startswith("local.")}
    assert epochal.CheckpointDirectory(d).committed_epochs() == [2, 3] and "local.1" in files  # (referenced)
    assert files["local.3"] < files["local.1"] // 8, files
    got = ej.restore(d, {"base": np.empty((512, 512), np.float32), "head": np.empty(64, np.float32)})
    assert got["base"].tobytes() == frozen.tobytes() and got["head"].tolist() == [3.0] * 64


@pytest.mark.parametrize("change, error, words", [
    (lambda a: a["params"].update(w=jax.ShapeDtypeStruct((32, 25), np.float32)), BlobMismatchError,
     ["step 4", "params/w", "(32, 24)", "(32, 25)"]),
    (lambda a: a["params"].update(e=jax.ShapeDtypeStruct((16, 8), np.float16)), BlobMismatchError,
     ["step 4", "params/e", "bfloat16", "float16"]),
    (lambda a: a["params"].update(v=jax.ShapeDtypeStruct((2,), np.float32)), MissingBlobError,
     ["step 4", "params/v"]),
    (lambda a: a["params"].pop("w"), BlobMismatchError, ["step 4", "params/w", "partial=True"]),
    (lambda a: a.update(count=jax.ShapeDtypeStruct((2,), np.float32)), BlobMismatchError,
     ["step 4", "count", "array"]),
])
def test_a_pytree_that_does_not_fit_is_refused_naming_the_leaf_and_step(
        tmp_path: Any, change: Any, error: type, words: list[str]) -> None:
    tree = dev_tree()
    ej.save(str(tmp_path), 4, tree)
    a = abstract_of(tree)
    change(a)
    with pytest.raises(error) as e:
        ej.restore(str(tmp_path), a)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_partial_leaves_out_the_checkpoints_other_leaves(tmp_path: Any) -> None:
    tree = dev_tree()
    ej.save(str(tmp_path), 4, tree)
    got = ej.restore(str(tmp_path), {"params": {"e": abstract_of(tree)["params"]["e"]}}, partial=True)
    assert np.asarray(got["params"]["e"]).tobytes() == np.asarray(tree["params"]["e"]).tobytes()


def _linear(tmp_path: Any) -> Any:
    """A step holding {"model": {"fc.weight": (4, 6)}} and the (6, 4) array it is the .T of."""
    k = np.arange(24, dtype=np.float32).reshape(6, 4)
    ej.save(str(tmp_path), 1, {"model": {"fc.weight": np.ascontiguousarray(k.T)}})
    return k


def test_a_transposed_array_is_refused_unless_the_mapping_says_so(tmp_path: Any) -> None:
    k = _linear(tmp_path)
    a = {"params": {"kernel": jax.ShapeDtypeStruct((6, 4), np.float32)}}
    with pytest.raises(BlobMismatchError) as e:
        ej.restore(str(tmp_path), a, names={"params/kernel": "model/fc.weight"})
    for w in ("step 1", "params/kernel (stored as model/fc.weight)", "(4, 6)", "(6, 4)", "transposed("):
        assert w in str(e.value), (w, str(e.value))
    got = ej.restore(str(tmp_path), a, names={"params/kernel": ej.transposed("model/fc.weight")})
    assert np.asarray(got["params"]["kernel"]).tobytes() == k.tobytes()


@pytest.mark.parametrize("names", [
    {"['params']['kernel']": ej.transposed(("model", "fc.weight"))},
    {"params.kernel": ej.transposed("model/fc.weight")},
    lambda leaf: ej.transposed("model/fc.weight") if leaf == "params/kernel" else None,
], ids=["keystr-tuple", "dotted", "callable"])
def test_a_mapping_names_leaves_by_keystr_dots_or_a_callable(tmp_path: Any, names: Any) -> None:
    k = _linear(tmp_path)
    got = ej.restore(str(tmp_path), {"params": {"kernel": jax.ShapeDtypeStruct((6, 4), np.float32)}},
                     names=names)
    assert np.asarray(got["params"]["kernel"]).tobytes() == k.tobytes()


@pytest.mark.parametrize("names, words", [
    ({"params/kernal": "model/fc.weight"}, ["no leaf", "'params/kernal'"]),
    ({"params/kernel": "model/fc.weight", "params/b": "model/fc.weight"}, ["params/b", "params/kernel",
                                                                          "both stored as model/fc.weight"]),
    ({"params/kernel": "model//w"}, ["params/kernel", "empty level"]),
])
def test_a_bad_mapping_is_refused_naming_the_leaf(tmp_path: Any, names: Any, words: list[str]) -> None:
    _linear(tmp_path)
    a = {"params": {"kernel": jax.ShapeDtypeStruct((6, 4), np.float32), "b": jax.ShapeDtypeStruct((4,), np.float32)}}
    with pytest.raises(ValueError) as e:
        ej.restore(str(tmp_path), a, names=names)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_save_under_a_mapping_stores_the_transpose_under_the_torch_name(tmp_path: Any) -> None:
    k = np.arange(24, dtype=np.float32).reshape(6, 4)
    ej.save(str(tmp_path), 2, {"params": {"kernel": jax.numpy.asarray(k)}, "step": 2},
            names={"params/kernel": ej.transposed("model/fc.weight")})
    with RangedFile(str(tmp_path / "local.2")) as f:
        s = stored_leaves(f)
        assert sorted(s) == [("model", "fc.weight"), ("step",)]
        assert s[("model", "fc.weight")].meta["shape"] == [4, 6]
        assert read_region(f, s[("model", "fc.weight")], "w", ()).tobytes() == np.ascontiguousarray(k.T).tobytes()


def _flip(path: str, names: tuple[str, ...], at: float) -> None:
    with RangedFile(path) as f:
        off, length, _ = stored_leaves(f)[names].segs[0]
    with open(path, "r+b") as fh:
        fh.seek(off + int(length * at))
        b = fh.read(1)
        fh.seek(off + int(length * at))
        fh.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("saver", ["jax", "torch"])
def test_a_flipped_byte_is_refused_before_anything_is_returned(tmp_path: Any, saver: str) -> None:
    host_w = np.random.default_rng(1).standard_normal((1024, 300)).astype(np.float32)  # > 1 block
    if saver == "jax":
        ej.save(str(tmp_path), 5, {"params": {"w": jax.numpy.asarray(host_w)}})
    else:
        torch = pytest.importorskip("torch")
        with epochal.Checkpointer(str(tmp_path)) as ckpt:
            ckpt.save(5, {"params": {"w": torch.from_numpy(host_w)}})
    _flip(str(tmp_path / "local.5"), ("params", "w"), 0.7)
    a = {"params": {"w": jax.ShapeDtypeStruct((1024, 300), np.float32)}}
    with pytest.raises(CheckpointCorruptError) as e:
        ej.restore(str(tmp_path), a)
    assert "params/w" in str(e.value) and e.value.path.endswith("local.5") and e.value.blob == "params"


def _record(arr: np.ndarray, blocks: bool, tmp_path: Any) -> tuple[str, Stored]:
    path = str(tmp_path / ("b" if blocks else "w") / "local.1")
    if blocks:
        ej.save(os.path.dirname(path), 1, {"x": arr})
    else:  # one checksum for the whole tensor, as PyTorch writes it
        torch = pytest.importorskip("torch")
        with epochal.Checkpointer(os.path.dirname(path)) as ckpt:
            ckpt.save(1, {"x": torch.from_numpy(arr)})
    with RangedFile(path) as f:
        return path, stored_leaves(f)[("x",)]


@pytest.mark.parametrize("blocks", [True, False], ids=["row-blocks", "one-checksum"])
def test_any_set_of_regions_reads_the_same_bytes_as_numpy(tmp_path: Any, blocks: bool, monkeypatch: Any) -> None:
    monkeypatch.setattr(ej.host, "BLOCK_BYTES", 700)  # blocks of a few rows, edges inside regions
    rng = np.random.default_rng(11)
    for case, shape in enumerate([(37, 5, 3), (64,), (9, 40), (1, 7), (50, 1)]):
        arr = rng.standard_normal(shape).astype(np.float32)
        path, s = _record(arr, blocks, tmp_path / str(case))
        indices: list[tuple[Any, ...]] = [()]
        for _ in range(12):
            idx = []
            for n in shape:
                a = int(rng.integers(0, n))
                idx.append(slice(a, int(rng.integers(a, n + 1))))
            indices.append(tuple(idx))
        for chunk in (1, 64, 1 << 20):
            with RangedFile(path) as f:
                got = read_regions(f, s, "x", indices, chunk, run=lambda tasks: [t() for t in reversed(tasks)] and None)
            for index, g in zip(indices, got):
                assert g.shape == arr[index].shape and g.tobytes() == arr[index].tobytes(), (shape, index, chunk)


@pytest.mark.parametrize("blocks", [True, False], ids=["row-blocks", "one-checksum"])
def test_column_slices_of_one_row_range_share_one_read_of_each_byte(tmp_path: Any, blocks: bool,
                                                                     monkeypatch: Any) -> None:
    arr = np.random.default_rng(3).standard_normal((2048, 1024)).astype(np.float32)  # 8 MiB, 2 blocks
    path, s = _record(arr, blocks, tmp_path)
    seen: list[int] = []
    orig = RangedFile.read_into

    def counted(self: Any, view: memoryview, offset: int, blob: Any = None) -> None:
        seen.append(view.nbytes)
        orig(self, view, offset, blob)

    monkeypatch.setattr(RangedFile, "read_into", counted)
    indices = [(slice(r, r + 512), slice(c, c + 256)) for r in range(0, 2048, 512) for c in range(0, 1024, 256)]
    with RangedFile(path) as f:
        got = read_regions(f, s, "x", indices, 1 << 20)
    for index, g in zip(indices, got):
        assert g.tobytes() == arr[index].tobytes()
        assert g.ctypes.data % 64 == 0  # aligned for JAX to adopt
    assert sum(seen) == arr.nbytes and max(seen) <= 1 << 20


@pytest.mark.parametrize("blocks", [True, False], ids=["row-blocks", "one-checksum"])
def test_a_regions_read_needs_at_most_one_chunk_beyond_the_region(tmp_path: Any, blocks: bool) -> None:
    arr = np.random.default_rng(2).standard_normal((2048, 1024)).astype(np.float32)  # 8 MiB
    path, s = _record(arr, blocks, tmp_path)
    assert ("row_crc" in s.meta) is blocks
    chunk = 1 << 20
    for index in [(slice(0, 2048), slice(512, 1024)), (slice(1000, 1500), slice(0, 1024)), ()]:
        with RangedFile(path) as f:
            tracemalloc.start()
            got = read_region(f, s, "x", index, chunk)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert got.tobytes() == arr[index].tobytes()
        # the region itself, plus at most one chunk (not one 4 MiB checksummed block)
        assert peak <= got.nbytes + chunk + (64 << 10), (index, peak, got.nbytes)
