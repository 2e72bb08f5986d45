"""The format benchmark runs end to end at a tiny size (so it cannot rot). No timing asserts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_format_quick(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_format.py"), "--quick",
         "--dir", str(tmp_path / "bench"), "--formats", "raw,native,safetensors,npz"],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| workload | operation | variant |" in out
    for needle in ("| a | save | native |", "| b | load-cold | native |", "| b | partial-cold | native |",
                   "Goals:"):
        assert needle in out, needle
    assert not (tmp_path / "bench").exists()  # data removed


def test_bench_cold_quick(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_cold.py"), "--quick", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for variant in ("raw", "native", "native-noverify"):
        assert f"| {variant} | " in proc.stdout, variant
    assert list(tmp_path.iterdir()) == []  # data removed
