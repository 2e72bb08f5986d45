"""The async, torch, resume and bytes benchmarks run at a tiny size, so they cannot rot (no timing asserted)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, timeout=180):
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_bench_async_quick_runs():
    out = _run("bench_async.py", "--quick")
    assert out.returncode == 0, out.stderr
    assert "median sync/async wall-time ratio" in out.stdout


def test_bench_torch_tiny_runs(tmp_path):
    pytest.importorskip("torch")
    out = _run("bench_torch.py", "--gib", "0.01", "--rounds", "1", "--dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "save: torch.save / epochal" in out.stdout


def test_bench_torch_loop_tiny_runs(tmp_path):
    pytest.importorskip("torch")
    out = _run("bench_torch.py", "--loop", "--gib", "0.01", "--rounds", "1", "--gap", "0",
               "--dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "torch.save tmp+fsync+rename / epochal" in out.stdout
    assert sorted(os.listdir(tmp_path)) == []  # its checkpoints and limit files are removed


def test_bench_resume_quick_runs(tmp_path):
    pytest.importorskip("torch")
    out = _run("bench_resume.py", "--quick", "--dir", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr
    assert "train / bare" in out.stdout and "train_2pass / train" in out.stdout
    assert not (tmp_path / "r").exists()  # its data is removed


def test_bench_bytes_quick_runs(tmp_path):
    pytest.importorskip("zstandard")
    out = _run("bench_bytes.py", "--quick", "--dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "bf16 N(0,0.02)" in out.stdout and "compression off and on" in out.stdout and "on/off" in out.stdout
