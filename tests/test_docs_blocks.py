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
PAGES = ["README.md", "docs/quickstart.md", "docs/pytorch.md", "docs/huggingface.md", "docs/jax.md"]
#: pages whose later blocks need what this machine lacks: how many blocks run (huggingface.md's
#: second block subclasses TRL's SFTTrainer, which is not installed here)
FIRST_BLOCKS = {"docs/huggingface.md": 1}


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
    for run in ("first", "again"):
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300, env=env)
        assert out.returncode == 0, f"{page} ({run} run):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
        assert "Traceback" not in out.stderr, out.stderr[-4000:]
        outs.append(out.stdout + out.stderr)
    if page == "docs/quickstart.md":  # what the page says it prints, and then the resume
        assert "5 [2.5 2.5 2.5 2.5]" in outs[0] and "resuming from epoch 5" in outs[1]
