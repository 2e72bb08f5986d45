"""The extent table of an incremental db as read: a version 1 table (raw rows, every extent
with its checksum) still restores bit-exact and still names a damaged older file; a table
that does not hold together (a reference past the end of its file, extents that do not tile
the logical file, an offset before its source's start) is refused at open, naming the file,
before any live byte is written. Tables are forged by rewriting a saved step's, with valid
checksums (and the step's manifest recording the new size), so that only the check at issue
can refuse them."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _fresh import restore_script

import epochal as ep
from epochal.checkpoint.location.manifest import encode_manifest
from epochal.errors import CheckpointCorruptError
from epochal.storage.io.checksum import checksum_function
from epochal.storage.io.extents import (
    EXT_DTYPE,
    HEAD,
    HEAD_SIZE,
    open_db,
    pack_extents,
    read_extents,
)
from epochal.storage.io.seam import store_for

ROWS, DIM, STEPS = 4096, 256, 4  # a 4 MiB float32 table of 1 KiB rows


def _table(step: int) -> np.ndarray:
    emb = np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)
    for s in range(1, step + 1):  # 2% of the rows change at each step
        emb[np.random.default_rng(s).choice(ROWS, ROWS // 50, replace=False)] += np.float32(s)
    return emb


def _saved(d: Path) -> Path:
    """``STEPS`` incremental steps saved in ``d``; the last one's db."""
    with ep.Checkpointer(str(d), incremental=True, progress=False) as ck:
        for s in range(1, STEPS + 1):
            ck.save(s, {"emb": _table(s)})
    return d / f"local.{STEPS}"


def _rewrite(path: Path, ext: np.ndarray, version: int = 2) -> None:
    """Write ``path``'s extent table anew as ``ext`` (EXT_DTYPE rows) in ``version``'s
    encoding, its head and table checksums made to match."""
    data = path.read_bytes()
    src = store_for(str(path)).open_read(str(path), what="db")
    try:
        ex = read_extents(src, str(path))
    finally:
        src.close()
    (magic, _, algo, _, lsize, toff, _, nchunk, nrefs, step, packed, _, _) = HEAD.unpack(data[:HEAD_SIZE])
    rest = data[toff + packed:]  # the chunk table and the refs text, as they were
    assert len(rest) == nchunk * 32 + nrefs
    table = pack_extents(ext) if version == 2 else np.ascontiguousarray(ext, dtype=EXT_DTYPE).tobytes()
    tables = table + rest
    fn = checksum_function(ex.algorithm)
    body = HEAD.pack(magic, version, algo, 0, lsize, toff, len(ext), nchunk, nrefs, step,
                     len(table) if version == 2 else 0, fn(tables, 0), 0)
    path.write_bytes(body[: HEAD_SIZE - 4] + fn(body[: HEAD_SIZE - 4], 0).to_bytes(4, "little") + data[HEAD_SIZE:toff] + tables)
    man = path.parent / ".epochal" / f"manifest.{step}.json"  # the file's recorded size follows it
    m = json.loads(man.read_bytes())
    m["nodes"]["local"]["size"] = path.stat().st_size
    man.write_bytes(encode_manifest(m))


def _rows(path: Path) -> tuple[np.ndarray, list[str], str]:
    src = open_db(str(path))
    try:
        return src.ex.ext.copy(), [r.file for r in src.ex.refs], src.ex.algorithm  # type: ignore[attr-defined]
    finally:
        src.close()


RESTORE = textwrap.dedent("""
    import json, sys, numpy as np, epochal as ep
    st = {"emb": np.zeros((ROWS, DIM), np.float32)}
    try:
        with ep.Checkpointer(sys.argv[1], progress=False) as ck:
            step = ck.restore(st, step=int(sys.argv[2]))
    except ep.CheckpointCorruptError as e:
        print(json.dumps({"error": str(e), "untouched": bool(not st["emb"].any())}))
        sys.exit(3)
    np.save(sys.argv[3], st["emb"])
    print(json.dumps({"step": step}))
""").replace("ROWS", str(ROWS)).replace("DIM", str(DIM))


def _restore_fresh(d: Path, step: int, tmp: Path) -> tuple[int, dict[str, Any], np.ndarray | None]:
    return restore_script(RESTORE, tmp, d, step)


@pytest.mark.system
def test_a_version_1_table_still_restores_bit_exact_and_names_a_damaged_older_file(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    last = _saved(d)
    ext, refs, algorithm = _rows(last)
    assert len(refs) == STEPS - 1 and len(ext) > 200
    fn = checksum_function(algorithm)
    for i in np.flatnonzero(ext["source"] > 0).tolist():  # version 1: a reference carries its checksum
        with open(d / refs[int(ext["source"][i]) - 1], "rb") as f:
            f.seek(int(ext["soff"][i]))
            ext["crc"][i] = fn(f.read(int(ext["length"][i])), 0)
    _rewrite(last, ext, version=1)
    assert last.read_bytes()[8:10] == (1).to_bytes(2, "little")
    src = open_db(str(last))
    try:
        assert src.ex.version == 1  # type: ignore[attr-defined]
    finally:
        src.close()
    rc, info, got = _restore_fresh(d, STEPS, tmp_path)
    assert rc == 0 and info["step"] == STEPS, info
    assert got is not None and got.view(np.uint32).tobytes() == _table(STEPS).view(np.uint32).tobytes()
    # a byte of step 2's stored rows that the last step takes: the error names step 2's file
    k = int(np.flatnonzero(ext["source"] == refs.index("local.2") + 1)[0])
    with open(d / "local.2", "r+b") as f:
        f.seek(int(ext["soff"][k]) + 3)
        b = f.read(1)
        f.seek(int(ext["soff"][k]) + 3)
        f.write(bytes([b[0] ^ 0x10]))
    rc, info, _ = _restore_fresh(d, STEPS, tmp_path)
    assert rc == 3 and info["untouched"], info
    assert "local.2" in info["error"] and "step 2" in info["error"] and "damaged" in info["error"], info


@pytest.mark.system
def test_a_reference_past_the_end_of_its_file_is_named_before_any_live_byte(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    last = _saved(d)
    ext, refs, _ = _rows(last)
    k = int(np.flatnonzero(ext["source"] == refs.index("local.3") + 1)[-1])
    ext["soff"][k] = (d / "local.3").stat().st_size - int(ext["length"][k]) + 1  # one byte past its end
    _rewrite(last, ext)
    rc, info, _ = _restore_fresh(d, STEPS, tmp_path)
    assert rc == 3 and info["untouched"], info
    assert "past the end of local.3" in info["error"] and f"local.{STEPS}" in info["error"], info


@pytest.mark.unit
@pytest.mark.parametrize("forgery", ["gap", "zero_length", "before_start", "huge_offset", "unknown_source"])
def test_a_table_that_does_not_hold_together_is_refused_naming_the_file(tmp_path: Path, forgery: str) -> None:
    d = tmp_path / "ck"
    last = _saved(d)
    ext, refs, _ = _rows(last)
    k = int(np.flatnonzero(ext["source"] > 0)[len(refs)])  # a reference inside the table
    want = "do not tile"
    if forgery == "gap":  # a length one byte short: the extents no longer end at the logical size
        ext["length"][k] -= 1
    elif forgery == "zero_length":  # (the offsets after it shift: either check may refuse it)
        ext["length"][k + 1] += ext["length"][k]
        ext["length"][k] = 0
        want = "do not tile|before the start"
    elif forgery == "before_start":  # (version 2 stores the offset less the logical one)
        ext["soff"][k] = np.uint64((1 << 64) - 1)  # -1
        want = "before the start"
    elif forgery == "huge_offset":  # near 2**63: its end wraps below the file's size in int64
        ext["soff"][k] = np.uint64((1 << 63) - 8)
        want = f"past the end of {refs[int(ext['source'][k]) - 1]}"
    else:
        ext["source"][k] = len(refs) + 1
    _rewrite(last, ext)
    with pytest.raises(CheckpointCorruptError) as e:
        open_db(str(last)).close()
    assert str(last) in str(e.value) and any(w in str(e.value) for w in want.split("|")), str(e.value)
