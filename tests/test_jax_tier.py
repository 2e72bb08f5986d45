"""A pytree through a Checkpointer with a local tier (docs/tiers.md): ``epochal.jax.save``
puts every step in the local directory and every K-th in the store; ``epochal.jax.restore``
takes the newest step either place holds intact, the local copy first, a damaged local copy
named in a warning and the store's used instead; ``last_restore`` says which. Each restore
runs in a fresh process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import epochal  # noqa: E402
import epochal.jax as ej  # noqa: E402

pytestmark = pytest.mark.system

READ = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
import epochal, epochal.jax as ej
step = None if sys.argv[3] == "-" else int(sys.argv[3])
with epochal.Checkpointer(sys.argv[1], local=sys.argv[2], persist_every=2) as ck:
    got = ej.restore(ck, {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32), "step": 0}, step=step)
    print(json.dumps({"step": got["step"], "source": ck.last_restore.source,
                      "w": np.asarray(got["w"]).tolist()}))
"""


def w_at(step: int) -> np.ndarray:
    return np.arange(128, dtype=np.float32).reshape(16, 8) * step


def restored(tmp_path: Path, step: int | None = None) -> tuple[dict[str, Any], str]:
    script = tmp_path / "read.py"
    script.write_text(READ)
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "store"), str(tmp_path / "local"),
                        "-" if step is None else str(step)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert np.array_equal(np.asarray(got["w"], dtype=np.float32), w_at(got["step"]))
    return got, p.stderr


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    with epochal.Checkpointer(tmp_path / "store", local=tmp_path / "local", persist_every=2, local_keep=2) as ck:
        for step in (1, 2, 3):
            ej.save(ck, step, {"w": jnp.asarray(w_at(step)), "step": step})
    assert epochal.CheckpointDirectory(str(tmp_path / "local")).committed_epochs() == [2, 3]
    assert epochal.CheckpointDirectory(str(tmp_path / "store")).committed_epochs() == [2, 3]  # (3: at close)
    return tmp_path


def test_the_local_copy_is_restored_first(saved: Path) -> None:
    got, _ = restored(saved)
    assert (got["step"], got["source"]) == (3, "local")
    got, _ = restored(saved, step=2)
    assert (got["step"], got["source"]) == (2, "local")


def test_a_damaged_local_copy_is_named_and_the_stores_used(saved: Path) -> None:
    db = saved / "local" / "local.3"
    data = bytearray(db.read_bytes())
    data[len(data) // 3] ^= 0x40
    db.write_bytes(bytes(data))
    got, err = restored(saved)
    assert (got["step"], got["source"]) == (3, "durable")
    assert "local copy of step 3" in err and "damaged" in err, err[-2000:]


def test_an_empty_local_directory_restores_from_the_store(saved: Path) -> None:
    shutil.rmtree(saved / "local")
    got, _ = restored(saved)
    assert (got["step"], got["source"]) == (3, "durable")
