"""A training job that is killed on purpose, and the harness that kills it.

Run as a script, it trains a small numpy job (two nodes, several blobs of a few MB, so each
save takes a noticeable time) with a DirectoryMetadataHandler, printing markers on stdout::

    RESUME <epoch|none>          what the handler chose
    LOADED <epoch> <hash>        the state just loaded from the checkpoint of <epoch>
    SAVE <epoch> / SAVED <epoch> a checkpoint save begins / was committed
    EPOCH <epoch> <hash>         the state after training <epoch>
    DONE <epoch> <hash>          train() returned <epoch> with this final state

``<hash>`` is a SHA-256 over every checkpointed blob (name, dtype, shape, bytes), so equal
hashes mean bit-identical values. Imported, it offers :func:`reference_run` and
:func:`run_trial`, used by tests/test_kill.py (>= 30 SIGKILLs) and bench/soak_kill.py
(hundreds). No pickle anywhere: processes talk through stdout lines.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
NODES = ("trainer_0", "trainer_1")


def state_hash(ws: Any) -> str:
    """SHA-256 over the checkpointed blobs (those listed in ``blob_names``), sorted by name."""
    h = hashlib.sha256()
    for name in sorted(str(n) for n in ws["blob_names"].tolist()):
        value = np.asarray(ws[name])
        h.update(name.encode())
        h.update(value.dtype.str.encode())
        h.update(repr(value.shape).encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()[:32]


def _say(*parts: Any) -> None:
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """The job itself (child process)."""
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--mb", type=float, default=2.0, help="size of each of the 3 big blobs")
    p.add_argument("--epoch-ms", type=float, default=10.0, help="extra time spent in each epoch")
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--keep-every", type=int, default=None)
    p.add_argument("--incremental", action="store_true", help="incremental dbs (DirectoryMetadataHandler)")
    args = p.parse_args(argv)

    from epochal import (
        Cluster,
        DirectoryMetadataHandler,
        Job,
        JobRunner,
        LocalSession,
        MultiNodeCheckpointManager,
        Node,
        RunListener,
        Task,
        Workspace,
        epoch_limiter,
    )

    n = max(1, int(args.mb * 1e6 / 8))

    def init(ws: Any) -> None:
        rng = np.random.default_rng(1234)
        ws["w_a"] = rng.standard_normal(n * 2).astype(np.float32)
        ws["w_b"] = rng.standard_normal(n)
        ws["w_c"] = rng.integers(0, 1 << 40, size=n, dtype=np.int64)
        ws["step"] = np.int64(0)
        ws["log"] = np.zeros(0, dtype=np.int64)
        if args.incremental:  # bytes that later epochs share: a frozen blob, a table of rows
            ws["frozen"] = rng.standard_normal(n * 2).astype(np.float32)
            ws["rows"] = rng.standard_normal((n // 64, 64)).astype(np.float32)

    def train_epoch(ws: Any) -> None:
        e = int(ws["step"]) + 1
        ws["step"] = np.int64(e)
        ws["w_a"] = (ws["w_a"] * np.float32(0.999) + np.float32(e) / 7).astype(np.float32)
        ws["w_b"] = np.roll(ws["w_b"], e) * 1.0001 - e * 1e-3
        ws["w_c"] = ws["w_c"] ^ np.int64((e * 2654435761) & ((1 << 40) - 1))
        ws["log"] = np.append(ws["log"], np.int64(e * 1000 + int(ws["w_c"][e % n]) % 1000))
        if args.incremental:  # 2% of the rows change
            rows = ws["rows"].copy()
            rows[np.random.default_rng(e).choice(len(rows), max(1, len(rows) // 50), replace=False)] += np.float32(e)
            ws["rows"] = rows
        if args.epoch_ms:
            time.sleep(args.epoch_ms / 1000)

    ws = Workspace()

    def report_epoch(w: Any) -> None:
        _say("EPOCH", int(ws["step"]), state_hash(ws))

    class Markers(RunListener):
        def on_train_start(self, resume_epoch: int | None, nodes: list[str]) -> None:
            _say("RESUME", "none" if resume_epoch is None else resume_epoch)

        def on_checkpoint_start(self, action: str, epoch: int) -> None:
            if action == "checkpoint_save":
                _say("SAVE", epoch)

        def on_checkpoint(self, event: Any) -> None:
            if event.action == "checkpoint_save" and event.ok:
                _say("SAVED", event.epoch)
                if event.epoch == 0:
                    _say("EPOCH", 0, state_hash(ws))
            elif event.action == "checkpoint_load":
                _say("LOADED", event.epoch, state_hash(ws))

    with Cluster():
        with Job(nodes_to_checkpoint=list(NODES)) as job:
            with Node(NODES[0]):
                with job.init_group:
                    Task(step=init)
                epoch_limiter(job, args.epochs)  # first, so EPOCH hashes include its count
                Task(step=[train_epoch, report_epoch])
        handler = DirectoryMetadataHandler(keep_last=args.keep_last, keep_every=args.keep_every,
                                           incremental=args.incremental)
        manager = MultiNodeCheckpointManager(args.dir, "native", metadata_handler=handler)
        last = JobRunner(job, manager, listeners=[Markers()], progress=False).train(LocalSession(ws))
    _say("DONE", last, state_hash(ws))
    return 0


# ---------------------------------------------------------------------------- in-process jobs

@dataclass
class Counts:
    """How often each group ran (for tests of what a rerun does)."""

    epochs: list[int] = field(default_factory=list)
    downloads: int = 0
    exits: int = 0


def build_job(
    epochs: int,
    nodes: tuple[str, ...] = ("trainer_0",),
    size: int = 1000,
    hook: Any = None,
) -> tuple[Any, Counts]:
    """A small deterministic numpy job (in this process): blobs ``w`` (float64), ``v``
    (float32), ``ids`` (int64), ``step`` and an epoch countdown, stopped after ``epochs``.
    ``hook(epoch, ws)`` runs at the end of each epoch (to raise, signal or count)."""
    from epochal import Job, Node, Task

    counts = Counts()

    def init(ws: Any) -> None:
        rng = np.random.default_rng(7)
        ws["w"] = rng.standard_normal(size)
        ws["v"] = rng.standard_normal(size).astype(np.float32)
        ws["ids"] = np.arange(size, dtype=np.int64)
        ws["step"] = np.int64(0)
        ws["epochs_left"] = np.int64(epochs - 1)

    def countdown(ws: Any) -> None:
        # epoch_limiter's logic with fixed blob names: its names are numbered per process, so
        # a job rebuilt in the same process would not find its saved counter.
        before = int(ws["epochs_left"])
        ws["epochs_left"] = np.int64(before - 1)
        ws["stop"] = np.bool_(before <= 0)

    def train(ws: Any) -> None:
        e = int(ws["step"]) + 1
        ws["step"] = np.int64(e)
        ws["w"] = ws["w"] * 0.9 + e
        ws["v"] = (ws["v"] + np.float32(e)).astype(np.float32)
        ws["ids"] = np.roll(ws["ids"], e)
        counts.epochs.append(e)
        if hook is not None:
            hook(e, ws)

    def download(ws: Any) -> None:
        counts.downloads += 1

    def exit_(ws: Any) -> None:
        counts.exits += 1

    job = Job(nodes_to_checkpoint=list(nodes))
    with job:
        with Node(nodes[0]):
            with job.init_group:
                Task(step=init)
            stop = Task(step=countdown, outputs=["stop"], name="countdown")
            job.add_stop_condition(stop.outputs()[0])
            Task(step=train)
            with job.download_group:
                Task(step=download)
            with job.exit_group:
                Task(step=exit_)
    return job, counts


def model_blobs(ws: Any) -> dict[str, np.ndarray]:
    """The checkpointed blobs of ``ws`` (copies), for exact comparisons."""
    return {str(n): np.array(ws[str(n)], copy=True) for n in ws["blob_names"].tolist()}


def assert_same_blobs(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    """Bit-identical: same names, dtypes, shapes and bytes."""
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = np.asarray(a[name]), np.asarray(b[name])
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name


# ---------------------------------------------------------------------------- the harness

@dataclass
class Reference:
    """What an uninterrupted run prints."""

    epochs: dict[int, str]  # state hash after each epoch (0: after init)
    done: tuple[int, str]
    save_seconds: float  # typical duration of one epoch's save (both nodes)
    run_seconds: float


@dataclass
class TrialResult:
    """One trial: several killed runs of the job on one directory, then a run to the end."""

    kills: int = 0
    kills_in_save: int = 0  # a SAVE marker without its SAVED when the process died
    kills_leaving_temp: int = 0  # the kill left a temp file behind: it was inside a write
    resumes: list[int | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _cmd(directory: str, job_args: list[str]) -> list[str]:
    return [sys.executable, os.path.join(HERE, "_crash_job.py"), directory, *job_args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["EPOCHAL_QUIET"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def reference_run(directory: str, job_args: list[str]) -> Reference:
    """Run the job once, uninterrupted, in ``directory`` (which it fills), and record its
    hashes and timings."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        _cmd(directory, job_args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    assert proc.stdout is not None and proc.stderr is not None
    epochs: dict[int, str] = {}
    done: tuple[int, str] | None = None
    began: dict[int, float] = {}
    spans = []
    for line in proc.stdout:
        parts = line.split()
        now = time.perf_counter()
        if parts[0] == "EPOCH":
            epochs[int(parts[1])] = parts[2]
        elif parts[0] == "DONE":
            done = (int(parts[1]), parts[2])
        elif parts[0] == "SAVE":
            began[int(parts[1])] = now
        elif parts[0] == "SAVED" and int(parts[1]) in began:
            spans.append(now - began[int(parts[1])])
    err = proc.stderr.read()
    if proc.wait() != 0 or done is None:
        raise RuntimeError(f"reference run failed ({proc.returncode}):\n{err}")
    took = time.perf_counter() - start
    return Reference(epochs, done, float(np.median(spans)) if spans else 0.02, took)


def _hash_of_loaded(lines: list[str]) -> tuple[int, str] | None:
    for line in lines:
        parts = line.split()
        if parts and parts[0] == "LOADED":
            return int(parts[1]), parts[2]
    return None


def _resume_of(lines: list[str]) -> int | None | str:
    for line in lines:
        parts = line.split()
        if parts and parts[0] == "RESUME":
            return None if parts[1] == "none" else int(parts[1])
    return "?"


def _run_and_maybe_kill(
    directory: str, job_args: list[str], rng: random.Random, ref: Reference, kill: bool
) -> tuple[list[str], bool, int]:
    """Run the job; when ``kill``, SIGKILL it at a random moment, mostly inside a save.
    Returns (stdout lines, whether it was killed, return code)."""
    proc = subprocess.Popen(
        _cmd(directory, job_args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[str] = []
    killed = threading.Event()
    nepochs = len(ref.epochs)
    in_save = rng.random() < 0.8
    target = rng.randrange(0, nepochs + 1)  # the save to kill in (first one at or after it)
    delay = rng.uniform(0.0, 1.0) * ref.save_seconds
    stderr_chunks: list[str] = []

    def drain_stderr() -> None:
        assert proc.stderr is not None
        stderr_chunks.append(proc.stderr.read())

    err_thread = threading.Thread(target=drain_stderr, daemon=True)
    err_thread.start()

    def do_kill(after: float) -> None:
        time.sleep(after)
        if proc.poll() is None:
            killed.set()
            proc.send_signal(signal.SIGKILL)

    timer: threading.Thread | None = None
    if kill and not in_save:
        timer = threading.Thread(target=do_kill, args=(rng.uniform(0.05, 0.8) * ref.run_seconds,), daemon=True)
        timer.start()
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        parts = line.split()
        if kill and in_save and timer is None and parts and parts[0] == "SAVE" and int(parts[1]) >= target:
            timer = threading.Thread(target=do_kill, args=(delay,), daemon=True)
            timer.start()
    rc = proc.wait()
    if timer is not None:
        timer.join()
    err_thread.join()
    if rc != 0 and not killed.is_set():
        lines.append("STDERR " + "".join(stderr_chunks).replace("\n", "\\n"))
    return lines, killed.is_set(), rc


def _check_directory(directory: str) -> list[str]:
    """After a kill: every db under a checkpoint name is complete, every committed epoch
    verifies; returns problems."""
    from epochal import get_db_type
    from epochal.checkpoint.location.view import CheckpointDirectory
    from epochal.errors import CheckpointError

    d = CheckpointDirectory(directory)
    problems = []
    backend = get_db_type("native")
    for dbs in d.scan().values():
        for path in dbs.values():
            try:
                backend.verify(path)
            except CheckpointError as ex:
                problems.append(f"partial or damaged file under a checkpoint name: {ex}")
    for epoch in d.committed_epochs():
        problems.extend(d.verify_epoch(epoch, full=True))
    return problems


def _temp_files(directory: str) -> list[str]:
    from epochal.storage.io.atomic import parse_temp_path

    out: list[str] = []
    for folder in (directory, os.path.join(directory, ".epochal")):
        try:
            out.extend(n for n in os.listdir(folder) if parse_temp_path(n) is not None)
        except OSError:
            pass
    return out


def run_trial(directory: str, job_args: list[str], ref: Reference, seed: int, kills: int = 2) -> TrialResult:
    """Kill the job ``kills`` times (each rerun resumes), then let it finish; check after each
    kill that the directory is sound and that the rerun loads exactly the state the
    uninterrupted run had after that epoch, and at the end that the result is identical."""
    from epochal.checkpoint.location.view import CheckpointDirectory

    rng = random.Random(seed)
    res = TrialResult()
    d = CheckpointDirectory(directory)
    runs = 0
    while True:
        want_kill = res.kills < kills
        committed_before = d.committed_epochs()
        lines, killed, rc = _run_and_maybe_kill(directory, job_args, rng, ref, want_kill)
        runs += 1
        resume = _resume_of(lines)
        res.resumes.append(resume if not isinstance(resume, str) else None)
        # the run must have resumed from the newest committed epoch, and loaded its exact state
        expected_resume = committed_before[-1] if committed_before else None
        if resume != "?" and resume != expected_resume:
            res.errors.append(f"seed {seed} run {runs}: resumed from {resume}, newest committed was {expected_resume}")
        loaded = _hash_of_loaded(lines)
        if loaded is not None and ref.epochs.get(loaded[0], ref.done[1] if loaded[0] == ref.done[0] else None) != loaded[1]:
            res.errors.append(f"seed {seed} run {runs}: state loaded from epoch {loaded[0]} differs from the reference")
        if resume not in ("?", None) and loaded is None and not killed:
            res.errors.append(f"seed {seed} run {runs}: resumed from {resume} but printed no LOADED")
        for line in lines:
            parts = line.split()
            if parts and parts[0] == "EPOCH" and ref.epochs.get(int(parts[1])) != parts[2]:
                res.errors.append(f"seed {seed} run {runs}: state after epoch {parts[1]} differs from the reference")
        if killed:
            res.kills += 1
            saves = [ln.split() for ln in lines if ln.startswith(("SAVE ", "SAVED "))]
            if saves and saves[-1][0] == "SAVE":
                res.kills_in_save += 1
            if _temp_files(directory):
                res.kills_leaving_temp += 1
            res.errors.extend(f"seed {seed} after kill {res.kills}: {p}" for p in _check_directory(directory))
            continue
        if rc != 0:
            res.errors.append(f"seed {seed} run {runs}: exit code {rc}: {lines[-1] if lines else ''}")
            return res
        done = [ln.split() for ln in lines if ln.startswith("DONE ")]
        if not done:
            res.errors.append(f"seed {seed} run {runs}: no DONE line")
        elif (int(done[0][1]), done[0][2]) != ref.done:
            res.errors.append(f"seed {seed}: finished with {done[0][1:]} instead of {list(ref.done)}")
        if res.kills >= kills:
            if _temp_files(directory):
                res.errors.append(f"seed {seed}: temp files left after a clean run: {_temp_files(directory)}")
            return res
        # the job finished before the kill came: that run was a kill-free rerun; kill the next one
        # (a rerun of a finished job runs no epoch, so start over in a fresh directory)
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
        if runs > 4 * kills + 4:
            return res


if __name__ == "__main__":
    sys.exit(main())
