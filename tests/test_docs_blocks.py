"""Every page a new user reads runs as written: the Python blocks of each page, in order, as
one script in a fresh directory, twice (a fresh start, then the resume the page promises).
A block that only makes sense in a context the page describes (torchrun, a Trainer) is run
in that context by the page's own test (named in the list below)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.system

#: the pages, in the order a new user reads them (README -> quickstart -> the door they use)
PAGES = ["README.md", "docs/quickstart.md", "docs/pytorch.md", "docs/distributed.md", "docs/lightning.md",
         "docs/huggingface.md", "docs/jax.md"]
#: pages whose later blocks need what this machine lacks: how many blocks run (huggingface.md's
#: second block subclasses TRL's SFTTrainer, which is not installed here)
FIRST_BLOCKS = {"docs/huggingface.md": 1}
#: pages run as their first line says (``# torchrun --nproc_per_node=2 train.py``)
TORCHRUN = {"docs/distributed.md": 2}
#: what a page assumes the user already has, made before each run: lightning.md converts a
#: checkpoint that Lightning's own TorchCheckpointIO wrote
SETUP = {"docs/lightning.md": """
import os, torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
os.makedirs("old_run", exist_ok=True)
TorchCheckpointIO().save_checkpoint({"state_dict": {"net.0.weight": torch.ones(2, 2)}, "epoch": 3,
                                     "global_step": 40}, "old_run/last.ckpt")
"""}


def blocks(page: str) -> list[str]:
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_the_pages_have_python_blocks() -> None:
    for page in PAGES:
        assert blocks(page), page


@pytest.mark.parametrize("page", PAGES)
def test_a_page_runs_as_written_and_again(page: str, tmp_path: Any) -> None:
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(blocks(page)[: FIRST_BLOCKS.get(page)]))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "EPOCHAL_QUIET")}
    outs = []
    command = [sys.executable, str(script)]
    if page in TORCHRUN:
        from _cluster import free_port

        command[1:1] = ["-m", "torch.distributed.run", f"--nproc_per_node={TORCHRUN[page]}",
                        "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    for run in ("first", "again"):
        if page in SETUP:
            subprocess.run([sys.executable, "-c", SETUP[page]], cwd=tmp_path, check=True, timeout=120)
        out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, f"{page} ({run} run):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
        assert "Traceback" not in out.stderr, out.stderr[-4000:]
        outs.append(out.stdout + out.stderr)
    if page == "docs/quickstart.md":  # what the page says it prints, and then the resume
        assert "5 [2.5 2.5 2.5 2.5]" in outs[0] and "resuming from epoch 5" in outs[1]
    if page == "docs/distributed.md":  # steps 10..40 across ranks, keep_last=3; dcp_ckpt steps 0, 1
        from epochal import CheckpointDirectory

        assert CheckpointDirectory(str(tmp_path / "ckpt")).committed_epochs() == [20, 30, 40]
        assert CheckpointDirectory(str(tmp_path / "dcp_ckpt")).committed_epochs() == [0, 1]
    if page == "docs/lightning.md":  # the converted file and every file Lightning wrote are epochal dbs
        from epochal.cli.dbs import verify_file

        for f in ["old_run/last.ckpt", "ckpt/last.ckpt", "ckpt_exact/last.ckpt"]:
            got = verify_file(str(tmp_path / f))
            assert got["ok"] and got["db_type"] == "native" and got["blobs"] > 0, got
