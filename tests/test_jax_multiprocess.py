"""The JAX door in a job of several processes: each process writes its own shards into a db
of its own, process 0 commits one step naming every db; a restore on any number of
processes (2 -> 2, 2 -> 1 with 8 devices, 1 -> 2) reads the chunks its shards overlap from
whichever db holds them, bit for bit; a process that dies before the commit leaves the
previous step the newest.

Every process is a fresh one (tests/_jax_mp_bits.py): two joined by ``jax.distributed`` on
127.0.0.1, or one with 8 CPU devices."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

jax = pytest.importorskip("jax")

from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.errors import CheckpointCorruptError  # noqa: E402
from epochal.jax.sources import ProcessesSource  # noqa: E402
from epochal.storage.encoding.chunks import check_cover, chunk_layout  # noqa: E402
from epochal.storage.formats.native.reads.ranges import RangedFile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BITS = os.path.join(HERE, "_jax_mp_bits.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(action: str, d: str, nproc: int, step: str, seed: int) -> list[subprocess.Popen[str]]:
    port = str(free_port())
    return [subprocess.Popen([sys.executable, BITS, action, d, str(nproc), str(i), port, step, str(seed)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(nproc)]


def job(action: str, d: str, nproc: int, step: str, seed: int) -> list[dict[str, Any]]:
    """Run ``action`` on ``nproc`` processes; each one's JSON line, by process."""
    procs = start(action, d, nproc, step, seed)
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-4000:]
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]  # (gloo writes lines of its own)
            assert lines, out[-4000:]
            outs.append(json.loads(lines[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def records(path: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each blob of a db: its kind and meta (a tree's leaves by their names)."""
    from epochal.jax.reads import stored_leaves

    f = RangedFile(path)
    try:
        return {"/".join(k): (s.kind, s.meta) for k, s in stored_leaves(f).items()}
    finally:
        f.close()


@pytest.mark.system
def test_two_processes_save_one_step_of_a_db_each_and_restore_on_two_and_on_one(tmp_path: Any) -> None:
    d = str(tmp_path)
    assert job("save", d, 2, "5", 0) == [{"saved": 5, "process": 0}, {"saved": 5, "process": 1}]
    # one db per process, one manifest naming both (sizes and digests), nothing else
    assert sorted(os.listdir(d)) == [".epochal", "proc0.5", "proc1.5"]
    view = CheckpointDirectory(d)
    assert view.committed_epochs() == [5]
    nodes = view.read_manifest(5).nodes
    assert sorted(nodes) == ["proc0", "proc1"]
    for node, entry in nodes.items():
        assert entry.file == f"{node}.5" and entry.size == os.path.getsize(os.path.join(d, entry.file))
    # each process wrote its own replica-0 shards, marked as its part of the array; process
    # 0 alone the replicated array and the plain value
    p0, p1 = records(os.path.join(d, "proc0.5")), records(os.path.join(d, "proc1.5"))
    assert sorted(p0) == ["b", "count", "one", "params/e", "params/w"] and sorted(p1) == ["params/e", "params/w"]
    for i, rec in enumerate((p0, p1)):
        for leaf in ("params/w", "params/e"):
            kind, meta = rec[leaf]
            assert kind == "torch.chunked_tensor" and meta["part"] == [i, 2], (leaf, meta)
            assert [c["offsets"][0] for c in meta["chunks"]] == [meta["shape"][0] // 2 * i] * 4
    assert p0["b"][0] == p0["one"][0] == "torch.tensor"
    # one process's db alone does not make the arrays: refused, naming the leaf and the db
    alone = ProcessesSource({"proc1": os.path.join(d, "proc1.5")})
    try:
        with pytest.raises(CheckpointCorruptError, match=r"params/w.*hold 256 elements of a tensor of 512"):
            alone.layout(("params", "w"), "params/w")
    finally:
        alone.close()
    # restored on 2 processes, then on 1 with 8 devices: on the saved specs and on their
    # transposes (each shard then spans chunks of both processes' dbs), every shard compared
    assert job("restore", d, 2, "5", 0) == [{"shards": [13, 13], "process": 0}, {"shards": [13, 13], "process": 1}]
    assert job("restore", d, 1, "-", 0) == [{"shards": [25, 25], "process": 0}]
    # a flipped byte in process 1's shards (the db's first data segment) is found before use
    with open(os.path.join(d, "proc1.5"), "r+b") as f:
        f.seek(64)
        b = f.read(1)
        f.seek(64)
        f.write(bytes([b[0] ^ 0x10]))
    out = subprocess.run([sys.executable, BITS, "restore", d, "1", "0", "0", "5", "0"], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 1 and "CheckpointCorruptError" in out.stderr and "proc1.5" in out.stderr, \
        out.stderr[-3000:]


@pytest.mark.system
def test_a_one_process_save_restores_on_two_processes(tmp_path: Any) -> None:
    d = str(tmp_path)
    assert job("save", d, 1, "3", 1) == [{"saved": 3, "process": 0}]
    assert sorted(os.listdir(d)) == [".epochal", "local.3"]
    assert job("restore", d, 2, "3", 1) == [{"shards": [13, 13], "process": 0}, {"shards": [13, 13], "process": 1}]


@pytest.mark.system
def test_a_process_dying_before_the_commit_leaves_the_previous_step_newest(tmp_path: Any) -> None:
    d = str(tmp_path)
    job("save", d, 2, "5", 0)
    procs = start("die", d, 2, "6", 2)
    try:
        assert procs[1].wait(timeout=240) == 17, procs[1].communicate()[1][-4000:]
        # process 1 wrote its db of step 6 and died; process 0 waits to agree, never commits
        assert os.path.exists(os.path.join(d, "proc1.6"))
        time.sleep(2)
        assert procs[0].poll() is None or procs[0].returncode != 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.communicate()
    view = CheckpointDirectory(d)
    assert view.committed_epochs() == [5]
    assert not os.path.exists(os.path.join(d, ".epochal", "manifest.6.json"))
    # a fresh restore of the newest step gets step 5's values (seed 0), bit for bit
    assert job("restore", d, 1, "-", 0) == [{"shards": [25, 25], "process": 0}]


@pytest.mark.system
def test_plain_values_that_differ_between_processes_are_refused_on_every_process(tmp_path: Any) -> None:
    d = str(tmp_path)
    job("save", d, 2, "5", 0)
    procs = start("differ", d, 2, "6", 0)
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 1 and "ValueError" in err and "plain values of the pytree" in err, err[-3000:]
    assert sorted(os.listdir(d)) == [".epochal", "proc0.5", "proc1.5"]  # nothing written
    assert CheckpointDirectory(d).committed_epochs() == [5]
    # an async save on one process only: refused on both before anything is written
    procs = start("mixed", d, 2, "6", 0)
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 1 and "ValueError" in err and "async_save differs between the processes ([0, 1]" \
            in err, err[-3000:]
    assert sorted(os.listdir(d)) == [".epochal", "proc0.5", "proc1.5"]


@pytest.mark.system
def test_a_step_of_several_processes_restores_into_numpy_and_torch_in_one_process(tmp_path: Any) -> None:
    d = str(tmp_path)
    job("save", d, 2, "5", 0)
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", _TORCH_RESTORE, d, BITS], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"leaves": 3, "count": 7}


# in a fresh process: numpy leaves of the abstract pytree come back as numpy arrays (every
# chunk of both dbs read and checked), then as torch tensors of the same bits
_TORCH_RESTORE = """
import json, sys, runpy
import numpy as np, torch
import epochal.jax as ej
d, bits = sys.argv[1:3]
sys.argv = [bits, "none", d, "1", "0", "0", "-", "0"]
want = runpy.run_path(bits, run_name="bits")["values"](0)
abstract = {"params": {k: np.empty(v.shape, v.dtype) for k, v in want["params"].items()},
            "b": np.empty(want["b"].shape, want["b"].dtype), "one": np.empty((3, 5), np.float32), "count": 0}
got = ej.restore(d, abstract)
tensors = {"w": torch.from_numpy(got["params"]["w"]), "b": torch.from_numpy(got["b"]),
           "e": torch.from_numpy(got["params"]["e"].view(np.uint16)).view(torch.bfloat16)}
assert tensors["e"].dtype == torch.bfloat16 and tensors["w"].dtype == torch.float32
for k, w in (("w", want["params"]["w"]), ("e", want["params"]["e"]), ("b", want["b"])):
    t = tensors[k]
    u = t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()
    assert np.array_equal(u, np.ascontiguousarray(w).view(u.dtype)), k
print(json.dumps({"leaves": len(tensors), "count": got["count"]}))
"""


@pytest.mark.unit
def test_a_record_of_one_process_part_is_refused_alone_and_parts_must_cover_together() -> None:
    meta = {"dtype": "float32", "shape": [4, 2], "device": "cpu", "part": [1, 2],
            "chunks": [{"offsets": [2, 0], "shape": [2, 2], "rows": 2}]}
    with pytest.raises(ValueError, match="process 1 of 2"):
        chunk_layout(meta, [16], 4)
    shape, chunks = chunk_layout(meta, [16], 4, partial=True)
    assert shape == (4, 2) and [c.offsets for c in chunks] == [(2, 0)]
    with pytest.raises(ValueError, match="hold 4 elements of a tensor of 8"):
        check_cover((4, 2), [((2, 0), (2, 2))])
    with pytest.raises(ValueError, match="overlap"):
        check_cover((4, 2), [((0, 0), (2, 2)), ((1, 0), (2, 2))])
    check_cover((4, 2), [((0, 0), (2, 2)), ((2, 0), (2, 2))])


@pytest.mark.system
def test_retention_of_a_job_of_two_processes_keeps_every_db_of_the_newest_steps(tmp_path: Any) -> None:
    d = str(tmp_path)
    with open(os.path.join(d, "proc0.9"), "wb") as f:  # a newer step being written (by another run)
        f.write(b"partial")
    assert job("keep", d, 2, "4", 2) == [{"saved": [1, 2, 3, 4], "process": 0},
                                         {"saved": [1, 2, 3, 4], "process": 1}]
    # the two newest steps' dbs (every process's) and manifests remain, nothing of steps 1, 2
    assert sorted(os.listdir(d)) == [".epochal", "proc0.3", "proc0.4", "proc0.9", "proc1.3", "proc1.4"]
    assert sorted(n for n in os.listdir(os.path.join(d, ".epochal")) if n.startswith("manifest")) == \
        ["manifest.3.json", "manifest.4.json"]
    assert CheckpointDirectory(d).committed_epochs() == [3, 4]
    # both restore, value for value, in fresh processes: step 3 on two, step 4 on one
    assert job("restore", d, 2, "3", 3) == [{"shards": [13, 13], "process": 0}, {"shards": [13, 13], "process": 1}]
    assert job("restore", d, 1, "4", 4) == [{"shards": [25, 25], "process": 0}]
    # keep_best by the metrics given: the best step (2, loss 1.0) and the newest remain
    best = str(tmp_path / "best")
    assert job("best", best, 2, "4", 0) == [{"saved": [1, 2, 3, 4], "process": i, "typo": "MissingMetricError"}
                                            for i in (0, 1)]
    assert CheckpointDirectory(best).committed_epochs() == [2, 4]
    assert sorted(os.listdir(best)) == [".epochal", "proc0.2", "proc0.4", "proc1.2", "proc1.4"]
    assert CheckpointDirectory(best).read_manifest(2).metrics == {"loss": 1.0}


@pytest.mark.system
def test_an_async_save_of_two_processes_writes_the_values_of_the_moment_it_returned(tmp_path: Any) -> None:
    d = str(tmp_path)
    outs = job("async", d, 2, "6", 1)
    # every live shard buffer was overwritten after save returned, before its write began
    assert [o["live"] for o in outs] == [["0x5a5a5a5a"], ["0x5a5a5a5a"]]
    assert [o["waited"] for o in outs] == ["ok", "ok"]
    assert CheckpointDirectory(d).committed_epochs() == [6]
    assert sorted(os.listdir(d)) == [".epochal", "proc0.6", "proc1.6"]
    # restored in fresh processes: the values of seed 1, as they were when save returned
    assert job("restore", d, 1, "6", 1) == [{"shards": [25, 25], "process": 0}]
    assert job("restore", d, 2, "-", 1) == [{"shards": [13, 13], "process": 0}, {"shards": [13, 13], "process": 1}]


@pytest.mark.system
def test_an_async_save_left_in_flight_at_the_end_of_the_job_is_committed_before_it_exits(tmp_path: Any) -> None:
    d = str(tmp_path)
    assert job("async_exit", d, 2, "8", 2) == [{"left": 8, "process": 0}, {"left": 8, "process": 1}]
    assert CheckpointDirectory(d).committed_epochs() == [8]
    assert job("restore", d, 1, "8", 2) == [{"shards": [25, 25], "process": 0}]


@pytest.mark.system
def test_a_failed_background_write_raises_on_every_process_at_wait(tmp_path: Any) -> None:
    d = str(tmp_path)
    outs = job("async_fail", d, 2, "6", 0)
    # process 1 its own error; process 0 names process 1; neither commits step 6
    assert outs[1]["waited"].startswith("OSError: [Errno 28] No space left on device (injected)"), outs[1]
    assert outs[0]["waited"].startswith("CheckpointError: ") and "step 6 was not saved: process(es) [1] " \
        "failed to write their db" in outs[0]["waited"], outs[0]
    # the job goes on: the next save commits; step 6 never was
    assert [o["next"] for o in outs] == [7, 7]
    view = CheckpointDirectory(d)
    assert view.committed_epochs() == [7]
    assert not os.path.exists(os.path.join(d, ".epochal", "manifest.6.json"))
    assert job("restore", d, 1, "-", 0) == [{"shards": [25, 25], "process": 0}]


@pytest.mark.system
def test_two_processes_save_to_an_s3_url_with_retention_and_async_and_restore(s3: dict[str, Any], monkeypatch: Any
                                                                              ) -> None:
    import secrets

    url = f"s3://ckpts/jaxmp-{secrets.token_hex(4)}/run"
    monkeypatch.setenv("JAX_MP_OPTS", json.dumps(s3))
    assert job("keep", url, 2, "3", 2) == [{"saved": [1, 2, 3], "process": 0}, {"saved": [1, 2, 3], "process": 1}]
    view = CheckpointDirectory(url, storage_options=s3)
    assert view.committed_epochs() == [2, 3]
    # every process's db of the kept steps, named with one writer token per save; none of step 1
    files = sorted((e, n) for e, n, _ in view.db_files())
    assert files == [(2, "proc0"), (2, "proc1"), (3, "proc0"), (3, "proc1")], files
    for step in (2, 3):
        entries = view.read_manifest(step).nodes
        tokens = {e.file.split(".")[-1] for e in entries.values()}
        assert len(tokens) == 1 and next(iter(tokens)).startswith("w"), entries
    assert not view.check_epoch(3, "full")
    # an async save to the URL: the values of the moment save returned; retention not asked
    outs = job("async", url, 2, "6", 1)
    assert [o["waited"] for o in outs] == ["ok", "ok"]
    assert CheckpointDirectory(url, storage_options=s3).committed_epochs() == [2, 3, 6]
    # restored from the URL in fresh processes, value for value
    assert job("restore", url, 2, "2", 2) == [{"shards": [13, 13], "process": 0}, {"shards": [13, 13], "process": 1}]
    assert job("restore", url, 1, "-", 1) == [{"shards": [25, 25], "process": 0}]


@pytest.mark.system
def test_a_process_dying_in_a_background_write_makes_wait_raise_on_the_others(tmp_path: Any) -> None:
    d = str(tmp_path)
    job("save", d, 2, "5", 0)
    procs = start("async_die", d, 2, "6", 0)
    try:
        out, err = procs[0].communicate(timeout=240)
        assert procs[0].returncode == 0, err[-4000:]
        waited = json.loads(out.strip().splitlines()[-1])["waited"]
        assert waited.startswith("CheckpointError: process 1 did not report within 5 s whether it wrote its db"), \
            waited
        assert procs[1].wait(timeout=60) == 17
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    # process 0's db of step 6, never committed: step 5 stays the newest
    assert CheckpointDirectory(d).committed_epochs() == [5]
    assert sorted(os.listdir(d)) == [".epochal", "proc0.5", "proc0.6", "proc1.5"]


@pytest.mark.system
def test_two_processes_save_compressed_dbs_that_restore_bit_exact_on_two_and_on_one(tmp_path: Any) -> None:
    """``compression="zstd"`` in a job of two processes: each process's db is written
    compressed (format 3, its share of a bf16 array stored in fewer bytes than raw), and the
    step restores bit-exact on two processes and on one; retention applies as without."""
    from epochal.storage.formats.native import NativeFile

    d = str(tmp_path)
    for step in (1, 2, 3):
        assert job("zsave", d, 2, str(step), step) == [{"saved": step, "process": 0}, {"saved": step, "process": 1}]
    assert CheckpointDirectory(d).committed_epochs() == [2, 3]
    assert sorted(f for f in os.listdir(d) if f.startswith("proc")) == ["proc0.2", "proc0.3", "proc1.2", "proc1.3"]
    for proc in ("proc0.3", "proc1.3"):
        with NativeFile(os.path.join(d, proc), mmap=False) as f:
            assert f.stat().format_version.startswith("3."), proc  # a compressed segment
            assert f.info("z").nbytes == 128 << 10  # its half of z (as the stored tree's leaf)
        # the half of z alone is 128 KiB raw; compressed (about 1.5x) the whole db is smaller
        assert os.path.getsize(os.path.join(d, proc)) < 110 << 10, proc
    assert job("zrestore", d, 2, "3", 3) == [{"shards": 17, "process": 0}, {"shards": 17, "process": 1}]
    assert job("zrestore", d, 1, "2", 2) == [{"shards": 33, "process": 0}]


@pytest.mark.system
def test_two_processes_save_incremental_dbs_that_restore_bit_exact_on_two_and_on_one(tmp_path: Any) -> None:
    """``incremental=True`` in a job of two processes (sync and async saves alternating,
    ``keep_last=2``): each process writes only what its own db of the step before lacks (a
    frozen sharded array costs references), retention keeps the older files the kept steps
    take bytes from, and step 4 restores bit-exact on two processes and on one."""
    d = str(tmp_path)
    assert job("isave", d, 2, "4", 0) == [{"saved": 4, "process": 0}, {"saved": 4, "process": 1}]
    view = CheckpointDirectory(d)
    assert view.committed_epochs() == [3, 4] and view.has_incremental()
    sizes = {f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.startswith("proc")}
    for i in (0, 1):
        assert f"proc{i}.1" in sizes  # (step 1 dropped, its dbs kept: steps 3 and 4 take bytes from them)
        assert sizes[f"proc{i}.1"] > 1 << 20  # its half of z (1 MiB) stored
        assert sizes[f"proc{i}.4"] < sizes[f"proc{i}.1"] // 4, sizes  # references, not z again
        entry = view.read_manifest(4).nodes[f"proc{i}"]
        assert entry.size == sizes[f"proc{i}.4"]  # the manifest records the bytes stored
    out = subprocess.run([sys.executable, "-m", "epochal", "verify", d], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert job("irestore", d, 2, "4", 4) == [{"shards": 17, "process": 0}, {"shards": 17, "process": 1}]
    assert job("irestore", d, 1, "3", 3) == [{"shards": 33, "process": 0}]
