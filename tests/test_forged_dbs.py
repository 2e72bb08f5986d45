"""Db files crafted on purpose (valid checksums, absurd content) and special files given as a
db: every load path raises a documented error naming the file (and blob), never hangs,
allocates a huge array or returns a value that another load path would not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from epochal.errors import CheckpointCorruptError, CheckpointError, MissingBlobError
from epochal.storage.formats.base import get_db_type
from epochal.storage.formats.native import open_native

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _forge import NativeParts, st_blobs_crc, st_pack, st_parts  # noqa: E402

NATIVE = get_db_type("native")
ST = get_db_type("safetensors")
BLOBS = {"a": np.arange(4, dtype=np.float32), "b": np.arange(3, dtype=np.int64), "c": np.ones(2, np.int16)}


def every_path(path: str, describe: bool = True) -> list[BaseException | None]:
    """What each load path makes of ``path``: the error raised, or None."""
    out: list[BaseException | None] = []
    calls = [
        lambda: NATIVE.read(path), lambda: NATIVE.read(path, ["a"]),
        *([lambda: NATIVE.describe(path)] if describe else []),
        lambda: NATIVE.verify(path), lambda: open_native(path).read(),
        lambda: NATIVE.read(path, list(BLOBS) * 30),  # more than 64 names: the batch path
    ]
    for call in calls:
        try:
            call()
            out.append(None)
        except Exception as e:  # noqa: BLE001 - the test checks the type below
            out.append(e)
    return out


def assert_refused(path: str, match: str, blob: str | None = None, *, describe: bool = True) -> None:
    """Every load path (and ``describe`` unless False: it only shows the index) refuses."""
    got = every_path(path, describe)
    errs = [e for e in got if e is not None]
    assert len(errs) == len(got), got
    for e in errs:
        assert isinstance(e, CheckpointCorruptError), repr(e)
        assert e.path == path and match in str(e), str(e)
        if blob is not None:
            assert e.blob == blob
    assert NATIVE.check(path), "check() must report the forgery"


@pytest.fixture
def parts(tmp_path: Path) -> tuple[Path, NativeParts]:
    p = tmp_path / "base"
    NATIVE.write(str(p), BLOBS)
    return tmp_path / "forged", NativeParts.parse(p.read_bytes())


def test_meta_table_pointing_at_another_entry(parts):
    out, P = parts
    P.moffs[0] = P.moffs[1].copy()  # blob a's meta table entry is blob b's text
    out.write_bytes(P.pack())
    assert_refused(str(out), "meta table does not tile")


@pytest.mark.parametrize("dtype", ["S0", {"descr": []}])
def test_zero_itemsize_dtype_with_a_huge_shape(parts, dtype):
    out, P = parts
    ents = json.loads(P.metas)
    ents[0] = ["ndarray", {"dtype": dtype, "shape": [1 << 33]}]
    P.set_metas(ents)
    # blob a's segment becomes empty; the others move up by its 64 bytes
    P.data = P.data[64:]
    P.segs["length"][0] = P.segs["pad"][0] = P.segs["crc"][0] = 0
    P.segs["offset"][1:] -= 64
    P.data_bytes -= 16
    out.write_bytes(P.pack())
    tracemalloc.start()
    try:
        assert_refused(str(out), "zero-byte dtype", "a", describe=False)
        assert tracemalloc.get_traced_memory()[1] < 10 << 20
    finally:
        tracemalloc.stop()


def test_segment_lengths_that_tile_only_modulo_2_64(parts):
    out, P = parts
    ioff = 64 + len(P.data)
    P.segs["pad"] = 0
    P.segs["offset"] = [64, 2**63, 2**64 - 64]
    P.segs["length"] = [2**63 - 64, 2**63 - 64, ioff + 64]
    P.data_bytes = ioff - 64  # the sum, modulo 2**64
    out.write_bytes(P.pack())
    assert_refused(str(out), "does not tile the data area")


def test_duplicate_blob_names(parts):
    out, P = parts
    P.names = P.names.replace(b"b", b"a")  # names heap "aac": blobs a, a, c
    out.write_bytes(P.pack())
    assert_refused(str(out), "blob name stored twice: 'a'")


@pytest.mark.parametrize("kind", ["arrays", "scalars"])
def test_duplicate_names_in_a_bulk_full_load(tmp_path, kind):
    """A full load of more than 64 blobs decodes the names on the bulk paths (the batch
    path's worker for arrays; allocate() when no blob has data): a name stored twice is
    still refused, before any value is returned or any live object is touched."""
    blobs = {f"n{i:03d}": (np.full(3, i, np.float32) if kind == "arrays" else i) for i in range(100)}
    base = tmp_path / "base"
    NATIVE.write(str(base), blobs)
    P = NativeParts.parse(base.read_bytes())
    P.names = P.names.replace(b"n001", b"n000")  # blobs n000, n000, n002, ...
    out = tmp_path / "forged"
    out.write_bytes(P.pack())
    for call in (lambda: NATIVE.read(str(out)), lambda: NATIVE.read(str(out), existing={"n000": None})):
        with pytest.raises(CheckpointCorruptError, match="blob name stored twice: 'n000'") as ei:
            call()
        assert ei.value.path == str(out)


def test_unsorted_name_order(parts):
    out, P = parts
    P.order = P.order[::-1].copy()
    out.write_bytes(P.pack())
    with pytest.raises(MissingBlobError):  # bisection of a forged order: not found
        NATIVE.read(str(out), ["a"])
    for call in (NATIVE.read, NATIVE.verify, NATIVE.describe, lambda p: open_native(p).read()):
        with pytest.raises(CheckpointCorruptError, match="not sorted"):
            call(str(out))


def test_name_order_that_is_no_permutation(parts):
    out, P = parts
    P.order[:] = 0
    out.write_bytes(P.pack())
    assert_refused(str(out), "not a permutation")


def test_duplicate_json_keys(parts):
    out, P = parts
    ents = P.metas.decode()
    # blob a's meta says int64 first, then float32 (json would keep the last)
    forged = ents.replace('{"dtype":"<f4"', '{"dtype":"<i8","dtype":"<f4"', 1)
    P.set_metas(json.loads(forged.replace('"dtype":"<i8",', "", 1)))  # table for the real text
    grow = len('"dtype":"<i8",')
    P.metas = forged.encode()
    P.moffs["len"][0] += grow
    P.moffs["off"][1:] += grow
    out.write_bytes(P.pack())
    assert_refused(str(out), "duplicate key 'dtype'")


def test_a_64_mb_json_meta_is_refused_without_parsing_it(parts):
    out, P = parts
    ents = json.loads(P.metas)
    ents[0] = ["ndarray", {"dtype": "<f4", "shape": [4], "x": [[]] * (21 << 20)}]
    P.set_metas(ents)
    raw = P.pack()
    assert len(raw) > 60 << 20
    out.write_bytes(raw)
    del raw, ents
    tracemalloc.start()
    try:
        for call in (lambda: NATIVE.read(str(out)), lambda: NATIVE.read(str(out), ["a"])):
            with pytest.raises(CheckpointCorruptError, match="MiB to parse"):
                call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * out.stat().st_size, peak


def test_zero_itemsize_arrays_are_refused_at_save(tmp_path):
    from epochal.errors import UnsupportedBlobError

    for t in ("native", "safetensors"):
        with pytest.raises(UnsupportedBlobError, match="zero-byte dtype"):
            get_db_type(t).write(str(tmp_path / t), {"z": np.zeros(3, dtype=[])})
        get_db_type(t).write(str(tmp_path / t), {"z": np.zeros(0, dtype=[])})  # empty: fine
        assert get_db_type(t).read(str(tmp_path / t))["z"].shape == (0,)


# ---------------------------------------------------------------- safetensors
@pytest.fixture
def st_file(tmp_path: Path) -> Path:
    p = tmp_path / "db.st"
    ST.write(str(p), {"w": np.arange(6, dtype=np.float32), "s": "hello", "n": 7,
                      "big": np.arange(2000, dtype=">i4")})
    return p


def test_a_flip_in_the_epochal_blobs_key_is_still_an_epochal_file(st_file):
    raw = bytearray(st_file.read_bytes())
    at = raw.index(b'"epochal.blobs"') + 9
    for bit in range(8):
        b = bytearray(raw)
        b[at] ^= 1 << bit
        st_file.write_bytes(bytes(b))
        with pytest.raises(CheckpointCorruptError, match="epochal metadata damaged|not valid JSON") as ei:
            ST.read(str(st_file))
        assert ei.value.path == str(st_file)
        assert ST.check(str(st_file))
        proc = subprocess.run([sys.executable, "-m", "epochal", "verify", str(st_file)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "intact" not in proc.stdout.lower().replace("not intact", "")


def test_every_header_bit_flip_is_detected(st_file):
    raw = st_file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    rng = np.random.default_rng(13)
    for bit in rng.choice((8 + n) * 8, 400, replace=False).tolist():
        b = bytearray(raw)
        b[bit // 8] ^= 1 << (bit % 8)
        st_file.write_bytes(bytes(b))
        with pytest.raises(CheckpointError):
            ST.read(str(st_file))


FORGED_RECORDS = [
    ("not a list", lambda recs: {"x": 1}),
    ("record of another shape", lambda recs: [*recs[:-1], ["name"]]),
    ("name not a str", lambda recs: [{**recs[0], "name": 5}, *recs[1:]]),
    ("extra key", lambda recs: [{**recs[0], "unsupported": "BF16"}, *recs[1:]]),
    ("segment without crc", lambda recs: [{**recs[0], "segs": [{"tensor": "w"}]}, *recs[1:]]),
    ("crc not hex", lambda recs: [{**recs[0], "segs": [{"tensor": "w", "crc": "zzzzzzzz"}]}, *recs[1:]]),
    ("segment a list", lambda recs: [{**recs[0], "segs": [[1, 2]]}, *recs[1:]]),
    ("b64 not a str", lambda recs: [*recs[:1], {**recs[1], "segs": [{"b64": 12, "crc": "00000000"}]}, *recs[2:]]),
    ("b64 of another length", lambda recs: [*recs[:1], {**recs[1], "segs": [{"b64": "aGVsbG8hIQ==", "crc": "00000000"}]}, *recs[2:]]),
    ("duplicate names", lambda recs: [recs[0], {**recs[1], "name": "w"}, *recs[2:]]),
    ("tensor used twice", lambda recs: [recs[0], recs[1], recs[2], {**recs[3], "segs": recs[0]["segs"]}]),
    ("tensor of another dtype", lambda recs: [{**recs[0], "meta": {"dtype": "<i4", "shape": [6]}}, *recs[1:]]),
    ("tensor of another shape", lambda recs: [{**recs[0], "meta": {"dtype": "<f4", "shape": [2, 3]}}, *recs[1:]]),
    ("huge shape", lambda recs: [recs[0], recs[1], recs[2], {**recs[3], "meta": {"dtype": ">i4", "shape": [2**40]}}]),
    ("S0 huge shape", lambda recs: [recs[0], recs[1], recs[2], {**recs[3], "meta": {"dtype": "S0", "shape": [2**40]}}]),
    ("kind unknown", lambda recs: [recs[0], recs[1], recs[2], {**recs[3], "kind": "pickle"}]),
    ("meta not a dict", lambda recs: [{**recs[0], "meta": [1]}, *recs[1:]]),
]


@pytest.mark.parametrize("label,forge", FORGED_RECORDS, ids=[f[0] for f in FORGED_RECORDS])
def test_forged_blob_lists_are_corrupt_errors(st_file, label, forge):
    header, data = st_parts(st_file.read_bytes())
    recs = json.loads(header["__metadata__"]["epochal.blobs"])
    header["__metadata__"]["epochal.blobs"] = json.dumps(forge(recs))
    st_blobs_crc(header)
    st_file.write_bytes(st_pack(header, data))
    for call in (lambda: ST.read(str(st_file)), lambda: ST.verify(str(st_file))):
        with pytest.raises(CheckpointCorruptError) as ei:
            call()
        assert ei.value.path == str(st_file)
    assert ST.check(str(st_file))


def test_duplicate_keys_in_a_safetensors_header(st_file):
    header, data = st_parts(st_file.read_bytes())
    text = json.dumps(header, separators=(",", ":"))
    forged = text.replace('{"__metadata__":', '{"w":{"dtype":"I32","shape":[6],"data_offsets":[0,24]},"__metadata__":', 1)
    st_file.write_bytes(st_pack(header, data, forged.encode()))
    with pytest.raises(CheckpointCorruptError, match="duplicate key 'w'"):
        ST.read(str(st_file))


# ---------------------------------------------------------------- special files
def special_files(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "fifo.0"
    os.mkfifo(fifo)
    d = tmp_path / "adir.0"
    d.mkdir()
    loop = tmp_path / "loop.0"
    os.symlink(tmp_path / "loop.1", loop)
    os.symlink(loop, tmp_path / "loop.1")
    return {"fifo": fifo, "directory": d, "loop": loop}


def test_special_files_are_refused_naming_them(tmp_path):
    files = special_files(tmp_path)
    code = (
        "import sys\nfrom epochal.storage.formats.base import get_db_type\nfrom epochal.errors import CheckpointError\n"
        "for t in ('native', 'safetensors'):\n"
        "    b = get_db_type(t)\n"
        "    for call in (b.read, b.describe, b.verify, b.stat, b.digest):\n"
        "        try:\n            call(sys.argv[1])\n        except CheckpointError as e:\n"
        "            assert sys.argv[1] in str(e), str(e); print('ok', type(e).__name__)\n"
        "    assert not b.exists(sys.argv[1])\n"
    )
    for kind, f in files.items():
        proc = subprocess.run([sys.executable, "-c", code, str(f)], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, (kind, proc.stderr)
        assert proc.stdout.count("ok") == 10, (kind, proc.stdout)


@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_cli_on_special_files_exits_1_naming_them(tmp_path, cmd):
    files = special_files(tmp_path)
    for kind in ("fifo", "directory") if cmd == "inspect" else ("fifo",):  # verify DIR: a prefix
        f = files[kind]
        proc = subprocess.run([sys.executable, "-m", "epochal", cmd, str(f)], capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 1, (kind, proc.stdout, proc.stderr)
        assert str(f) in proc.stderr and "internal error" not in proc.stderr, proc.stderr


def test_a_none_blob_among_many_small_arrays(tmp_path):
    """The batch path (more than 64 small arrays) with a blob whose value is None (crashed
    with KeyError before: found by bench/fuzz.py)."""
    blobs: dict = {f"a{i:02d}": np.full(3, i, dtype=np.float32) for i in range(70)}
    blobs["none"] = None
    blobs["z"] = 5
    p = str(tmp_path / "db")
    NATIVE.write(p, blobs)
    got = NATIVE.read(p)
    assert list(got) == list(blobs) and got["none"] is None and got["z"] == 5
    assert all(np.array_equal(got[k], blobs[k]) for k in blobs if k.startswith("a"))
