"""Requests (and seconds) per commit at a URL with many committed steps, and the time of
``epochal ls``/``stats``/``verify`` and of a resume there (figures: bench/RESULTS.md,
"bench_commit_requests.py").

A moto S3 server runs as its own process on 127.0.0.1 (``moto_server``). For each step count N a location is
filled with N committed steps (one node, a small native db, its manifest and one stats report
per step, written directly with parallel PUTs), then a ``DirectoryMetadataHandler``
(``keep_last=3, keep_every=1``: retention runs at every commit and keeps every step, so it
looks at all N manifests) takes the lease and commits ``--commits`` more steps. Each
commit is ``cp_accessible`` + ``report_dbs`` + ``write`` + ``report`` (what the runner calls
after the nodes saved); the dbs themselves are written before, not counted. Requests are
counted at the seam every S3 request goes through (``bench/_requests.py``).

    PYTHONPATH=src .venv/bin/python bench/bench_commit_requests.py --steps 10,1000,5000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from _requests import count_requests, fill_committed, moto_server  # noqa: E402

import epochal as ep  # noqa: E402
from epochal.checkpoint.handler.metadata import DbReport  # noqa: E402
from epochal.storage.io.fsspec_store import filesystem_for, set_storage_options  # noqa: E402

NODE = "trainer_0"


def _fill(url: str, steps: int) -> tuple[bytes, str]:
    """N committed steps at ``url``: db, manifest and a stats object each (parallel PUTs)."""
    return fill_committed(url, steps, NODE, stats=True)


def _commit(h: ep.DirectoryMetadataHandler, url: str, step: int, data: bytes, digest: str) -> None:
    h.cp_accessible()
    h.report_dbs(step, {NODE: DbReport(len(data), digest)})
    h.write(step)
    h.report_bytes("checkpoint_save", {NODE: len(data)})
    h.report("checkpoint_save", {NODE: 1000})


def run(steps: int, commits: int, opts: dict[str, Any], tools: bool, verify: bool) -> dict[str, Any]:
    url = f"s3://bench/run-{steps}-{os.getpid()}-{time.time_ns()}"
    set_storage_options(url, opts)
    data, digest = _fill(url, steps)
    fs, root = filesystem_for(url)
    out: dict[str, Any] = {"steps": steps}

    h = ep.DirectoryMetadataHandler(keep_last=3, keep_every=1, storage_options=opts)
    with count_requests() as n:
        t = time.perf_counter()
        h.set_params(url, "native", [NODE])
        h.acquire_lock()
        resume = h.resume_epoch()
        out["start_s"], out["start_requests"] = time.perf_counter() - t, n.total
    assert resume == steps - 1, resume
    per, secs = [], []
    for k in range(commits):
        step = steps + k
        fs.pipe_file(f"{root}/{NODE}.{step}", data)  # the node's save (not counted)
        with count_requests(exclude=()) as n:
            t = time.perf_counter()
            _commit(h, url, step, data, digest)
            secs.append(time.perf_counter() - t)
        per.append(n.total)
        if k == 0:
            out["first_by_method"] = dict(n.by_method)
        else:
            out["by_method"] = dict(n.by_method)
    h.release_lock()
    out["first_commit_requests"], out["first_commit_s"] = per[0], secs[0]
    out["commit_requests"] = statistics.median(per[1:]) if len(per) > 1 else per[0]
    out["commit_s"] = statistics.median(secs[1:]) if len(secs) > 1 else secs[0]
    if tools:
        from epochal.cli.records import list_prefix, stats_prefix, verify_target

        set_storage_options(url, opts)
        for name, fn in (("ls", list_prefix), ("stats", stats_prefix), ("verify", verify_target)):
            if name == "verify" and not verify:
                continue
            with count_requests() as n:
                t = time.perf_counter()
                got = fn(url)
                out[f"{name}_s"], out[f"{name}_requests"] = time.perf_counter() - t, n.total
            if name == "ls":
                assert len(got["epochs"]) == steps + commits, len(got["epochs"])
            if name == "verify":
                assert got["ok"], [e for e in got["epochs"] if not e["ok"]][:3]
        fs.invalidate_cache()
        with count_requests() as n:  # a list of the db folder alone: the floor for ls
            t = time.perf_counter()
            fs.ls(root, detail=True, refresh=True)
            out["listing_s"], out["listing_requests"] = time.perf_counter() - t, n.total
    return out


def paired(steps: int, rounds: int, latency: float, opts: dict[str, Any]) -> dict[str, Any]:
    """``epochal ls``, ``stats`` and a resume at ``steps`` steps with ``latency`` seconds added
    to each request: one request at a time vs ``PARALLEL_REQUESTS`` at a time, alternating
    (the order flips every round); medians of the per-round ratios sequential / parallel."""
    from epochal.checkpoint.location import record_cache
    from epochal.cli.records import list_prefix, stats_prefix

    url = f"s3://bench/paired-{steps}-{os.getpid()}-{time.time_ns()}"
    set_storage_options(url, opts)
    _fill(url, steps)
    fs, root = filesystem_for(url)
    parallel = record_cache.PARALLEL_REQUESTS

    def resume() -> None:
        h = ep.DirectoryMetadataHandler(storage_options=opts)
        h.set_params(url, "native", [NODE])
        h.acquire_lock()
        assert h.resume_epoch() == steps - 1
        h.release_lock()

    def listing() -> None:
        fs.invalidate_cache()
        fs.ls(root + "/.epochal", detail=True, refresh=True)

    jobs = {"ls": lambda: list_prefix(url), "stats": lambda: stats_prefix(url), "resume": resume,
            "listing": listing}
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        for workers in ((1, parallel) if r % 2 == 0 else (parallel, 1)):
            record_cache.PARALLEL_REQUESTS = workers
            for name, fn in jobs.items():
                with count_requests(latency=latency):
                    t = time.perf_counter()
                    fn()
                    times.setdefault((name, workers), []).append(time.perf_counter() - t)
    record_cache.PARALLEL_REQUESTS = parallel
    out: dict[str, Any] = {"steps": steps}
    for name in jobs:
        seq, par = times[(name, 1)], times[(name, parallel)]
        out[name] = (statistics.median(seq), statistics.median(par),
                     statistics.median(s / p for s, p in zip(seq, par)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="10,1000,5000", help="comma-separated step counts")
    ap.add_argument("--commits", type=int, default=4, help="commits measured per step count")
    ap.add_argument("--no-tools", action="store_true", help="skip ls/stats/verify")
    ap.add_argument("--verify-max", type=int, default=1000, help="run verify (reads every db) up to this many steps")
    ap.add_argument("--paired", type=int, default=0, metavar="STEPS",
                    help="instead: ls/stats/resume at STEPS steps, one request at a time vs in parallel")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="with --paired: added to each request")
    ap.add_argument("--rounds", type=int, default=3, help="with --paired")
    args = ap.parse_args()
    server, opts = moto_server()
    if args.paired:
        try:
            got = paired(args.paired, args.rounds, args.latency_ms / 1000, opts)
        finally:
            server.terminate()
            server.wait()
        print(f"{got['steps']} steps, {args.latency_ms:g} ms added per request, N = {args.rounds} rounds")
        print("| what | one at a time s | parallel s | ratio (median of pairs) |")
        print("|---|---:|---:|---:|")
        for name in ("ls", "stats", "resume", "listing"):
            seq, par, ratio = got[name]
            print(f"| {name} | {seq:.2f} | {par:.2f} | {ratio:.2f} |")
        return
    try:
        rows = []
        for s in args.steps.split(","):
            rows.append(run(int(s), args.commits, opts, not args.no_tools, int(s) <= args.verify_max))
            print(rows[-1], flush=True)
    finally:
        server.terminate()
        server.wait()
    cols = ["steps", "start_requests", "start_s", "first_commit_requests", "first_commit_s", "commit_requests",
            "commit_s", "ls_requests", "ls_s", "stats_requests", "stats_s", "verify_requests", "verify_s",
            "listing_requests", "listing_s"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---:|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols) + " |")
    for r in rows:
        print(r["steps"], "first commit:", r.get("first_by_method"), "steady:", r.get("by_method"))


if __name__ == "__main__":
    main()
