"""The JAX door's sharded saves: each shard written once from its own buffer (never the
array assembled on host), restored onto any mesh and into PyTorch bit for bit; chunked
records that do not cover their array refused; names= through the Orbax handlers.

Saves and restores between meshes run in fresh processes (tests/_jax_bits.py, with 8 CPU
devices)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
jax = pytest.importorskip("jax")

import epochal  # noqa: E402
import epochal.jax as ej  # noqa: E402
from epochal.errors import CheckpointCorruptError  # noqa: E402
from epochal.jax.host import HostChunks  # noqa: E402
from epochal.storage.encoding.chunks import chunk_layout  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def run_bits(*args: str) -> dict[str, Any]:
    """One process of tests/_jax_bits.py; its JSON line."""
    out = subprocess.run([sys.executable, os.path.join(HERE, "_jax_bits.py"), *args], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.system
def test_a_sharded_save_writes_each_shard_from_its_buffer_and_restores_anywhere(tmp_path: Any) -> None:
    # 256 MiB on 8 CPU devices: w split 4 x 2, e by rows (replicated over the other axis),
    # b replicated. The save adds no copy of the pytree on host (the shards are written
    # from the device buffers: the old save assembled each array, +256 MiB); one chunk per
    # shard of replica 0, a replicated array as one tensor
    d = str(tmp_path)
    got = run_bits("stream_save", d)
    assert got["peak_mib"] <= 32, got
    assert got["kinds"] == {"w": "torch.chunked_tensor", "e": "torch.chunked_tensor", "b": "torch.tensor"}
    assert got["chunks"] == {"w": 8, "e": 4, "b": 0}
    assert run_bits("stream_restore", d) == {"restored_on": [8, 4, 2, 1]}
    # PyTorch gets each array whole: into live tensors and as fresh ones
    assert run_bits("stream_torch", d) == {"restored": ["b", "e", "w"], "step": 3}


def _forged(tmp_path: Any, chunks: list[tuple[tuple[int, ...], np.ndarray]]) -> str:
    with epochal.Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, {"p": {"w": HostChunks((4, 6), np.dtype(np.float32), chunks, "p/w")}})
    return str(tmp_path)


@pytest.mark.parametrize("case", ["overlap", "gap"])
def test_chunks_that_do_not_cover_their_array_are_refused_naming_the_leaf(tmp_path: Any, case: str) -> None:
    a = np.arange(12, dtype=np.float32).reshape(2, 6)
    second = (1, 0) if case == "overlap" else (2, 0)
    chunks = [((0, 0), a), (second, a[:1].copy())] if case == "gap" else [((0, 0), a), (second, a)]
    d = _forged(tmp_path, chunks)
    want = {"p": {"w": jax.ShapeDtypeStruct((4, 6), np.float32)}}
    with pytest.raises(CheckpointCorruptError) as e:
        ej.restore(d, want)
    assert "p/w" in str(e.value) and e.value.blob == "p" and e.value.path.endswith("local.1")
    assert ("overlap" if case == "overlap" else "elements") in str(e.value)


def test_chunk_layout_checks_each_chunk_against_the_tensor_and_its_segments() -> None:
    meta = {"shape": [4, 6], "chunks": [{"offsets": [0, 0], "shape": [4, 3], "rows": 3},
                                        {"offsets": [0, 3], "shape": [4, 3], "rows": 4}]}
    shape, chunks = chunk_layout(meta, [36, 12, 48], 4)
    assert shape == (4, 6) and [c.blocks() for c in chunks] == [[(0, 3), (3, 4)], [(0, 4)]]
    assert [(c.first, c.count) for c in chunks] == [(0, 2), (2, 1)]
    for sizes, words in (([36, 12, 48, 8], "need 3 segments, the record has 4"), ([36, 12, 44], "do not fit"), ([48, 48], "do not fit")):
        with pytest.raises(ValueError, match=words):
            chunk_layout(meta, sizes, 4)
    bad = {**meta, "chunks": [{"offsets": [2, 0], "shape": [4, 3], "rows": 1}]}
    with pytest.raises(ValueError, match="does not fit a tensor"):
        chunk_layout(bad, [12] * 4, 4)


@pytest.mark.system
def test_a_torch_state_restores_through_an_orbax_manager_under_a_name_mapping(tmp_path: Any) -> None:
    pytest.importorskip("orbax.checkpoint")
    pytest.importorskip("torch")
    root = str(tmp_path)
    assert run_bits("orbax_torch_save", root) == {"saved": [".epochal", "local.0"]}
    # restored onto 2 devices under the flax <-> torch mapping (the kernel transposed),
    # saved back as step 8 under the torch names; the same through the v1 handler
    got = run_bits("orbax_names", root, "2")
    assert got == {"steps": [7, 8], "stored": ["model/emb.weight", "model/fc.bias", "model/fc.weight", "step"],
                   "jax": 8}
    # and PyTorch reads Orbax's step 8 back with its own names
    assert run_bits("torch_restore_named", os.path.join(root, "8", "default")) == {"restored": 0, "step": 7}


def test_any_regions_of_a_chunked_array_read_the_same_bytes_as_numpy(tmp_path: Any, monkeypatch: Any) -> None:
    # a 3-d array stored as an uneven 3 x 2 grid of chunks, each in row blocks of a few rows;
    # regions at random (spanning chunk and block edges, column slices, whole rows) read
    # into their buffers (straight, or through the scratch) as numpy slices them
    from epochal.jax.host import HostTensor
    from epochal.jax.sources import LocalSource

    monkeypatch.setattr(ej.host, "BLOCK_BYTES", 300)
    rng = np.random.default_rng(5)
    arr = rng.standard_normal((37, 10, 3)).astype(np.float32)
    rows, cols = [0, 5, 20, 37], [0, 4, 10]
    chunks = [((r0, c0, 0), np.ascontiguousarray(arr[r0:r1, c0:c1])) for r0, r1 in zip(rows, rows[1:])
              for c0, c1 in zip(cols, cols[1:])]
    with epochal.Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, {"x": HostChunks(arr.shape, arr.dtype, chunks, "x"), "y": HostTensor(arr[0], "y")})
    indices: list[tuple[Any, ...]] = [(), (slice(0, 37),), (slice(5, 20), slice(4, 10))]
    for _ in range(12):
        idx = []
        for n in arr.shape:
            a = int(rng.integers(0, n))
            idx.append(slice(a, int(rng.integers(a + 1, n + 1))))
        indices.append(tuple(idx))
    src = LocalSource(str(tmp_path / "local.1"))
    try:
        assert src.layout(("x",), "x") == (np.dtype(np.float32), arr.shape)
        for chunk in (1, 64, 1 << 20):
            got = src.regions(("x",), "x", indices, chunk, lambda tasks: [t() for t in reversed(tasks)] and None)
            for index, g in zip(indices, got):
                assert g.shape == arr[index].shape and g.tobytes() == arr[index].tobytes(), (index, chunk)
                assert g.ctypes.data % 64 == 0
    finally:
        src.close()


def test_a_restore_from_a_cold_file_asks_the_kernel_to_read_ahead_along_its_leaves(tmp_path: Any,
                                                                                    monkeypatch: Any) -> None:
    # the page cache is made to answer "not cached" to every RWF_NOWAIT read: the restore
    # then hints (posix_fadvise WILLNEED) the byte ranges of the leaves it reads, ahead of
    # its reads, and nothing else (the plain leaf, the one left out by partial=True)
    from epochal.jax.reads import stored_leaves
    from epochal.storage.formats.native.reads.ranges import RangedFile
    from epochal.storage.io import local

    rng = np.random.default_rng(7)
    vals = {n: rng.standard_normal((1024, 2048)).astype(np.float32) for n in ("a", "b", "c")}  # 8 MiB each
    ej.save(str(tmp_path), 1, {"p": {n: jax.numpy.asarray(v) for n, v in vals.items()}, "lr": 0.5})
    with RangedFile(str(tmp_path / "local.1")) as f:
        s = stored_leaves(f)
        spans = {n: [(o, o + k) for o, k, _ in s[("p", n)].segs] for n in vals}
    hints: list[tuple[int, int]] = []
    orig_read = local.LocalSource.read_into

    def not_cached(self: Any, views: Any, offset: int, *, nowait: bool = False) -> int:
        return 0 if nowait else orig_read(self, views, offset)

    monkeypatch.setattr(local.LocalSource, "read_into", not_cached)
    monkeypatch.setattr(local.LocalSource, "hint", lambda self, o, n: hints.append((o, o + n)) or True)
    want = {"p": {n: jax.ShapeDtypeStruct((1024, 2048), np.float32) for n in ("a", "c")}, "lr": 0.0}
    got = ej.restore(str(tmp_path), want, partial=True)
    for n in ("a", "c"):
        assert np.asarray(got["p"][n]).tobytes() == vals[n].tobytes()
    assert hints

    def covered(lo: int, hi: int) -> bool:
        return all(any(a <= x < b for a, b in hints) for x in range(lo, hi, 4096))

    assert all(covered(lo, hi) for lo, hi in spans["a"] + spans["c"])
    assert not any(a < hi and lo < b for a, b in hints for lo, hi in spans["b"])


def test_a_compressed_sharded_save_restores_on_another_mesh(tmp_path: Any) -> None:
    # the chunks' blocks compressed as float byte planes (zstd): the JAX door reads them
    # decoded and checked, here onto 2 devices split by rows from a 4 x 2 save
    pytest.importorskip("zstandard")
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from epochal.jax.reads import stored_leaves
    from epochal.storage.formats.native.reads.ranges import RangedFile

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    v = np.repeat(np.arange(512, dtype=np.float32), 256).reshape(512, 256) / 7
    m8 = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    with epochal.Checkpointer(str(tmp_path), compression="zstd") as ckpt:
        ej.save(ckpt, 1, {"p": {"w": jax.device_put(v, NamedSharding(m8, P("x", "y")))}})
    with RangedFile(str(tmp_path / "local.1")) as f:
        assert stored_leaves(f)[("p", "w")].kind == "torch.chunked_tensor"
    assert os.path.getsize(tmp_path / "local.1") < v.nbytes // 2  # compressed
    m2 = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("x", "y"))
    got = ej.restore(str(tmp_path), {"p": {"w": jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                                     sharding=NamedSharding(m2, P("x")))}})
    assert np.asarray(got["p"]["w"]).tobytes() == v.tobytes()
