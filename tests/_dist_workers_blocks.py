"""Rank functions of tests/test_dcp_blocks.py (spawned by run_ranks): a multi-MiB parameter
saved by 2 ranks as row blocks, loaded by 4 (dim 0) or resharded on dim 1, each rank
counting the bytes it reads."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

ROWS, COLS = 3000, 1000  # 12 MB of float32: each of 2 ranks' chunks is 6 MB, stored as blocks
#: the block size the tests write with (about 0.5 MiB: 132 rows of 4000 bytes, so that the
#: 750-row shards of a 4-rank load start and end inside blocks)
BLOCK_BYTES = 512 << 10
SENTINEL = 7.0


def big_full() -> torch.Tensor:
    """The same parameter in every process (seeded)."""
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(7))


def _state(mesh: Any, fill: float | None, dim: int = 0) -> dict[str, Any]:
    """``w`` sharded on ``dim``, ``small`` on dim 0, a plain value (all ``fill`` if given)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    full = big_full()
    small = torch.arange(12, dtype=torch.float64)
    if fill is not None:
        full, small = torch.full_like(full, fill), torch.full_like(small, fill)
    return {"w": distribute_tensor(full, mesh, [Shard(dim)]), "small": distribute_tensor(small, mesh, [Shard(0)]),
            "step": 3}


def blocks_save(rank: int, world: int, path: str) -> None:
    """Save the state sharded on dim 0 over ``world`` ranks, blocks of BLOCK_BYTES."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from epochal.integrations.dcp import EpochalStorageWriter, blocks

    blocks.BLOCK_BYTES = BLOCK_BYTES
    mesh = init_device_mesh("cpu", (world,))
    dcp.save(_state(mesh, None), storage_writer=EpochalStorageWriter(path, step=0))


def _count_reads(mapped: list[str]) -> list[tuple[str, str, int]]:
    """Patch NativeFile.read, .verify and .views to record every blob they are asked for:
    (file, blob, data bytes), repeats included; the blobs views verified on a map (and so
    returned) go to ``mapped`` too."""
    from epochal.storage.formats.native.reader import NativeFile

    seen: list[tuple[str, str, int]] = []
    read, verify, views = NativeFile.read, NativeFile.verify, NativeFile.views

    def counted_views(self: NativeFile, names: Any) -> Any:
        got = views(self, names)
        if got is not None:
            for n in names:
                seen.append((os.path.basename(self.path), n, self.info(n).nbytes))
            mapped.extend(got.views)
        return got

    def counted_read(self: NativeFile, names: Any = None, **kw: Any) -> Any:
        for n in names if names is not None else self.names():
            seen.append((os.path.basename(self.path), n, self.info(n).nbytes))
        return read(self, names, **kw)

    def counted_verify(self: NativeFile, names: Any = None) -> None:
        for n in names if names is not None else self.names():
            seen.append((os.path.basename(self.path), n, self.info(n).nbytes))
        verify(self, names)

    NativeFile.read = counted_read  # type: ignore[method-assign]
    NativeFile.verify = counted_verify  # type: ignore[method-assign]
    NativeFile.views = counted_views  # type: ignore[method-assign]
    return seen


def blocks_load(rank: int, world: int, path: str, out: str, dim: int = 0, cached: bool | None = None) -> None:
    """Load into ``world`` ranks' shards of ``w`` on ``dim`` (live tensors filled with
    SENTINEL first), unpickling forbidden; write what was read, the blobs verified on a map
    (``mapped``) and the error, if any, to ``out/rank<r>.json``. ``cached``: the files are
    taken for cached (True) or not (False) whatever the page cache holds (None: as it is).
    A rank whose load succeeded checks its shard bit-equal to the full state's rows (dim 0)
    or columns (dim 1); one whose own read failed checks its shard still all SENTINEL
    (nothing half restored)."""
    import torch.distributed.checkpoint as dcp
    from _dist_workers import forbid_pickle
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh

    from epochal.errors import CheckpointCorruptError
    from epochal.integrations.dcp import EpochalStorageReader
    from epochal.storage.io import direct

    if cached is not None:
        direct.looks_cached = lambda *a, **k: cached  # type: ignore[assignment]
    mesh = init_device_mesh("cpu", (world,))
    sd = _state(mesh, SENTINEL, dim)
    mapped: list[str] = []
    seen = _count_reads(mapped)
    forbid_pickle()
    result: dict[str, Any] = {"reads": seen, "mapped": mapped, "error": None}
    try:
        dcp.load(sd, storage_reader=EpochalStorageReader(path))
    except CheckpointException as ex:
        mine = ex.failures.get(rank)
        if mine is not None:
            err = mine[0] if isinstance(mine, tuple) else mine
            assert isinstance(err, CheckpointCorruptError), repr(err)
            result["error"] = {"path": os.path.basename(err.path), "blob": err.blob, "text": str(err)}
            assert bool((sd["w"].to_local() == SENTINEL).all()), "a failed read changed the live shard"
            assert bool((sd["small"].to_local() == SENTINEL).all())
        else:
            result["error"] = {"other": True}
    else:
        local = sd["w"].to_local()
        want = big_full().chunk(world, dim)[rank]
        assert local.shape == want.shape
        assert torch.equal(local.view(torch.int32), want.contiguous().view(torch.int32))
        s = sd["small"].to_local()
        assert torch.equal(s, torch.arange(12, dtype=torch.float64).chunk(world)[rank])
        assert sd["step"] == 3
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
