"""Incremental saves at a URL (moto's S3 server on 127.0.0.1): a reference costs no upload
(bytes PUT counted at the request seam, and the objects' sizes), a fresh process restores
and ``epochal verify`` checks a step through its references, and retention at the URL keeps
an older step's object while a kept step takes bytes from it."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("s3fs", reason="the s3 extra is not installed")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from _requests import count_requests  # noqa: E402
from test_incremental import DIM, ROWS, _flat, _state  # noqa: E402

import epochal as ep  # noqa: E402
from epochal.checkpoint.location.naming import without_token  # noqa: E402
from epochal.storage.io.remote.fsspec_store import filesystem_for  # noqa: E402

pytestmark = pytest.mark.system

CHANGED = (ROWS // 50) * DIM * 4 + 64 * 64 * 4  # the table's changed rows + the adapter, per step

RESTORE = textwrap.dedent("""
    import sys, json, numpy as np, epochal as ep
    url, opts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    st = {"base": np.zeros(4 << 20, np.float32), "emb": np.zeros((ROWS, DIM), np.float32),
          "adapter": np.zeros((64, 64), np.float32), "step": -1}
    with ep.Checkpointer(url, storage_options=opts, progress=False) as ck:
        got = ck.restore(st)
    np.save(out, np.concatenate([st["base"], st["emb"].ravel(), st["adapter"].ravel()]))
    print(json.dumps({"step": got, "saved_step": st["step"]}))
""").replace("ROWS", str(ROWS)).replace("DIM", str(DIM))


def _sizes(url: str) -> dict[str, int]:
    fs, root = filesystem_for(url)
    fs.invalidate_cache()
    return {k[len(root) + 1:]: int(v["size"]) for k, v in fs.find(root, detail=True).items()}


def _logical(key: str) -> str:
    """A db's key without the writer token each save at a URL adds to its name."""
    return without_token(key)


def _put_bytes(n: Any) -> int:
    """Bytes sent in PUT-like requests (put_object, upload_part) seen by the counter."""
    return int(sum(n.bytes_by_method.get(m, 0) for m in ("put_object", "upload_part")))


def test_a_reference_costs_no_upload_and_a_fresh_process_restores_and_verifies_it(
        tmp_path: Path, s3: dict[str, Any]) -> None:
    url = f"s3://ckpts/incr-{secrets.token_hex(4)}/run"
    puts = []
    with ep.Checkpointer(url, storage_options=s3, incremental=True, keep_last=1, progress=False) as ck:
        for s in (1, 2, 3):
            with count_requests() as n:
                ck.save(s, _state(s))
            puts.append(_put_bytes(n))
    sizes = {_logical(k): v for k, v in _sizes(url).items()}  # (each db's name without its token)
    full = sizes["local.1"]
    assert full >= (16 << 20) + (8 << 20) and puts[0] >= full
    for s in (2, 3):
        # the frozen base and the unchanged rows are references: neither stored nor sent
        assert sizes[f"local.{s}"] <= 1.5 * CHANGED + 65536, (s, sizes)
        assert puts[s - 1] <= sizes[f"local.{s}"] + (1 << 20), (s, puts)  # the db + small records
    # keep_last=1: only step 3 is committed, but step 1's object (the frozen base) and step 2's
    # (the rows changed at step 2) stay: step 3 takes bytes from both
    fs, root = filesystem_for(url)
    manifests = sorted(k for k in sizes if k.startswith(".epochal/manifest."))
    assert manifests == [".epochal/manifest.3.json"], manifests
    assert "local.1" in sizes and "local.2" in sizes
    script = tmp_path / "restore.py"
    script.write_text(RESTORE)
    out = tmp_path / "r.npy"
    p = subprocess.run([sys.executable, str(script), url, json.dumps(s3), str(out)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"step": 3, "saved_step": 3}
    assert np.load(out).view(np.uint32).tobytes() == _flat(_state(3)).view(np.uint32).tobytes()
    o = [a for k, v in s3.items() if isinstance(v, str) for a in ("-o", f"{k}={v}")]
    v = subprocess.run([sys.executable, "-m", "epochal", "verify", f"{url}/local.3", *o, "--json"],
                       capture_output=True, text=True, timeout=120)
    assert v.returncode == 0 and json.loads(v.stdout)["ok"] is True, v.stdout + v.stderr
    # a byte of step 1's object (the frozen base step 3 references) damaged: verify of step 3
    # fails naming step 1's object
    step1 = [k for k in _sizes(url) if _logical(k) == "local.1"][0]
    body = bytearray(fs.cat_file(f"{root}/{step1}"))
    body[64 + (8 << 20)] ^= 0x40
    fs.pipe_file(f"{root}/{step1}", bytes(body))
    v = subprocess.run([sys.executable, "-m", "epochal", "verify", f"{url}/local.3", *o, "--json"],
                       capture_output=True, text=True, timeout=120)
    assert v.returncode != 0 and "local.1" in v.stdout + v.stderr, v.stdout + v.stderr
