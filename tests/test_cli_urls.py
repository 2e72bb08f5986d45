"""``epochal ls/inspect/verify/diff/stats/pull`` on a URL (moto's S3 server on 127.0.0.1),
with ``-o KEY=VALUE`` storage options."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs", reason="s3fs is not installed")

from test_cli import jout, one_line_error, run  # noqa: E402
from test_url_checkpoints import LAST, NODES, _db, _train  # noqa: E402

import epochal as ep  # noqa: E402
from epochal.storage.io.remote.fsspec_store import filesystem_for  # noqa: E402


@pytest.fixture(scope="module")
def trained(s3: dict[str, Any]) -> tuple[str, list[str]]:
    url = f"s3://ckpts/cli-{secrets.token_hex(4)}/run"
    _train(url, ep.DirectoryMetadataHandler(storage_options=s3), s3)
    return url, ["-o", f"endpoint_url={s3['endpoint_url']}", "-o", "key=test", "-o", "secret=test"]


def test_ls_stats_inspect_diff_on_a_url(trained: tuple[str, list[str]]) -> None:
    url, o = trained
    listing = jout(run("ls", url, *o, "--json"))
    assert [e["epoch"] for e in listing["epochs"]] == list(range(LAST + 1))
    assert listing["epochs"][-1]["state"] == "final"
    assert all(f["present"] and f["size"] == f["recorded_size"]
               for e in listing["epochs"] for f in e["files"].values())
    stats = jout(run("stats", url, *o, "--json"))
    assert {(r["action"], r["node"]) for r in stats["summary"]} >= {("checkpoint_save", n) for n in NODES}
    info = jout(run("inspect", f"{url}/trainer_0.{LAST}", *o, "--json"))  # the name, no token:
    assert "trainer_0/total" in str(info)  # the db the manifest names (with its writer's token)
    assert jout(run("inspect", _db(url, "trainer_0", LAST), *o, "--json")) == info
    same = run("diff", f"{url}/trainer_0.1", f"{url}/trainer_0.1", *o, "--exit-code")
    assert same.returncode == 0, same.stderr
    differ = run("diff", f"{url}/trainer_0.1", f"{url}/trainer_0.2", *o, "--exit-code")
    assert differ.returncode == 1, differ.stderr


def test_verify_a_url_finds_damage(trained: tuple[str, list[str]], s3: dict[str, Any]) -> None:
    url, o = trained
    assert jout(run("verify", url, *o, "--json"))["ok"] is True
    assert jout(run("verify", f"{url}/trainer_1.2", *o, "--json"))["ok"] is True
    fs, path = filesystem_for(_db(url, "trainer_1", 1))
    data = bytearray(fs.cat_file(path))
    data[len(data) // 3] ^= 0x40
    damaged = f"s3://ckpts/cli-{secrets.token_hex(4)}/bad.0"
    fs.pipe_file(damaged.split("://", 1)[1], bytes(data))
    result = jout(run("verify", damaged, *o, "--json"), 1)
    assert result["ok"] is False and result["files"][0]["path"] == damaged


def test_pull_a_url_prefix(trained: tuple[str, list[str]], tmp_path: Path) -> None:
    url, o = trained
    got = jout(run("pull", url, str(tmp_path / "local"), *o, "--json"))
    assert got["epoch"] == LAST and got["final"] is True
    names = [_db(url, n, LAST).rsplit("/", 1)[-1] for n in NODES]  # as the manifest names them
    assert sorted(p.name for p in (tmp_path / "local").iterdir() if p.is_file()) == names
    assert ep.CheckpointDirectory(str(tmp_path / "local")).check_epoch(LAST) == []


def test_a_url_with_nothing_there(trained: tuple[str, list[str]]) -> None:
    _, o = trained
    empty = f"s3://ckpts/nothing-{secrets.token_hex(3)}"
    one_line_error(run("ls", empty, *o), 1, empty, "nothing at this URL")
