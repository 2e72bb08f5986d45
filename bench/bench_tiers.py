"""The local tier under torch.distributed: blocked time per save, and how fast a restarted job resumes.

``--ranks`` (2) gloo processes on 127.0.0.1, started as torchrun starts them, each holding
``--mib`` MiB of float32 DTensor shards (its part of the model and optimizer state), each rank
with its own local directory (``<dir>/node<r>``, standing for its own machine's /dev/shm):

1. a run saves every step with ``async_save``, ``local=``, ``replicas=1``,
   ``persist_every=--persist``: the time ``save`` blocks training at a step that goes to the
   local tier only, against a copy of the same shards into allocated memory (medians, paired
   per step);
2. the job is restarted (fresh processes) and the time from a process's first line to its first
   training step is measured, per rank, for a resume from the local tiers, from the store on disk
   with its files evicted from the page cache (the local tiers wiped), and from the peer (rank
   1's machine replaced: its local directory wiped); each resume's state is checked bit-identical
   to the state saved at that step;
3. peak RSS of each rank and the bytes in the local directories, against what docs/tiers.md
   states.

The restart's parts are listed too (the imports, the process group, the Checkpointer opened,
the restore call), and ``--rounds`` resume rounds rotate the order of the three. ``--profile``
times the parts of each save (the snapshot, the wait for the previous save, the local write,
the copies to the peers); ``--train-only`` stops after the saves. ``--device cuda``: the
shards live on the GPU (every rank on ``cuda:<local rank % devices>``; the group is still gloo),
a save's blocked time is then its device-to-host copy, measured against a copy of the same
shards into pinned host memory. ``--when-busy skip``: a save that would wait for the previous
one's background work is skipped (the steps skipped are listed).

``--store s3://bucket/prefix``: the store is S3, moto's server started on 127.0.0.1 for the
run (bench/_requests.py's ``moto_server``, its own process) and stopped at the end; the ranks
get its endpoint and keys as the Checkpointer's ``storage_options`` (from the environment
variable ``BENCH_TIERS_S3``, JSON).

    python bench/bench_tiers.py --mib 512 --dir /dev/shm/bt --store /tmp/bt_store --rounds 3
    python bench/bench_tiers.py --mib 512 --dir /dev/shm/bt --store s3://bench/tiers --rounds 3
"""

from __future__ import annotations

T_START = __import__("time").perf_counter()  # the process's first line

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
N_TENSORS = 8
S3_ENV = "BENCH_TIERS_S3"  # the storage options of an s3:// store, JSON, for the ranks


def is_s3(store: str) -> bool:
    return store.startswith("s3://")


def start_s3(store: str) -> Any:
    """moto's S3 server with the bucket of ``store``; its storage options go to the ranks
    through the environment. Returns the server's process."""
    sys.path.insert(0, HERE)
    from _requests import moto_server

    server, opts = moto_server(store[len("s3://"):].split("/")[0])
    os.environ[S3_ENV] = json.dumps(opts)
    return server


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def profiled() -> dict[str, list[float]]:
    """Time the parts of a save (``--profile``): on the training thread, the state dict
    (``dcp_state``), the wait for the previous save (``wait``), the snapshot
    (``snapshot``); on the tier's thread, the local write (``write``) and the copies to the
    peers (``replicate``). A CUDA state is planned and staged on the training thread
    (``write``, of which ``stage`` the copies to pinned memory) and written on the tier's
    (``write_deferred``). Returns {part: [seconds per call]}."""
    import functools

    from epochal.integrations.dcp.staging import HostStaging
    from epochal.integrations.dcp.storage import EpochalStorageWriter
    from epochal.integrations.distributed import checkpointer as dc
    from epochal.integrations.distributed import tier as rt

    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def run(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                times.setdefault(name, []).append(time.perf_counter() - t0)
        return run

    dc.dcp_state = timed("dcp_state", dc.dcp_state)
    dc.DistributedCheckpointer.wait = timed("wait", dc.DistributedCheckpointer.wait)
    HostStaging.snapshot_state = timed("snapshot", HostStaging.snapshot_state)
    HostStaging.snapshot = timed("stage", HostStaging.snapshot)  # (CUDA: inside the planning)
    rt.dcp_save = timed("write", rt.dcp_save)  # (CUDA: the planning and staging, on this thread)
    EpochalStorageWriter.write_deferred = timed("write_deferred", EpochalStorageWriter.write_deferred)
    rt.RankTier._exchange = timed("replicate", rt.RankTier._exchange)
    return times


@contextlib.contextmanager
def requests_counted(store: str) -> Any:
    """The S3 requests of this process inside the block (bench/_requests.py's
    ``count_requests``) for an s3:// store; None for a directory."""
    if not is_s3(store):
        yield None
        return
    sys.path.insert(0, HERE)
    from _requests import count_requests

    with count_requests() as seen:
        yield seen


def worker(a: argparse.Namespace) -> None:
    """One rank: ``--phase train`` (save every step) or ``--phase resume`` (restore, one step)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import epochal
    from epochal.integrations.dcp.staging import HostStaging

    HostStaging.OFF_DEVICE = a.staging == "off-device"
    t_imported = time.perf_counter()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh(a.device, (world,))
    t_group = time.perf_counter()
    rows = max(world, int(a.mib * world * (1 << 20) / 4 / N_TENSORS / 1024) // world * world)
    g = torch.Generator().manual_seed(rank)
    # each rank's own shard, made in place (a resume's shards are overwritten by the restore)
    shard = (lambda: torch.empty(rows // world, 1024, device=a.device)) if a.phase == "resume" else (
        lambda: torch.rand(rows // world, 1024, generator=g).to(a.device))
    state: dict[str, object] = {f"t{i}": DTensor.from_local(shard(), mesh, [Shard(0)], run_check=False)
                                for i in range(N_TENSORS)}
    locals_ = [t.to_local() for t in state.values()]  # type: ignore[attr-defined]
    out: dict[str, object] = {"rank": rank}
    parts = profiled() if a.profile and a.phase == "train" else None

    def digest() -> str:
        h = hashlib.sha256()
        for t in state.values():
            h.update(t.to_local().cpu().contiguous().view(torch.uint8).numpy().tobytes())  # type: ignore[attr-defined]
        return h.hexdigest()

    def step_() -> None:
        for t in locals_:
            t.add_(1.0)

    store = a.store if is_s3(a.store) else os.path.join(a.dir, "store")
    opts = json.loads(os.environ[S3_ENV]) if is_s3(a.store) else None
    with epochal.Checkpointer(store, storage_options=opts, local=os.path.join(a.dir, f"node{rank}"),
                              persist_every=a.persist, local_keep=2, replicas=1, replica_stride=1,
                              async_save=True, when_busy=a.when_busy) as ck:
        if a.phase == "train":
            into = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in locals_]
            blocked, copies = [], []
            every: list[tuple[float, float]] = []  # every save from step 3 on, the K-th ones too
            for step in range(1, a.steps + 1):
                time.sleep(a.step_s)  # the step's compute (on an accelerator: no CPU)
                step_()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                ck.save(step, state)
                dt = time.perf_counter() - t0
                t0 = time.perf_counter()
                for src, dst in zip(locals_, into):
                    dst.copy_(src, non_blocking=cuda)
                if cuda:
                    torch.cuda.synchronize()
                copied = time.perf_counter() - t0
                if step > 2:  # (warm memory)
                    every.append((dt, copied))
                if step > 2 and step % a.persist:  # a save to the local tier only
                    blocked.append(dt)
                    copies.append(copied)
            ck.wait()
            out["skipped"] = list(ck.skipped)
            out.update(blocked=statistics.median(blocked), memcpy=statistics.median(copies),
                       ratio=statistics.median(b / c for b, c in zip(blocked, copies)),
                       total_ratio=sum(blocked) / sum(copies), digest=digest(),
                       step=a.steps, pairs=list(zip(blocked, copies)),
                       every_ratio=sum(b for b, _ in every) / sum(c for _, c in every), every=every)
            if parts is not None:
                out["parts"] = parts
        else:
            with requests_counted(a.store) as requests:  # (an s3:// store: its requests, by kind)
                t_open = time.perf_counter()
                step = ck.restore(state)
                t_restored = time.perf_counter()
            if requests is not None:
                out["requests"] = dict(requests.by_method)
            out["digest"] = digest()  # (its time is not counted)
            checked = time.perf_counter() - t_restored
            step_()  # the first training step
            out.update(resume_s=time.perf_counter() - T_START - checked, step=step,
                       source=ck.last_restore.source if ck.last_restore else None,
                       imported_s=t_imported - T_START, group_s=t_group - T_START, opened_s=t_open - T_START,
                       restore_call_s=t_restored - t_open, through_restore_s=t_restored - T_START)
    sys.path.insert(0, HERE)
    from _measure import _hwm

    # VmHWM, this process's own peak: ru_maxrss keeps the parent's across exec (a bench
    # parent that had just read 1 GiB made every rank started after it look that big)
    out["peak_rss"] = _hwm() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(a.dir, f"{a.phase}.{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def ranks(a: argparse.Namespace, phase: str) -> list[dict[str, object]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(a.ranks):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(a.ranks),
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "EPOCHAL_QUIET": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--phase", phase, "--dir", a.dir,
                                       "--mib", str(a.mib), "--steps", str(a.steps), "--persist", str(a.persist),
                                       "--step-s", str(a.step_s), "--device", a.device, "--staging", a.staging,
                                       "--when-busy", a.when_busy, "--store", a.store]
                                      + (["--profile"] if a.profile else []),
                                      env=env))
    for p in procs:
        if p.wait(timeout=1800):
            raise SystemExit(f"rank failed in phase {phase}: exit {p.returncode}")
    return [json.loads(open(os.path.join(a.dir, f"{phase}.{r}.json")).read()) for r in range(a.ranks)]


def plain_get(store: str, step: int) -> dict[str, float]:
    """A plain s3fs GET of each db of ``step`` under an s3:// ``store`` (whole objects, one
    thread each, at once, as the ranks read them): the floor of any restore from this
    server, checking nothing. {"s": seconds, "bytes": bytes, "objects": count}."""
    import threading

    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **json.loads(os.environ[S3_ENV]))
    names = [f for f in fs.find(store) if f".{step}." in f.rsplit("/", 1)[-1]]
    got: list[int] = []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lambda n=n: got.append(len(fs.cat_file(n)))) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"s": time.perf_counter() - t0, "bytes": float(sum(got)), "objects": float(len(names))}


def evict_tree(path: str) -> None:
    sys.path.insert(0, HERE)
    from _measure import evict

    for d, _, fs in os.walk(path):
        for f in fs:
            evict(os.path.join(d, f))


def report(a: argparse.Namespace, store: str, train: list[dict[str, Any]],
           results: dict[str, list[list[dict[str, Any]]]], local_bytes: list[int],
           gets: list[dict[str, float]]) -> None:
    """Print every figure: each step's pair, each round's resume, the medians and ratios
    (and, for an s3:// store, the plain GETs of the step's dbs after each durable resume)."""
    med = statistics.median
    print(f"bench_tiers.py: {a.ranks} ranks (gloo), {a.mib:g} MiB of state per rank, a save every step "
          f"of {a.step_s:g} s (async, replicas=1), every {a.persist}th to the store ({store}); "
          f"load {os.getloadavg()[0]:.1f}, {a.rounds} resume rounds")
    for g in train:
        pairs = " ".join(f"{b * 1e3:.0f}/{c * 1e3:.0f}" for b, c in g["pairs"])
        print(f"  rank {g['rank']}: blocked per local save {g['blocked'] * 1e3:.1f} ms, memcpy of the state "
              f"{g['memcpy'] * 1e3:.1f} ms: ratio {g['ratio']:.2f}x (median of paired steps; in all "
              f"{g['total_ratio']:.2f}x; every save from step 3, the K-th too, {g['every_ratio']:.2f}x in all; "
              f"ms blocked/memcpy "
              f"per step: {pairs}); skipped steps {g['skipped']}")
    keys = ("imported_s", "group_s", "opened_s", "through_restore_s", "restore_call_s", "resume_s")
    for name, rounds in results.items():
        for i, got in enumerate(rounds):
            per = "; ".join(f"rank {g['rank']} ({g['source']}): " + " ".join(f"{g[k]:.2f}" for k in keys)
                            for g in got)
            print(f"  resume {name} round {i + 1} [import, group, opened, through restore, restore call, "
                  f"first step] s: {per}")
            for g in got:
                if g.get("requests"):
                    print(f"    rank {g['rank']}: S3 requests of the restore call: "
                          + ", ".join(f"{k} {v}" for k, v in sorted(g["requests"].items())))
    slowest = {n: [max(g["resume_s"] for g in got) for got in rounds] for n, rounds in results.items()}
    call = {n: [max(g["restore_call_s"] for g in got) for got in rounds] for n, rounds in results.items()}
    floor = {n: [max(g["opened_s"] for g in got) for got in rounds] for n, rounds in results.items()}
    for n in results:
        print(f"  {n}: first line to first step {med(slowest[n]):.2f} s, the restore call {med(call[n]):.2f} s, "
              f"before it (interpreter, imports, group, Checkpointer) {med(floor[n]):.2f} s (medians, slowest rank)")
    for i, g in enumerate(gets):
        print(f"  plain GET of step {a.steps}'s {g['objects']:.0f} objects ({g['bytes'] / (1 << 20):.0f} MiB, at once) "
              f"after durable round {i + 1}: {g['s']:.2f} s; the durable restore call / it: "
              f"{call['durable'][i] / g['s']:.1f}x; the local restore call / it: {call['local'][i] / g['s']:.2f}x")
    for n in ("local", "peer"):
        whole = [x / y for x, y in zip(slowest[n], slowest["durable"])]
        alone = [x / y for x, y in zip(call[n], call["durable"])]
        print(f"  {n}/durable: first line to first step {med(whole):.2f}x [{min(whole):.2f}-{max(whole):.2f}], "
              f"the restore call {med(alone):.2f}x [{min(alone):.2f}-{max(alone):.2f}] (medians of paired rounds)")
    state = a.mib * (1 << 20)
    for r, g in enumerate(train):
        print(f"  rank {r}: peak RSS {g['peak_rss'] / (1 << 20):.0f} MiB; local dir {local_bytes[r] / (1 << 20):.0f}"
              f" MiB = {local_bytes[r] / state:.2f}x the state (docs: (local_keep + replicas*local_keep) = 4x)")
    for name, rounds in results.items():
        rss = ", ".join(f"{g['peak_rss'] / (1 << 20):.0f}" for g in rounds[0])
        print(f"  peak RSS of a resume from {name} (MiB, per rank): {rss}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mib", type=float, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--persist", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=1.0, help="seconds of compute per step (a sleep)")
    ap.add_argument("--dir", default="/dev/shm/bench_tiers")
    ap.add_argument("--store", default="", help="the store's directory (default: <dir>/store, on /dev/shm "
                                                "only when --dir is; give a disk path for disk figures), or "
                                                "s3://bucket/prefix: moto's S3 server on 127.0.0.1")
    ap.add_argument("--rounds", type=int, default=3, help="resume rounds (each: local, durable, peer, rotated)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the shards live")
    ap.add_argument("--when-busy", choices=("wait", "skip"), default="wait",
                    help="skip: a save that would wait for the previous one's background work is skipped")
    ap.add_argument("--staging", choices=("off-device", "deferred"), default="off-device",
                    help="a CUDA state's snapshot: host copies planned in the background (the default), or "
                         "planned on the training thread and staged as written")
    ap.add_argument("--profile", action="store_true", help="time the parts of each save (see profiled())")
    ap.add_argument("--train-only", action="store_true", help="the saves only, no resume")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--phase", default="train")
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    store = a.store or os.path.join(a.dir, "store")
    on_disk = bool(a.store) and not is_s3(a.store)
    server = start_s3(a.store) if is_s3(a.store) else None
    if on_disk:
        shutil.rmtree(store, ignore_errors=True)
        os.symlink(os.path.abspath(store), os.path.join(a.dir, "store"), target_is_directory=True)
        os.makedirs(store)
    try:
        train = ranks(a, "train")
        if a.train_only:
            for g in train:
                pairs = " ".join(f"{b * 1e3:.0f}/{c * 1e3:.0f}" for b, c in g["pairs"])
                print(f"rank {g['rank']}: blocked {g['blocked'] * 1e3:.0f} ms, memcpy {g['memcpy'] * 1e3:.0f} ms, "
                      f"ratio {g['ratio']:.2f}x (in all {g['total_ratio']:.2f}x); every save from step 3, the K-th "
                      f"too: {g['every_ratio']:.2f}x in all (" + " ".join(f"{b * 1e3:.0f}" for b, _ in g["every"])
                      + f" ms); per step {pairs}; peak RSS {g['peak_rss'] >> 20} MiB; "
                      f"skipped steps {g['skipped']}")
                for name, ts in g.get("parts", {}).items():
                    print(f"    {name}: " + " ".join(f"{t * 1e3:.0f}" for t in ts) + " ms")
            return
        saved = {r["rank"]: r["digest"] for r in train}
        local_bytes = [dir_bytes(os.path.join(a.dir, f"node{r}")) for r in range(a.ranks)]
        keep = os.path.join(a.dir, "keep")
        for r in range(a.ranks):
            shutil.copytree(os.path.join(a.dir, f"node{r}"), os.path.join(keep, f"node{r}"))

        def reset(wipe: list[int]) -> None:
            for r in range(a.ranks):
                shutil.rmtree(os.path.join(a.dir, f"node{r}"), ignore_errors=True)
                if r not in wipe:
                    shutil.copytree(os.path.join(keep, f"node{r}"), os.path.join(a.dir, f"node{r}"))
            if server is None:  # (S3: the server holds the objects)
                evict_tree(store)

        cases = [("local", []), ("durable", list(range(a.ranks))), ("peer", [1])]
        results: dict[str, list[list[dict[str, Any]]]] = {name: [] for name, _ in cases}
        gets: list[dict[str, float]] = []  # (S3) a plain GET of the step's dbs after each durable resume
        for rnd in range(a.rounds):  # the order rotates from round to round
            for name, wipe in cases[rnd % len(cases):] + cases[:rnd % len(cases)]:
                reset(wipe)
                got = ranks(a, "resume")
                assert all(g["step"] == a.steps for g in got), got
                assert all(g["digest"] == saved[g["rank"]] for g in got), f"{name}: not bit-identical"
                results[name].append(got)
                if name == "durable" and server is not None:
                    gets.append(plain_get(store, a.steps))
        report(a, store, train, results, local_bytes, gets)
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)
        if on_disk:
            shutil.rmtree(store, ignore_errors=True)
        if server is not None:
            server.terminate()
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
