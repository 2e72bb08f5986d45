"""CPU time of a commit's retention at a URL with N committed steps, now against the way it
was before parsed manifests were kept (every manifest parsed again at every commit, every db
name split again), paired in the same process (bench/RESULTS.md, "bench_retention_cpu.py").

A ``memory://`` location (no server: only CPU is measured, with ``time.process_time``) is
filled with N committed steps (one node, a small native db and its manifest each); a
``DirectoryMetadataHandler(keep_last=3, keep_every=1)`` (retention runs at every commit and
keeps every step, so it looks at all N manifests) takes the lease, resumes, and commits
steps; each variant's commits alternate (the order flips every round) after one warm-up
commit each. Figures: median CPU ms per commit per variant, and the median of the per-round
ratios before / now, with min..max.

    PYTHONPATH=src .venv/bin/python bench/bench_retention_cpu.py --steps 1000,2000,4000 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import epochal as ep
from epochal.checkpoint.handler.metadata import DbReport
from epochal.checkpoint.location import view
from epochal.checkpoint.location.manifest import Manifest
from epochal.storage.io.remote.fsspec_store import filesystem_for

sys.path.insert(0, os.path.dirname(__file__))
from _requests import fill_committed  # noqa: E402

NODE = "trainer_0"


def _fill(url: str, steps: int) -> tuple[bytes, str]:
    return fill_committed(url, steps, NODE)


@contextmanager
def _before() -> Iterator[None]:
    """Retention as it was: every manifest parsed at every read, every db name split."""
    real_read, real_scan = view.CheckpointDirectory.read_manifest, view.CheckpointDirectory.scan

    def read_manifest(self: Any, epoch: int) -> Manifest:
        return Manifest.from_dict(self.manifest(epoch))

    def scan(self: Any) -> dict[int, dict[str, str]]:
        self._split.clear()
        return real_scan(self)

    view.CheckpointDirectory.read_manifest = read_manifest  # type: ignore[method-assign]
    view.CheckpointDirectory.scan = scan  # type: ignore[method-assign]
    try:
        yield
    finally:
        view.CheckpointDirectory.read_manifest = real_read  # type: ignore[method-assign]
        view.CheckpointDirectory.scan = real_scan  # type: ignore[method-assign]


def run(steps: int, rounds: int) -> dict[str, Any]:
    url = f"memory://retention-{secrets.token_hex(4)}/run"
    data, digest = _fill(url, steps)
    fs, root = filesystem_for(url)
    h = ep.DirectoryMetadataHandler(keep_last=3, keep_every=1)
    h.set_params(url, "native", [NODE])
    h.acquire_lock()
    assert h.resume_epoch() == steps - 1
    step = steps
    times: dict[str, list[float]] = {"now": [], "before": []}

    def commit(variant: str) -> float:
        nonlocal step
        fs.pipe_file(f"{root}/{NODE}.{step}", data)  # the node's save (not counted)
        with (_before() if variant == "before" else _nothing()):
            t = time.process_time()
            h.cp_accessible()
            h.report_dbs(step, {NODE: DbReport(len(data), digest)})
            h.write(step)
            dt = time.process_time() - t
        step += 1
        return dt

    try:
        commit("now")
        commit("before")
        for r in range(rounds):
            for variant in (("now", "before") if r % 2 == 0 else ("before", "now")):
                times[variant].append(commit(variant))
    finally:
        h.release_lock()
    ratios = [b / n for b, n in zip(times["before"], times["now"])]
    return {"steps": steps, "now_ms": 1000 * statistics.median(times["now"]),
            "before_ms": 1000 * statistics.median(times["before"]),
            "ratio": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios)}


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="1000,2000,4000")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    print(f"N = {args.rounds} commits per variant; load average {os.getloadavg()[0]:.2f}")
    print("| steps | CPU ms/commit now | before | before/now |")
    print("|---:|---:|---:|---:|")
    for steps in [int(x) for x in args.steps.split(",")]:
        out = run(steps, args.rounds)
        print(f"| {steps} | {out['now_ms']:.1f} | {out['before_ms']:.1f} | "
              f"{out['ratio']:.1f} ({out['lo']:.1f}..{out['hi']:.1f}) |", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
