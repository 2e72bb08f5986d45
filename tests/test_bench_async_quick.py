"""bench/bench_async.py --quick runs (a tiny size; no timing is asserted)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_async_quick_runs():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_async.py"), "--quick"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "median sync/async wall-time ratio" in out.stdout
