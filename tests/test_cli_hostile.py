"""The command line on bad input: one line naming the thing at fault, the documented exit
code (1 a problem, 2 usage), never "internal error"."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from epochal.checkpoint.location.view import CheckpointDirectory
from epochal.cli.main import run
from epochal.storage.formats.base import get_db_type


@pytest.fixture
def ckdir(tmp_path: Path) -> Path:
    from test_hostile_records import run as run_job  # a 2-epoch job of node "n"

    d = tmp_path / "ck"
    assert run_job(d) == 2
    assert CheckpointDirectory(str(d)).committed_epochs() == [0, 1, 2]
    return d


def cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = run(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_verify_dir_reports_a_garbage_manifest(ckdir, capsys):
    assert cli(capsys, "verify", str(ckdir))[0] == 0
    (ckdir / ".epochal" / "manifest.1.json").write_text("garbage")
    rc, out, err = cli(capsys, "verify", str(ckdir))
    assert rc == 1
    assert "epoch 1" in out and "manifest.1.json" in out and "not committed" in out
    rc, out, _ = cli(capsys, "verify", "--json", str(ckdir))
    doc = json.loads(out)
    assert rc == 1 and not doc["ok"]
    assert [e["epoch"] for e in doc["epochs"] if not e["ok"]] == [1]


@pytest.mark.parametrize("field,value", [("ns", "q"), ("bytes", {}), ("epoch", "zz"), ("action", 5),
                                         ("ns", -3), ("node", [1])])
def test_a_stats_line_with_wrong_types(ckdir, capsys, field, value):
    line = {"time": "t", "action": "checkpoint_save", "epoch": 1, "node": "n", "db": "x", "ns": 5, "bytes": 7}
    line[field] = value
    with open(ckdir / ".epochal" / "stats.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    rc, _, err = cli(capsys, "stats", str(ckdir))
    assert rc == 1, err
    assert "internal error" not in err and len(err.strip().splitlines()) == 1
    assert "stats.jsonl" in err and repr(field) in err


def test_pull_from_an_unknown_scheme(tmp_path, capsys):
    rc, _, err = cli(capsys, "pull", "zzz://x", str(tmp_path / "d"))
    assert rc == 1 and "internal error" not in err, err
    assert "zzz://x" in err and len(err.strip().splitlines()) == 1


def test_forged_torch_devices_in_the_cli(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from _forge import NativeParts

    p = tmp_path / "t.db"
    get_db_type("native").write(str(p), {"x": torch.arange(4.0)})
    for dev in [5, None, "cuda:99999999999999999999", "cpu:-1", "a" * 200, [1]]:
        P = NativeParts.parse(p.read_bytes())
        ents = json.loads(P.metas)
        ents[0][1]["device"] = dev
        P.set_metas(ents)
        f = tmp_path / "f.db"
        f.write_bytes(P.pack())
        for args in (["inspect", str(f)], ["verify", str(f)], ["diff", str(p), str(f)],
                     ["export", str(f), str(tmp_path / "o.npz"), "--to", "npz"]):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "saved on a device this process lacks"
                rc, _, err = cli(capsys, *args)
            assert rc in (0, 1) and "internal error" not in err, (dev, args, err)
            if rc == 1:
                assert str(f) in err or "blob 'x'" in err, err


@pytest.mark.parametrize("forgery", ["S0 dtype, huge shape", "empty structured dtype, huge shape"])
def test_export_and_verify_of_a_zero_itemsize_forgery(tmp_path, capsys, forgery):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from forgeries import forge
    from fuzz import base_blobs

    base = tmp_path / "base"
    get_db_type("native").write(str(base), base_blobs())
    f = tmp_path / "forged"
    f.write_bytes(forge("native", forgery, base.read_bytes()))
    for args in (["export", str(f), str(tmp_path / "o.npz"), "--to", "npz"], ["verify", str(f)]):
        rc, out, err = cli(capsys, *args)
        assert rc == 1, (args, out, err)
        assert "zero-byte dtype" in out + err and "internal error" not in err
    assert not (tmp_path / "o.npz").exists()
