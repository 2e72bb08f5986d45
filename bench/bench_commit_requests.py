"""A long history at a URL and on a local disk: the requests (and seconds) that opening a
``Checkpointer``, restoring the newest step, the first commit and the steady commits with
retention, and ``epochal ls`` make at N committed steps, beside a plain ``s3fs`` listing of
the same prefix (see docs/remote.md, "History at scale").

A moto S3 server runs as its own process on 127.0.0.1 (``moto_server``). For each step count N
a location is filled with N committed steps as a job with ``keep_last=3, keep_every=10,
keep_best=3`` (by ``loss``) leaves them: the multiples of 10, then the last three (one small
native db, its manifest with its ``loss`` each, and the metrics index), written directly with
parallel PUTs. Then a ``Checkpointer`` opens the location, restores the newest step and saves
``--commits`` more (that policy: its first commit ranks the best three of all N steps and
drops the step that fell out of the last three; so does each one after). ``ls`` is the
listing ``epochal ls URL`` prints: the newest 20 steps; ``ls --all`` every one. Requests are
counted at the seam every S3 request goes through (``bench/_requests.py``); on a local disk
(``--where local``), the calls to the directory's record store.

    PYTHONPATH=src .venv/bin/python bench/bench_commit_requests.py --steps 100,1000,10000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from _requests import count_record_calls, count_requests, fill_committed, moto_server  # noqa: E402

import epochal as ep  # noqa: E402
from epochal.checkpoint.location.retention import RetentionPolicy  # noqa: E402
from epochal.storage.io.remote.fsspec_store import filesystem_for, set_storage_options  # noqa: E402

NODE = "local"  # the Checkpointer's node
POLICY = RetentionPolicy(keep_last=3, keep_every=10, keep_best=3, metric="loss")


def history(steps: int) -> list[int]:
    """The step numbers of N committed steps kept by ``POLICY``: every 10th, then the last three."""
    last = 10 * (steps - 4)
    return [*range(0, last + 1, 10), last + 1, last + 2, last + 3]


def _measure(counter: Callable[[], Any], fn: Callable[[], Any]) -> tuple[Any, int, float, dict[str, int]]:
    with counter() as n:
        t = time.perf_counter()
        got = fn()
        secs = time.perf_counter() - t
    return got, n.total, secs, dict(n.by_method)


def run(where: str, steps: int, commits: int, opts: dict[str, Any] | None, all_max: int) -> dict[str, Any]:
    """One row: N = ``steps`` committed steps at ``where`` (a URL, or a local directory)."""
    remote = opts is not None
    counter: Callable[[], Any] = (lambda: count_requests(exclude=("lease.json",))) if remote else count_record_calls
    if remote:
        set_storage_options(where, opts)
    epochs = history(steps)
    t = time.perf_counter()
    fill_committed(where, steps, NODE, epochs=epochs, metric="loss")
    out: dict[str, Any] = {"steps": steps, "fill_s": time.perf_counter() - t}
    if remote:
        fs, root = filesystem_for(where)

        def listing() -> None:  # what s3fs itself costs: the dbs' folder and the records' folder
            fs.invalidate_cache()
            fs.ls(root, detail=True, refresh=True)
            fs.ls(root + "/.epochal", detail=True, refresh=True)

        _, out["listing_requests"], out["listing_s"], _ = _measure(counter, listing)
    ck, out["open_requests"], out["open_s"], out["open_by"] = _measure(
        counter, lambda: ep.Checkpointer(where, storage_options=opts, keep_last=3, keep_best=3, metric="loss"))
    try:
        ck.handler.policy = POLICY  # as DirectoryMetadataHandler(keep_every=10, ...): the Checkpointer has no keep_every
        state = {"w": np.zeros(64, dtype=np.float32)}
        got, out["restore_requests"], out["restore_s"], out["restore_by"] = _measure(counter, lambda: ck.restore(state))
        assert got == epochs[-1] and state["w"].tobytes() == np.arange(64, dtype=np.float32).tobytes(), got
        per, secs = [], []
        for k in range(commits):
            step = epochs[-1] + 1 + k
            _, n, s_, by = _measure(counter, lambda s=step: ck.save(s, state, metrics={"loss": 9.0}))
            per.append(n)
            secs.append(s_)
            out["first_commit_by" if k == 0 else "commit_by"] = by
    finally:
        ck.close()
    out["first_commit_requests"], out["first_commit_s"] = per[0], secs[0]
    out["commit_requests"] = statistics.median(per[1:]) if len(per) > 1 else None
    out["commit_s"] = statistics.median(secs[1:]) if len(secs) > 1 else None
    from epochal.cli.records import LS_NEWEST, ls_prefix

    (listing_, best), out["ls_requests"], out["ls_s"], _ = _measure(counter, lambda: ls_prefix(where, LS_NEWEST))
    assert len(listing_["epochs"]) == LS_NEWEST and best is not None, listing_["older"]
    if steps <= all_max:
        (listing_, _), out["ls_all_requests"], out["ls_all_s"], _ = _measure(counter, lambda: ls_prefix(where, None))
        assert listing_["older"] == 0 and len(listing_["epochs"]) >= len(epochs), len(listing_["epochs"])
    return out


def _fill(url: str, steps: int) -> tuple[bytes, str]:
    """N committed steps at ``url``: db, manifest and a stats object each (parallel PUTs)."""
    return fill_committed(url, steps, NODE, stats=True)


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
    ap.add_argument("--steps", default="100,1000,10000", help="comma-separated step counts")
    ap.add_argument("--commits", type=int, default=4, help="commits measured per step count (the first, then steady)")
    ap.add_argument("--where", default="s3,local", help="s3, local or both (comma-separated)")
    ap.add_argument("--all-max", type=int, default=10000, help="run ls --all up to this many steps")
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
    rows = []
    try:
        for kind in args.where.split(","):
            for s in args.steps.split(","):
                if kind == "s3":  # a bucket of its own: moto's listing time grows with the bucket's keys
                    bucket = f"history-{s}-{time.time_ns()}"
                    urllib.request.urlopen(urllib.request.Request(f"{opts['endpoint_url']}/{bucket}", method="PUT")).read()
                    where, o = f"s3://{bucket}/run", opts
                else:
                    where, o = tempfile.mkdtemp(prefix=f"epochal-history-{s}-"), None
                row = run(where, int(s), args.commits, o, args.all_max)
                row["where"] = kind
                rows.append(row)
                print(row, flush=True)
    finally:
        server.terminate()
        server.wait()
    whats = [("s3fs listing", "listing"), ("open", "open"), ("restore newest", "restore"),
             ("first commit", "first_commit"), ("steady commit", "commit"), ("ls (newest 20)", "ls"),
             ("ls --all", "ls_all")]
    print("| where | steps | " + " | ".join(w for w, _ in whats) + " |")
    print("|---|---:|" + "---:|" * len(whats))
    for r in rows:
        cells = []
        for _, key in whats:
            n, secs = r.get(f"{key}_requests"), r.get(f"{key}_s")
            cells.append("-" if n is None else f"{n:g} / {secs:.2f} s")
        print(f"| {r['where']} | {r['steps']:,} | " + " | ".join(cells) + " |")
    for r in rows:
        print(r["where"], r["steps"], "open:", r["open_by"], "restore:", r["restore_by"],
              "first commit:", r["first_commit_by"], "steady:", r.get("commit_by"))


if __name__ == "__main__":
    main()
