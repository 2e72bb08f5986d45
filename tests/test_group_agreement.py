"""A native 2.0 file whose checksum group disagrees with its segments'
checksums (forged with every other checksum valid) is refused by every load path (full,
many-blob, mmap, single blob of the damaged one) exactly where verify and check refuse it:
a file loads only where it verifies. The agreement is checked from the index alone
(:mod:`epochal.storage.io.checksum`), so a sound file still costs one checksum per group."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal.errors import CheckpointCorruptError
from epochal.storage.formats.native import NativeBackend, NativeFile, write_native
from epochal.storage.io.checksum import checksum_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _forge import NativeParts  # noqa: E402

NATIVE = NativeBackend()


def _blobs() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    out: dict[str, Any] = {f"p{i:03d}": rng.integers(0, 1000, int(rng.integers(1, 2000))).astype("<f4")
                           for i in range(300)}
    out["p150_tag"] = "x" * 100  # a str: its segment is grouped, read by the general path
    return out


def _owners(path: Path) -> list[str]:
    with NativeFile(path) as f:
        recs, names = f._index.recs, f.names()
        return [names[i] for i in range(len(recs)) for _ in range(int(recs["seg_count"][i]))]


def _loads(path: Path, names: list[str] | None) -> list[tuple[str, Any]]:
    """Every load path's answer for ``names``: ("ok", value) or ("refused", blob)."""
    out = []
    for how in ("read", "mmap"):
        try:
            if how == "read":
                got = NATIVE.read(str(path), names)
            else:
                with NativeFile(path, mmap=True) as f:
                    got = {k: (np.array(v) if isinstance(v, np.ndarray) else v) for k, v in f.read(names).items()}
            out.append(("ok", sorted(got)))
        except CheckpointCorruptError as ex:
            out.append(("refused", ex.blob))
    try:
        with NativeFile(path) as f:
            f.verify(names)
        out.append(("ok", sorted(names) if names is not None else None))
    except CheckpointCorruptError as ex:
        out.append(("refused", ex.blob))
    return out


def test_the_combination_of_segment_checksums_is_the_group_checksum(tmp_path: Path) -> None:
    from epochal.storage.io.checksum import combined

    path = tmp_path / "g.db"
    write_native(path, _blobs())
    with NativeFile(path) as f:
        idx = f._index
        fn = checksum_function(idx.header.algorithm, inline=True)
        g, segs = idx.groups, idx.segs
        assert len(g) >= 2
        n = g["seg_count"].astype(np.int64)
        k = np.concatenate([np.arange(a, a + c) for a, c in zip(g["seg_first"].tolist(), n.tolist())])
        want = combined(fn, segs["crc"][k], segs["length"][k], segs["pad"][k], np.repeat(np.arange(len(g)), n), len(g))
        assert want.tolist() == g["crc"].tolist()
        assert idx.disagreeing_groups(list(range(len(idx.recs))), fn) == []


@pytest.mark.parametrize("forge", ["segment crc", "group crc"])
def test_every_load_path_refuses_a_group_that_disagrees_with_its_segments(tmp_path: Path, forge: str) -> None:
    path = tmp_path / "g.db"
    blobs = _blobs()
    write_native(path, blobs)
    owner = _owners(path)
    parts = NativeParts.parse(path.read_bytes())
    # the group holding the str segment: read partly by the batch path, partly by the general one
    tag_k = owner.index("p150_tag")
    gi = next(i for i, g in enumerate(parts.groups)
              if int(g["seg_first"]) <= tag_k < int(g["seg_first"] + g["seg_count"]))
    g = parts.groups[gi]
    first_k = int(g["seg_first"])
    if forge == "segment crc":
        victim_k = first_k + 2
        parts.segs[victim_k]["crc"] ^= 0x40  # the data and the group checksum still agree
        victim = owner[victim_k]
        raw = parts.pack()  # (the group recomputed from the data: unchanged)
    else:
        g["crc"] ^= 0x40
        victim = owner[first_k]
        raw = parts.pack(fix_groups=False)
    path.write_bytes(raw)
    whole = _loads(path, None)
    assert whole == [("refused", victim)] * 3, whole
    problems = NATIVE.check(str(path))
    assert [p.blob for p in problems] == [victim]
    # a many-blob load holding the whole group: refused too
    in_group = owner[first_k : first_k + int(g["seg_count"])]
    many = sorted(set(in_group) | {f"p{i:03d}" for i in range(100)})
    assert _loads(path, many) == [("refused", victim)] * 3
    # a blob of the group alone: it loads where it verifies (its own segment checksum)
    other = next(n for n in in_group if n != victim and n != "p150_tag")
    assert _loads(path, [other]) == [("ok", [other]), ("ok", [other]), ("ok", [other])]
    got = NATIVE.read(str(path), [other])[other]
    assert got.tobytes() == blobs[other].tobytes()
    single = _loads(path, [victim])
    assert single == ([("refused", victim)] * 3 if forge == "segment crc" else [("ok", [victim])] * 3)
    # blobs outside the group load, bit for bit
    outside = [n for n in blobs if n not in set(in_group)]
    got_all = NATIVE.read(str(path), outside)
    assert all(np.asarray(got_all[n]).tobytes() == np.asarray(blobs[n]).tobytes() for n in outside if n != "p150_tag")
