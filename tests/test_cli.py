"""The ``epochal`` command line, run as a subprocess on real checkpoints made here.

One module-scoped job (two nodes, epochs 0..3, DirectoryMetadataHandler, a pin, one stray
uncommitted db) and a damaged copy of it serve every test; each test runs a few commands.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal import (
    Cluster,
    DirectoryMetadataHandler,
    Job,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    Task,
    epoch_limiter,
    get_db_type,
)

NODES = ("trainer_0", "trainer_1")
EPOCHS = 3


class _Init:
    def __call__(self, ws: Any) -> None:
        ws["w"] = np.arange(12, dtype=np.float32).reshape(4, 3)
        ws["b"] = np.zeros(3, dtype=np.float64)
        ws["flags"] = np.array([True, False, True])
        ws["step"] = 0
        ws["name"] = "cli-test"
        ws["state"] = {"m": np.ones((2, 2), dtype=np.float32), "count": 1, "betas": (0.9, 0.99)}


class _Train:
    def __call__(self, ws: Any) -> None:
        ws["w"] = ws["w"] + np.float32(0.25)
        ws["step"] = ws["step"] + 1
        state = dict(ws["state"])
        state["m"] = state["m"] * 2
        state["count"] = state["count"] + 1
        ws["state"] = state


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m epochal ARGS`` with plain, wide output."""
    env = dict(os.environ, COLUMNS="250", NO_COLOR="1", EPOCHAL_QUIET="1")
    env.pop("EPOCHAL_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "epochal", *args], capture_output=True, text=True, env=env,
        cwd=cwd, timeout=120,
    )


def one_line_error(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The command failed with ``code`` and exactly one stderr line containing ``needles``."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def jout(proc: subprocess.CompletedProcess[str], code: int = 0) -> Any:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    return json.loads(proc.stdout)


def flip_byte_of(path: Path, needle: bytes) -> None:
    """Damage the file where ``needle`` (a blob's raw bytes) starts."""
    raw = bytearray(path.read_bytes())
    at = raw.find(needle)
    assert at >= 0
    raw[at + 5] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("cli")
    prefix = root / "run"
    prefix.mkdir()
    with Cluster():
        with Job() as job:
            # LocalSession shares one workspace between nodes: both init it, one trains it
            for node in NODES:
                with Node(node):
                    with job.init_group:
                        Task(step=_Init())
            with Node(NODES[0]):
                with job.epoch_group:
                    Task(step=_Train())
                epoch_limiter(job, EPOCHS)
        handler = DirectoryMetadataHandler()
        manager = MultiNodeCheckpointManager(str(prefix), "native", metadata_handler=handler)
        session = LocalSession()
        assert JobRunner(job, manager, progress=False).train(session) == EPOCHS
        handler.pin(1)
    final_w = np.asarray(session.ws["w"]).copy()
    # a db that no manifest lists: an interrupted or foreign save
    get_db_type("native").write(str(prefix / "trainer_0.9"), {
        "w": final_w, "extra": np.ones(5), "step": 9,
    })
    # the damaged copy: a flipped byte in trainer_0.2's "w", trainer_1.3 truncated
    damaged = root / "damaged"
    shutil.copytree(prefix, damaged)
    w2 = (np.arange(12, dtype=np.float32).reshape(4, 3) + np.float32(0.5)).tobytes()
    flip_byte_of(damaged / "trainer_0.2", w2)
    t3 = damaged / "trainer_1.3"
    t3.write_bytes(t3.read_bytes()[:-100])
    notckpt = root / "notes.txt"
    notckpt.write_text("not a checkpoint\n")
    return {"root": root, "prefix": prefix, "damaged": damaged, "final_w": final_w, "notckpt": notckpt}


# ------------------------------------------------------------------ help and usage
@pytest.mark.parametrize("cmd", [None, "ls", "inspect", "verify", "diff", "stats", "export", "demo"])
def test_help_on_every_command(cmd: str | None) -> None:
    proc = run(*([cmd] if cmd else []), "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage:" in proc.stdout
    if cmd is None:
        for sub in ("ls", "inspect", "verify", "diff", "stats", "export", "demo"):
            assert sub in proc.stdout


def test_usage_errors_exit_2(ckpt: dict[str, Any]) -> None:
    one_line_error(run("ls"), 2, "Missing argument", "PREFIX")
    one_line_error(run("inspect", str(ckpt["root"] / "nope.3")), 2, "nope.3", "does not exist")
    one_line_error(run("frobnicate"), 2, "frobnicate")
    one_line_error(run("export", str(ckpt["prefix"] / "trainer_0.1"), "--to", "pickle", "x"), 2, "pickle")
    assert run("--version").stdout.startswith("epochal ")


# ------------------------------------------------------------------ ls
def test_ls(ckpt: dict[str, Any]) -> None:
    prefix = ckpt["prefix"]
    proc = run("ls", str(prefix))
    assert proc.returncode == 0, proc.stderr
    for word in ("trainer_0", "trainer_1", "committed", "final", "pinned", "uncommitted"):
        assert word in proc.stdout
    listing = jout(run("ls", str(prefix), "--json"))
    assert listing["nodes"] == list(NODES)
    by_epoch = {e["epoch"]: e for e in listing["epochs"]}
    assert sorted(by_epoch) == [0, 1, 2, 3, 9]
    assert [by_epoch[e]["state"] for e in (0, 1, 2, 3, 9)] == ["committed"] * 3 + ["final", "uncommitted"]
    assert [e for e, v in by_epoch.items() if v["pinned"]] == [1]
    assert by_epoch[9]["committed"] is False and set(by_epoch[9]["files"]) == {"trainer_0"}
    for e in (0, 1, 2, 3):
        files = by_epoch[e]["files"]
        assert set(files) == set(NODES)
        for node, f in files.items():
            assert f["size"] == os.path.getsize(prefix / f"{node}.{e}") == f["recorded_size"]
        assert by_epoch[e]["size"] == sum(f["size"] for f in files.values())
        assert by_epoch[e]["created"]


def test_ls_problems(ckpt: dict[str, Any], tmp_path: Path) -> None:
    one_line_error(run("ls", str(ckpt["prefix"] / "trainer_0.1")), 2, "trainer_0.1")
    proc = run("ls", str(tmp_path))
    assert proc.returncode == 0 and "no checkpoints" in proc.stdout
    assert jout(run("ls", str(tmp_path), "--json"))["epochs"] == []


# ------------------------------------------------------------------ inspect
def test_inspect(ckpt: dict[str, Any]) -> None:
    db = ckpt["prefix"] / "trainer_1.3"
    proc = run("inspect", str(db))
    assert proc.returncode == 0, proc.stderr
    for word in ("w", "state", "blob_names", "ndarray", "<f4", "4x3", "crc32"):
        assert word in proc.stdout
    info = jout(run("inspect", str(db), "--json"))
    assert info["db_type"] == "native" and info["file_bytes"] == os.path.getsize(db)
    blobs = {b["name"]: b for b in info["blobs"]}
    assert {"w", "b", "flags", "step", "name", "state", "blob_names"} <= set(blobs)
    assert blobs["w"]["kind"] == "ndarray" and blobs["w"]["shape"] == [4, 3]
    assert blobs["w"]["dtype"] == "<f4" and blobs["w"]["nbytes"] == 48
    assert blobs["w"]["checksum"]
    assert info["blob_count"] == len(info["blobs"])


def test_inspect_blob(ckpt: dict[str, Any]) -> None:
    db = ckpt["prefix"] / "trainer_0.3"
    w = ckpt["final_w"]
    stats = jout(run("inspect", str(db), "--blob", "w", "--json"))["blob"]["stats"]
    assert stats["shape"] == [4, 3] and stats["size"] == 12 and stats["nan"] == 0
    assert stats["min"] == pytest.approx(float(w.min()))
    assert stats["max"] == pytest.approx(float(w.max()))
    assert stats["mean"] == pytest.approx(float(w.mean()))
    assert stats["std"] == pytest.approx(float(w.std()), rel=1e-5)
    tree = jout(run("inspect", str(db), "--blob", "state", "--json"))["blob"]["stats"]
    leaves = {leaf["key"]: leaf for leaf in tree["leaves"]}
    assert leaves["m"]["max"] == 8.0 and leaves["count"]["value"] == 4 and "betas/1" in leaves
    flags = jout(run("inspect", str(db), "--blob", "flags", "--json"))["blob"]["stats"]
    assert flags["true"] == 2 and flags["false"] == 1
    proc = run("inspect", str(db), "--blob", "w")
    assert proc.returncode == 0 and "mean" in proc.stdout and "std" in proc.stdout


def test_inspect_problems(ckpt: dict[str, Any]) -> None:
    db = str(ckpt["prefix"] / "trainer_0.3")
    one_line_error(run("inspect", db, "--blob", "nope"), 1, "'nope'", "trainer_0.3")
    one_line_error(run("inspect", str(ckpt["notckpt"])), 1, "notes.txt", "not a checkpoint")
    one_line_error(run("inspect", str(ckpt["prefix"])), 1, "directory")
    one_line_error(run("inspect", str(ckpt["damaged"] / "trainer_0.2"), "--blob", "w"), 1, "trainer_0.2", "'w'")
    one_line_error(run("inspect", str(ckpt["damaged"] / "trainer_1.3")), 1, "trainer_1.3", "truncated")


# ------------------------------------------------------------------ verify
def test_verify_good(ckpt: dict[str, Any]) -> None:
    proc = run("verify", str(ckpt["prefix"]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "intact" in proc.stdout
    result = jout(run("verify", str(ckpt["prefix"]), "--json"))
    assert result["ok"] is True and len(result["files"]) == 2 * (EPOCHS + 1) + 1
    assert [e["epoch"] for e in result["epochs"]] == [0, 1, 2, 3]
    one = run("verify", str(ckpt["prefix"] / "trainer_1.2"))
    assert one.returncode == 0 and "ok" in one.stdout


def test_verify_damaged(ckpt: dict[str, Any]) -> None:
    damaged = ckpt["damaged"]
    proc = run("verify", str(damaged))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    bad_lines = [line for line in proc.stdout.splitlines() if line.startswith("DAMAGED")]
    assert any("trainer_0.2" in line and "'w'" in line for line in bad_lines), proc.stdout
    assert any("trainer_1.3" in line and "truncated" in line for line in bad_lines), proc.stdout
    result = jout(run("verify", str(damaged), "--json"), code=1)
    bad = {Path(f["path"]).name: f for f in result["files"] if not f["ok"]}
    assert set(bad) == {"trainer_0.2", "trainer_1.3"}
    assert [p["blob"] for p in bad["trainer_0.2"]["problems"]] == ["w"]
    assert bad["trainer_1.3"]["problems"][0]["blob"] is None  # damage in the file as a whole
    epoch_problems = {e["epoch"]: e["problems"] for e in result["epochs"] if not e["ok"]}
    assert list(epoch_problems) == [3] and "trainer_1.3" in epoch_problems[3][0]
    single = run("verify", str(damaged / "trainer_0.2"))
    assert single.returncode == 1 and "'w'" in single.stdout
    notck = run("verify", str(ckpt["notckpt"]))
    assert notck.returncode == 1 and "not a checkpoint" in notck.stdout


# ------------------------------------------------------------------ diff
def test_diff(ckpt: dict[str, Any]) -> None:
    prefix = ckpt["prefix"]
    a, b = str(prefix / "trainer_0.1"), str(prefix / "trainer_0.3")
    proc = run("diff", a, b)
    assert proc.returncode == 0, proc.stderr
    assert "w" in proc.stdout and "changed" in proc.stdout
    result = jout(run("diff", a, b, "--json"))
    changed = {c["name"]: c for c in result["changed"]}
    assert result["added"] == [] and result["removed"] == [] and not result["identical"]
    assert {"w", "step", "state"} <= set(changed) and "b" not in changed and "name" not in changed
    assert changed["w"]["max_abs_diff"] == pytest.approx(0.5)
    assert changed["step"]["max_abs_diff"] == 2
    assert changed["state"]["max_abs_diff"] == pytest.approx(6.0)  # m: 2 -> 8
    assert {leaf["key"] for leaf in changed["state"]["leaves"]} == {"m", "count"}
    assert result["unchanged"] >= 3
    assert run("diff", a, b, "--exit-code").returncode == 1

    stray = jout(run("diff", b, str(prefix / "trainer_0.9"), "--json"))
    assert [x["name"] for x in stray["added"]] == ["extra"]
    assert {"name", "state", "flags", "b", "blob_names"} <= {x["name"] for x in stray["removed"]}
    assert {c["name"]: c["max_abs_diff"] for c in stray["changed"]} == {"step": 6}

    same = jout(run("diff", a, str(prefix / "trainer_1.1"), "--json", "--exit-code"))
    assert same["identical"] and same["added"] == same["removed"] == same["changed"] == []
    assert same["unchanged"] == len(jout(run("inspect", a, "--json"))["blobs"])
    one_line_error(run("diff", a, str(ckpt["notckpt"])), 1, "notes.txt")


# ------------------------------------------------------------------ stats
def test_stats(ckpt: dict[str, Any], tmp_path: Path) -> None:
    prefix = ckpt["prefix"]
    png = tmp_path / "stats.png"
    proc = run("stats", str(prefix), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint_save" in proc.stdout and "trainer_1" in proc.stdout and "MB/s" in proc.stdout
    raw = png.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 5000
    result = jout(run("stats", str(prefix), "--json"))
    saves = [r for r in result["records"] if r["action"] == "checkpoint_save"]
    assert sorted((r["node"], r["epoch"]) for r in saves) == sorted(
        (n, e) for n in NODES for e in range(EPOCHS + 1)
    )
    for r in saves:
        assert r["seconds"] >= 0 and r["bytes"] == os.path.getsize(prefix / f"{r['node']}.{r['epoch']}")
    summary = {(s["action"], s["node"]): s for s in result["summary"]}
    assert summary[("checkpoint_save", "trainer_0")]["count"] == EPOCHS + 1

    bare = tmp_path / "bare"
    bare.mkdir()
    get_db_type("native").write(str(bare / "n.0"), {"x": np.ones(2)})
    one_line_error(run("stats", str(bare)), 1, "no save/load stats")


# ------------------------------------------------------------------ export
def test_export(ckpt: dict[str, Any], tmp_path: Path) -> None:
    db = str(ckpt["prefix"] / "trainer_0.3")
    out = tmp_path / "w.npz"
    proc = run("export", db, "--to", "npz", str(out))
    assert proc.returncode == 0, proc.stderr
    with np.load(out) as z:
        np.testing.assert_array_equal(z["w"], ckpt["final_w"])
        assert z["step"].shape == () and int(z["step"]) == EPOCHS
        assert str(z["name"]) == "cli-test"
        np.testing.assert_array_equal(z["state/m"], np.full((2, 2), 8, np.float32))

    from safetensors.numpy import load_file

    st = tmp_path / "w.safetensors"
    result = jout(run("export", db, "--to", "safetensors", str(st), "--json"))
    loaded = load_file(str(st))
    np.testing.assert_array_equal(loaded["w"], ckpt["final_w"])
    assert loaded["flags"].dtype == np.bool_ and "state/m" in loaded
    skipped = {s["name"] for s in result["skipped"]}
    assert {"name", "blob_names"} <= skipped and not skipped & set(loaded)
    text = run("export", db, "--to", "safetensors", str(tmp_path / "again.safetensors"))
    assert text.returncode == 0 and "skipped name" in text.stderr
    one_line_error(run("export", str(ckpt["damaged"] / "trainer_0.2"), "--to", "npz", str(tmp_path / "x.npz")),
                   1, "trainer_0.2", "'w'")


# ------------------------------------------------------------------ demo
def test_demo_then_ls(tmp_path: Path) -> None:
    d = tmp_path / "demo"
    proc = run("demo", "--dir", str(d), "--epochs", "2", "--points", "3000", "--quiet")
    assert proc.returncode == 0, proc.stderr
    listing = jout(run("ls", str(d), "--json"))
    assert [e["epoch"] for e in listing["epochs"] if e["committed"]][-1] == 2
    assert run("verify", str(d)).returncode == 0
    from epochal import CheckpointDirectory, get_db_type

    db = CheckpointDirectory(str(d)).db_path("trainer", 2)
    shapes = {b.name: b.shape for b in get_db_type("native").describe(db)}
    assert shapes["data/x"] == (3000, 2)  # --points chose the training set's size


def test_blob_record_names_python_scalar_types(tmp_path: Path) -> None:
    from epochal import get_db_type
    from epochal.cli.dbs import blob_record

    p = str(tmp_path / "n.0")
    get_db_type("native").write(p, {"lr": 0.1, "step": 3, "tag": "x", "w": np.zeros(2, np.float32)})
    recs = {b.name: blob_record(b) for b in get_db_type("native").describe(p)}
    assert [recs[n]["dtype"] for n in ("lr", "step", "tag", "w")] == ["float", "int", "str", "<f4"]
