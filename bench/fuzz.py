"""Fuzzing the readers: damaged and forged db files, each load in a child process with a time
and memory limit (results in bench/RESULTS.md, "fuzz.py"; goal in docs/reliability.md).

    PYTHONPATH=src python bench/fuzz.py --flips 10000 --truncations 500 --workers 2

For each db type (native, safetensors) a base file of varied blobs is written (many small
arrays, so the native batch path runs, a big array, scalars, strings, bytes, big-endian and
structured arrays, a state-dict tree), then cases are generated from a seed:

* single-bit flips spread evenly over every region of the file (native: superblock, each
  segment's data and padding, each table of the index, names, metas; safetensors: header
  length, JSON header, data), all of a region's bits when it has fewer than its share;
* truncations to lengths spread over the whole file, and bytes appended;
* each forgery class (valid checksums, absurd content) of bench/_forge.py.

Each case is loaded in a worker process (``resource.setrlimit(RLIMIT_AS)``, a new worker
after any hang) by every load path: full read, partial read of one blob, memory-mapped read
(native), and ``check`` (what ``epochal verify`` runs). A load must either return values
bit-identical to the undamaged file's or raise a documented error (``epochal.errors``)
naming the file; it must finish within the timeout; its peak traced memory (tracemalloc)
must stay within twice the file size plus the values returned (plus a fixed allowance for
the interpreter's own objects, ``--slack``). A ``check`` that finds nothing while a load
raises, or the reverse, is counted too ("verify disagrees").
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TIMEOUT = 10.0
DB_TYPES = ("native", "safetensors")


# ---------------------------------------------------------------- the base files
def base_blobs() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    blobs: dict[str, Any] = {f"layer{i:02d}.w": rng.standard_normal(16 + i).astype(np.float32) for i in range(70)}
    blobs.update({
        "big": rng.standard_normal(300_000).astype(np.float32),  # > 1 MiB: the big-segment path
        "ints": np.arange(40, dtype=np.int64).reshape(5, 8),
        "be": np.arange(9, dtype=">i4"),
        "rec": np.zeros(3, dtype=[("a", "<f8"), ("b", "u1", (2,))]),
        "empty": np.zeros((0, 4), np.float32),
        "npf": np.float32(1.5),
        "n": 12345678901234567890,
        "x": -0.0,
        "s": "héllo \udcff",
        "b": b"\x00\x01bytes",
        "none": None,
        "tree": {"step": 3, "lr": 0.1, "buf": [np.ones(2, np.float64), "tag"]},
    })
    return blobs


def write_base(directory: str, db_type: str) -> str:
    from epochal.storage.formats.base import get_db_type

    path = os.path.join(directory, f"base.{db_type}")
    get_db_type(db_type).write(path, base_blobs())
    return path


# ---------------------------------------------------------------- regions and cases
def regions(raw: bytes, db_type: str) -> list[tuple[str, int, int]]:
    """``(name, start, end)`` byte ranges covering the whole file."""
    if db_type == "native":
        from _forge import NativeParts

        from epochal.storage.formats.native.layout import INDEX_HEAD, SUPERBLOCK_SIZE

        p = NativeParts.parse(raw)
        out = [("superblock", 0, SUPERBLOCK_SIZE)]
        for off, ln, _crc, pad in p.segs.tolist():
            kind = "big segment" if ln >= 1 << 20 else "segment"
            if ln:
                out.append((f"{kind} data", off, off + ln))
            if pad:
                out.append(("padding", off + ln, off + ln + pad))
        pos = SUPERBLOCK_SIZE + len(p.data)
        for name, size in (("index head", INDEX_HEAD.size), ("blob table", p.recs.nbytes),
                           ("segment table", p.segs.nbytes), ("group table", p.groups.nbytes),
                           ("meta table", p.moffs.nbytes),
                           ("name order", p.order.nbytes), ("names heap", len(p.names)),
                           ("metas text", len(p.metas))):
            out.append((name, pos, pos + size))
            pos += size
        return out
    n = int.from_bytes(raw[:8], "little")
    return [("header length", 0, 8), ("json header", 8, 8 + n), ("data", 8 + n, len(raw))]


def flip_cases(raw: bytes, db_type: str, count: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """``count`` single-bit flips spread evenly over the region kinds (all bits of a small one)."""
    by_kind: dict[str, list[tuple[int, int]]] = {}
    for name, a, b in regions(raw, db_type):
        by_kind.setdefault(name, []).append((a, b))
    cases = []
    left = count
    kinds = sorted(by_kind.items(), key=lambda kv: sum(b - a for a, b in kv[1]))
    for n_done, (name, spans) in enumerate(kinds):  # smallest first: what they lack goes to the rest
        share = max(1, left // (len(kinds) - n_done))
        bits = sum(b - a for a, b in spans) * 8
        left -= min(bits, share)
        if bits <= share:
            picks = range(bits)
        else:
            picks = rng.choice(bits, share, replace=False).tolist()
        starts = np.cumsum([0] + [(b - a) * 8 for a, b in spans])
        for k in picks:
            j = int(np.searchsorted(starts, k, side="right") - 1)
            bit = spans[j][0] * 8 + (k - int(starts[j]))
            cases.append({"db_type": db_type, "kind": "flip", "region": name, "bit": int(bit)})
    return cases


def truncation_cases(raw: bytes, db_type: str, count: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    lengths = sorted(set(rng.integers(0, len(raw), count).tolist()) | {0, 1, 8, 63, 64, len(raw) - 1})
    cases = [{"db_type": db_type, "kind": "truncate", "region": "truncation", "length": int(n)} for n in lengths]
    cases += [{"db_type": db_type, "kind": "append", "region": "appended", "extra": k} for k in (1, 64, 4096)]
    return cases


def forge_cases(db_type: str) -> list[dict[str, Any]]:
    from forgeries import NATIVE_FORGERIES, ST_FORGERIES

    names = NATIVE_FORGERIES if db_type == "native" else ST_FORGERIES
    return [{"db_type": db_type, "kind": "forge", "region": "forgery", "forgery": n} for n in names]


# ---------------------------------------------------------------- the worker (child process)
def _values_nbytes(v: Any) -> int:
    if isinstance(v, np.ndarray):
        return int(v.nbytes) if v.base is None or v.flags.owndata else 0
    if isinstance(v, (bytes, bytearray, str)):
        return len(v) * (4 if isinstance(v, str) else 1)
    if isinstance(v, dict):
        return sum(_values_nbytes(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return sum(_values_nbytes(x) for x in v)
    return 0


def same(a: Any, b: Any) -> bool:
    """Bit-identical values (arrays: dtype, shape, bytes; floats by bits; types exact)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return np.float64(a).tobytes() == np.float64(b).tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def mutate(raw: bytes, case: dict[str, Any]) -> bytes:
    kind = case["kind"]
    if kind == "flip":
        b = bytearray(raw)
        b[case["bit"] // 8] ^= 1 << (case["bit"] % 8)
        return bytes(b)
    if kind == "truncate":
        return raw[: case["length"]]
    if kind == "append":
        return raw + b"\x00" * case["extra"]
    from forgeries import forge

    return forge(case["db_type"], case["forgery"], raw)


def load_paths(db_type: str) -> list[str]:
    return ["read", "partial", "mmap", "check"] if db_type == "native" else ["read", "partial", "check"]


def run_load(db_type: str, how: str, path: str) -> Any:
    from epochal.storage.formats.base import get_db_type

    backend = get_db_type(db_type)
    if how == "read":
        return backend.read(path)
    if how == "partial":
        return backend.read(path, ["layer33.w", "tree"])
    if how == "mmap":
        from epochal.storage.formats.native import open_native

        with open_native(path) as f:
            return {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in f.read().items()}
    return backend.check(path)


def worker(base_dir: str, mem_limit: int) -> None:
    """Read cases (JSON lines) on stdin, answer one JSON line each on stdout."""
    import resource
    import tracemalloc
    import warnings

    warnings.simplefilter("ignore")
    resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
    from epochal import errors

    documented = tuple(getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)
                       and issubclass(getattr(errors, n), errors.CheckpointError)) \
        if hasattr(errors, "__all__") else (errors.CheckpointError,)
    raws = {t: Path(base_dir, f"base.{t}").read_bytes() for t in DB_TYPES}
    refs = {t: run_load(t, "read", str(Path(base_dir, f"base.{t}"))) for t in DB_TYPES}
    tmp = tempfile.mkdtemp(prefix="fuzz.", dir=base_dir)
    for line in sys.stdin:
        case = json.loads(line)
        t = case["db_type"]
        path = os.path.join(tmp, f"case.{t}")
        data = mutate(raws[t], case)
        with open(path, "wb") as f:
            f.write(data)
        size = len(data)
        results = {}
        for how in load_paths(t):
            tracemalloc.start()
            t0 = time.perf_counter()
            try:
                got = run_load(t, how, path)
                err = None
            except BaseException as e:  # noqa: BLE001 - classified below
                got, err = None, e
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            r: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 4), "peak": peak,
                                 "returned": _values_nbytes(got)}
            if how == "check":
                r["outcome"] = "problems" if got else ("error" if err is not None else "clean")
                if err is not None:
                    r["error"] = f"{type(err).__name__}: {str(err)[:200]}"
                    r["outcome"] = "undocumented"
            elif err is None:
                ref = refs[t] if how != "partial" else {k: refs[t][k] for k in ("layer33.w", "tree")}
                r["outcome"] = "same" if same(ref, got) else "silent"
            elif isinstance(err, documented) and path in str(err):
                r["outcome"] = "detected"
            elif isinstance(err, documented):
                r["outcome"] = "unnamed"
                r["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            else:
                r["outcome"] = "undocumented"
                r["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            results[how] = r
            del got, err
        sys.stdout.write(json.dumps({"id": case["id"], "size": size, "results": results}) + "\n")
        sys.stdout.flush()


# ---------------------------------------------------------------- the parent
class Worker:
    def __init__(self, base_dir: str, mem_limit: int) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", base_dir, "--mem-limit", str(mem_limit)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env,
        )
        self.case: dict[str, Any] | None = None
        self.since = 0.0

    def send(self, case: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.case, self.since = case, time.monotonic()
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def run_cases(cases: list[dict[str, Any]], base_dir: str, workers: int = 1, timeout: float = TIMEOUT,
              mem_limit: int = 3 << 30, progress: bool = False) -> list[dict[str, Any]]:
    """Every case through worker processes; a case that runs past ``timeout`` (per load path
    set) is recorded as a hang and its worker replaced."""
    for i, c in enumerate(cases):
        c["id"] = i
    todo: Iterator[dict[str, Any]] = iter(cases)
    pool = [Worker(base_dir, mem_limit) for _ in range(max(1, workers))]
    out: list[dict[str, Any]] = []
    busy: list[Worker] = []
    for w in pool:
        c = next(todo, None)
        if c is not None:
            w.send(c)
            busy.append(w)
    while busy:
        fds = {w.proc.stdout.fileno(): w for w in busy if w.proc.stdout is not None}
        ready, _, _ = select.select(list(fds), [], [], 0.5)
        now = time.monotonic()
        for fd in ready:
            w = fds[fd]
            assert w.proc.stdout is not None
            line = w.proc.stdout.readline()
            assert w.case is not None
            if not line:  # the worker died (a crash is a failure of its own)
                out.append({**w.case, "results": {"worker": {"outcome": "crash", "seconds": now - w.since}}})
                busy.remove(w)
                w = Worker(base_dir, mem_limit)
            else:
                res = json.loads(line)
                out.append({**w.case, "size": res["size"], "results": res["results"]})
                busy.remove(w)
            c = next(todo, None)
            if c is not None:
                w.send(c)
                busy.append(w)
            else:
                w.kill()
            if progress and len(out) % 500 == 0:
                print(f"  {len(out)}/{len(cases)} cases", file=sys.stderr, flush=True)
        for w in list(busy):
            if w.case is not None and now - w.since > timeout and w not in [fds.get(f) for f in ready]:
                out.append({**w.case, "results": {"worker": {"outcome": "hang", "seconds": now - w.since}}})
                w.kill()
                busy.remove(w)
                c = next(todo, None)
                if c is not None:
                    nw = Worker(base_dir, mem_limit)
                    nw.send(c)
                    busy.append(nw)
    return sorted(out, key=lambda r: r["id"])


def summarize(results: list[dict[str, Any]], slack: int) -> dict[str, Any]:
    """Counts per db type and outcome, the failures, the worst memory ratio."""
    summary: dict[str, Any] = {}
    failures = []
    for r in results:
        t = r["db_type"]
        s = summary.setdefault(t, {"cases": 0, "loads": 0, "outcomes": Counter(), "kinds": Counter(),
                                   "regions": Counter(), "max_seconds": 0.0, "max_excess": -(2**62),
                                   "over_memory": 0, "verify_disagrees": 0})
        s["cases"] += 1
        s["kinds"][r["kind"]] += 1
        s["regions"][r["region"]] += 1
        outcomes = {}
        for how, x in r["results"].items():
            s["loads"] += 1
            s["outcomes"][x["outcome"]] += 1
            if how == "read" and x["outcome"] == "same" and r["kind"] != "append":
                s["outcomes"]["same_full"] += 1
            outcomes[how] = x["outcome"]
            s["max_seconds"] = max(s["max_seconds"], x.get("seconds", 0.0))
            if "peak" in x:
                excess = x["peak"] - 2 * r.get("size", 0) - x["returned"]
                s["max_excess"] = max(s["max_excess"], excess)
                if excess > slack:
                    s["over_memory"] += 1
                    failures.append((r, how, f"peak {x['peak']} bytes for a {r.get('size')}-byte file"))
            if x["outcome"] in ("silent", "undocumented", "unnamed", "hang", "crash"):
                failures.append((r, how, x.get("error", x["outcome"])))
        loads = [o for h, o in outcomes.items() if h in ("read", "partial", "mmap")]
        if "check" in outcomes and (
            (outcomes["check"] == "clean" and "detected" in loads)
            or (outcomes["check"] == "problems" and loads and all(o == "same" for o in loads))
        ):
            s["verify_disagrees"] += 1
            failures.append((r, "check", f"check says {outcomes['check']}, loads {loads}"))
    return {"by_type": summary, "failures": failures}


def report(summary: dict[str, Any], slack: int, seconds: float, args: argparse.Namespace) -> str:
    lines = [
        f"fuzz: seed {args.seed}, {args.flips} flips and {args.truncations} truncations per db type, "
        f"timeout {args.timeout:g} s, memory slack {slack >> 10} KiB, {seconds:.0f} s",
        "",
        "| db type | cases | loads | same | same (full read of a damaged file) | detected | silent | undocumented | unnamed | hangs | crashes "
        "| over memory | verify disagrees | max s | max excess KiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t, s in summary["by_type"].items():
        o = s["outcomes"]
        lines.append(
            f"| {t} | {s['cases']} | {s['loads']} | {o['same']} | {o['same_full']} | {o['detected'] + o['problems']} | "
            f"{o['silent']} | {o['undocumented']} | {o['unnamed']} | {o['hang']} | {o['crash']} | "
            f"{s['over_memory']} | {s['verify_disagrees']} | {s['max_seconds']:.2f} | "
            f"{max(0, s['max_excess']) >> 10} |"
        )
    for t, s in summary["by_type"].items():
        lines.append("")
        lines.append(f"{t} cases by region: " + ", ".join(f"{k} {v}" for k, v in sorted(s["regions"].items())))
    fails = summary["failures"]
    lines.append("")
    lines.append(f"{len(fails)} failure(s)" + (":" if fails else ""))
    for r, how, why in fails[:40]:
        what = {k: v for k, v in r.items() if k not in ("results", "id", "size")}
        lines.append(f"- {what} {how}: {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flips", type=int, default=10_000, help="single-bit flips per db type")
    ap.add_argument("--truncations", type=int, default=500, help="truncations per db type")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=TIMEOUT)
    ap.add_argument("--slack", type=int, default=1 << 20, help="bytes allowed above 2x file + values")
    ap.add_argument("--mem-limit", type=int, default=3 << 30, help="RLIMIT_AS of each worker")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.mem_limit)
        return 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="epochal-fuzz.", dir=args.dir) as d:
        rng = np.random.default_rng(args.seed)
        cases: list[dict[str, Any]] = []
        for t in DB_TYPES:
            raw = Path(write_base(d, t)).read_bytes()
            cases += flip_cases(raw, t, args.flips, rng)
            cases += truncation_cases(raw, t, args.truncations, rng)
            cases += forge_cases(t)
        results = run_cases(cases, d, args.workers, args.timeout, args.mem_limit, progress=True)
    summary = summarize(results, args.slack)
    print(report(summary, args.slack, time.monotonic() - t0, args))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
