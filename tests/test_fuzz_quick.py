"""A quick, seeded run of bench/fuzz.py (the long one: bench/RESULTS.md): single-bit flips
over every region of a native and a safetensors db, truncations, and every forgery class,
each load in a worker process with a time and memory limit. Every load returns the
undamaged values bit for bit or raises a documented error naming the file; no hang, crash,
undocumented exception, memory above twice the file size plus the values returned (plus a
1 MiB allowance), and ``check`` (``epochal verify``) agrees with the loads."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fuzz  # noqa: E402


def test_fuzz_quick(tmp_path):
    rng = np.random.default_rng(2026)
    cases = []
    for t in fuzz.DB_TYPES:
        raw = Path(fuzz.write_base(str(tmp_path), t)).read_bytes()
        cases += fuzz.flip_cases(raw, t, 300, rng)
        cases += fuzz.truncation_cases(raw, t, 30, rng)
        cases += fuzz.forge_cases(t)
    assert {c["region"] for c in cases if c["db_type"] == "native"} >= {
        "superblock", "segment data", "big segment data", "padding", "index head", "blob table",
        "segment table", "meta table", "name order", "names heap", "metas text", "forgery", "truncation"}
    results = fuzz.run_cases(cases, str(tmp_path), workers=2, timeout=20)
    assert len(results) == len(cases)
    summary = fuzz.summarize(results, slack=1 << 20)
    failures = [(r["db_type"], r["kind"], r["region"], r.get("bit", r.get("forgery")), how, why)
                for r, how, why in summary["failures"]]
    assert not failures, failures[:20]
    for t, s in summary["by_type"].items():
        o = s["outcomes"]
        assert o["same_full"] == 0, t  # a full read of a damaged file never returns
        assert o["detected"] + o["problems"] > s["cases"], t
