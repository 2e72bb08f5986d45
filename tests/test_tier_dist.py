"""The local tier under torch.distributed (2 gloo ranks, each with its own local directory
standing for its own machine): killed ranks resume from their local copies; a machine whose
local directory is gone resumes its part from its peer's copy; a damaged local copy is named
and the peer's used; without a copy of the newest step on every rank, the ranks agree on an
older one; a kill in the middle of the copies between ranks leaves the copy of that step
uncommitted and loses no committed step. Every resume bit-identical to a run never stopped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import _fresh  # noqa: E402
from _dist_workers import free_port  # noqa: E402

from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402

pytestmark = [pytest.mark.system, pytest.mark.slow]
JOB = str(Path(__file__).parent / "_tier_dist_job.py")


def ranks(tmp: Path, out: str, *args: str, rc: int | tuple[int | set[int], int | set[int]] = 0
          ) -> dict[int, tuple[int, str]]:
    """Run both ranks; their exit status checked (``rc``: both's, or each's: one, or a set of
    those allowed); each rank's (step, source) it resumed from."""
    want = [w if isinstance(w, set) else {w} for w in (rc if isinstance(rc, tuple) else (rc, rc))]
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "EPOCHAL_QUIET": "1"}
        procs.append(_fresh.Fresh(JOB, [str(tmp / "store"), str(tmp / "base"), str(tmp / out), *args], env, None,
                                  apart=True))
    done = [p.communicate(timeout=180) for p in procs]
    done = [(o, e or "") for o, e in done]
    got: dict[int, tuple[int, str]] = {}
    for rank, (p, (stdout, stderr)) in enumerate(zip(procs, done)):
        assert p.returncode in want[rank], (rank, p.returncode, stdout, stderr[-3000:], done[1 - rank][1][-3000:])
        line = next(x for x in stdout.splitlines() if x.startswith("RESUMED"))
        _, r, step, source = line.split()
        got[int(r)] = (int(step), source)
        (tmp / f"{out}.{rank}.stderr").write_text(stderr)
    return got


def final(tmp: Path, out: str) -> list[dict[str, str]]:
    return [json.loads((tmp / f"{out}.{r}.json").read_text()) for r in (0, 1)]


def du(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def listed(d: Path) -> list[int]:
    return CheckpointDirectory(str(d)).committed_epochs()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("ref")
    ranks(tmp, "ref", "--steps", "6")
    want = final(tmp, "ref")
    assert want[0]["rng/torch/cpu"] != want[1]["rng/torch/cpu"]  # each rank its own stream
    return want


def killed(tmp: Path, *mode: str) -> None:
    ranks(tmp, "a", "--steps", "6", "--persist", "3", "--kill-after", "4", *mode, rc=-9)
    assert listed(tmp / "store") == [3]
    for r, peer in ((0, 1), (1, 0)):
        assert listed(tmp / "base" / f"node{r}" / f"rank{r}") == [3, 4]
        assert listed(tmp / "base" / f"node{r}" / "peer" / f"rank{peer}") == [3, 4]


@pytest.mark.parametrize("mode", [[], ["--async"], ["--async", "--unsnapshotted"]], ids=["sync", "async", "async-unsnapshotted"])
def test_killed_ranks_resume_from_their_local_tiers(tmp_path: Path, reference: list[dict[str, str]],
                                                   mode: list[str]) -> None:
    killed(tmp_path, *mode)
    assert ranks(tmp_path, "b", "--steps", "6", *mode) == {0: (4, "local"), 1: (4, "local")}
    assert final(tmp_path, "b") == reference
    # a peer's copy is an ordinary location: epochal verify accepts it
    v = subprocess.run([sys.executable, "-m", "epochal", "verify", str(tmp_path / "base/node0/peer/rank1")],
                       capture_output=True, text=True)
    assert v.returncode == 0 and "all" in v.stdout, v.stdout + v.stderr


def test_when_busy_skip_skips_the_same_steps_on_every_rank(tmp_path: Path, reference: list[dict[str, str]]
                                                           ) -> None:
    """``when_busy="skip"``: rank 1's local writes are slow; a save that finds any rank's
    previous one still running is skipped on both ranks (the same steps), a save due for the
    store (every 3rd) never is, the tiers hold the steps written, and a resume from them after a
    SIGKILL of both ranks ends bit-identical to a run never stopped."""
    ranks(tmp_path, "a", "--steps", "6", "--persist", "3", "--async", "--when-busy", "skip", "--slow-rank", "1",
          "--kill-after", "5", rc=-9)
    skipped = [json.loads((tmp_path / f"a.{r}.skipped.json").read_text()) for r in (0, 1)]
    assert skipped[0] == skipped[1] == [2, 4, 5], skipped
    assert listed(tmp_path / "store") == [3]
    for r, peer in ((0, 1), (1, 0)):
        assert listed(tmp_path / "base" / f"node{r}" / f"rank{r}") == [1, 3]
        assert listed(tmp_path / "base" / f"node{r}" / "peer" / f"rank{peer}") == [1, 3]
    assert ranks(tmp_path, "b", "--steps", "6", "--async") == {0: (3, "local"), 1: (3, "local")}
    assert final(tmp_path, "b") == reference


def test_replaced_machine_resumes_from_its_peer(tmp_path: Path, reference: list[dict[str, str]]) -> None:
    killed(tmp_path)
    shutil.rmtree(tmp_path / "base" / "node1")  # rank 1's machine replaced: an empty local dir
    assert ranks(tmp_path, "b", "--steps", "6") == {0: (4, "local"), 1: (4, "peer")}
    assert final(tmp_path, "b") == reference
    assert not (tmp_path / "base" / "node1" / "fetched" / "rank1").exists()  # loaded, then gone
    # epochal ls on a machine's local directory: the bytes its own steps and its peer's copies hold
    node0 = tmp_path / "base" / "node0"
    ls = [sys.executable, "-m", "epochal", "ls", str(node0)]
    held = json.loads(subprocess.run([*ls, "--json"], capture_output=True, text=True, check=True).stdout)["held"]
    assert held["ranks"] == ["peer/rank1", "rank0"]
    assert (held["own"], held["peers"], held["fetched"]) == (du(node0 / "rank0"), du(node0 / "peer"), 0)
    assert held["total"] == du(node0) and held["own"] > 0 and held["peers"] > 0
    text = subprocess.run(ls, capture_output=True, text=True, check=True).stdout
    assert f"{node0} holds " in text and "locations: peer/rank1, rank0" in text, text


def test_damaged_local_copy_is_named_and_the_peers_used(tmp_path: Path, reference: list[dict[str, str]]) -> None:
    killed(tmp_path)
    bad = tmp_path / "base" / "node1" / "rank1" / "rank0.4"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x10
    bad.write_bytes(bytes(data))
    assert ranks(tmp_path, "b", "--steps", "6") == {0: (4, "local"), 1: (4, "peer")}
    err = (tmp_path / "b.1.stderr").read_text()
    assert "damaged" in err and str(tmp_path / "base" / "node1" / "rank1") in err, err[-2000:]
    assert final(tmp_path, "b") == reference


def test_a_step_only_some_ranks_hold_is_never_used(tmp_path: Path, reference: list[dict[str, str]]) -> None:
    ranks(tmp_path, "a", "--steps", "6", "--persist", "3", "--replicas", "0", "--kill-after", "4", rc=-9)
    shutil.rmtree(tmp_path / "base" / "node1")  # no peer copy: rank 1 can get step 3 only (the store's)
    got = ranks(tmp_path, "b", "--steps", "6", "--replicas", "0")
    assert got == {0: (3, "local"), 1: (3, "durable")}
    assert final(tmp_path, "b") == reference


@pytest.mark.parametrize(("mode", "dying", "wiped", "want"), [
    ([], "1", None, {0: (5, "local"), 1: (5, "local")}),
    ([], "0,1", "node1", {0: (4, "local"), 1: (4, "peer")}),
    (["--async"], "1", "node0", {0: (4, "peer"), 1: (4, "local")}),
], ids=["rank1-killed", "both-killed-rank1-replaced", "async-rank1-killed-rank0-replaced"])
def test_a_kill_during_the_copy_between_ranks_loses_no_committed_step(
        tmp_path: Path, reference: list[dict[str, str]], mode: list[str], dying: str, wiped: str | None,
        want: dict[int, tuple[int, str]]) -> None:
    """SIGKILL in the middle of step 5's copies (after one received file, in 512-byte chunks):
    each rank's local step 5 is committed, its peer's copy of step 5 is not; restored from the
    newest step every rank can get, bit-identical."""
    # (a survivor fails on its broken connection; with both dying, the second may fail on it
    # before its own kill point, when its peer died first)
    rc: tuple[int | set[int], int | set[int]] = ({-9, 1}, {-9, 1}) if dying == "0,1" else (1, -9)
    ranks(tmp_path, "a", "--steps", "6", "--persist", "3", "--die-in-copy", f"5:{dying}:1", *mode, rc=rc)
    assert listed(tmp_path / "store") == [3]
    for r, peer in ((0, 1), (1, 0)):
        assert listed(tmp_path / "base" / f"node{r}" / f"rank{r}") == [4, 5]
        assert listed(tmp_path / "base" / f"node{r}" / "peer" / f"rank{peer}") == [3, 4]
    if dying != "0,1":  # the receiving end of the cut copy holds a part of step 5, never committed
        assert list((tmp_path / "base" / "node1" / "peer" / "rank0").glob("*.5*"))
    if wiped:
        shutil.rmtree(tmp_path / "base" / wiped)
    assert ranks(tmp_path, "b", "--steps", "6", *mode) == want
    assert final(tmp_path, "b") == reference
    kept = [4, 6] if want[0][0] == 5 else [5, 6]  # (resumed at 5: step 5 is not saved again)
    for r, peer in ((0, 1), (1, 0)):
        copy = tmp_path / "base" / f"node{r}" / "peer" / f"rank{peer}"
        assert listed(copy) == kept
        # nothing of the cut copy is left to hold host memory: only the kept steps' files
        assert sorted(p.name for p in copy.iterdir() if p.is_file()) == [f"{k}.{s}" for k in ("dcp", "rank0")
                                                                          for s in kept]
        assert sorted(p.name for p in (copy / ".epochal").iterdir()) == [f"manifest.{s}.json" for s in kept]


def test_torchrun_restarts_a_killed_ranks_group_from_the_local_tiers(
        tmp_path: Path, reference: list[dict[str, str]]) -> None:
    """Under ``torchrun --max-restarts=1``, rank 1 dies by SIGKILL after step 4: torchrun stops
    rank 0 and starts both again; the restarted ranks resume from their local tiers (no step
    of the store is newer than 3), with nothing asked of the user, and end bit-identical."""
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
         "--master_addr=127.0.0.1", f"--master_port={free_port()}", JOB, str(tmp_path / "store"),
         str(tmp_path / "base"), str(tmp_path / "a"), "--steps", "6", "--persist", "3", "--kill-after", "4",
         "--kill-ranks", "1"],
        env={**os.environ, "EPOCHAL_QUIET": "1"}, capture_output=True, text=True, timeout=240)
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-4000:]
    resumed = [ln.split()[1:] for ln in run.stdout.splitlines() if ln.startswith("RESUMED")]
    assert sorted(resumed) == [["0", "0", "None"], ["0", "4", "local"], ["1", "0", "None"], ["1", "4", "local"]]
    assert "failed (exitcode: -9) local_rank: 1" in text, text[-4000:]  # the kill torchrun saw
    assert listed(tmp_path / "store") == [3]  # (the restarted processes count their saves anew)
    assert final(tmp_path, "a") == reference


def test_a_step_for_both_places_is_snapshotted_once(tmp_path: Path) -> None:
    """One process, no process group, ``async_save``: a step that goes to the local tier and to
    the store is copied into host memory once (the tier's reused buffer; the store's own staging
    is never used) and the buffer comes back only after both writes; every step restores
    bit-equal to the state at its save, from either place."""
    from epochal.integrations.distributed import DistributedCheckpointer
    from epochal.integrations.distributed.tier import RankTier

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    at = {}
    with DistributedCheckpointer(tmp_path / "store", async_save=True) as ck:
        ck.tier = RankTier(tmp_path / "local", ranks=ck.ranks, keep=2, persist_every=2, replicas=0, stride=None,
                           per_rank=ck.per_rank, async_save=True)
        for step in (1, 2, 3, 4):
            at[step] = {k: v.clone() for k, v in model.state_dict().items()}
            ck.save(step, {"model": model, "step": step})
            with torch.no_grad():
                model.weight.add_(1.0)
        ck.wait()
        tier, own = ck.tier._staging, ck._staging
    assert (own.allocated, own.reused) == (0, 0)  # the store's saves wrote the tier's snapshot
    assert (tier.allocated, tier.reused) == (1, 3)  # one buffer: each step's writes gave it back
    assert CheckpointDirectory(str(tmp_path / "store")).committed_epochs() == [2, 4]
    assert CheckpointDirectory(str(tmp_path / "local" / "rank0")).committed_epochs() == [3, 4]
    for where, step in ((tmp_path / "store", 2), (tmp_path / "store", 4), (tmp_path / "local" / "rank0", 4)):
        fresh = torch.nn.Linear(64, 32)
        state = {"model": fresh, "step": 0}
        with DistributedCheckpointer(where) as ck:
            ck._load(step, state)
        assert state["step"] == step
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, at[step][k]), (where, step, k)


def test_a_state_not_snapshotted_whole_is_written_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """A state the staging does not snapshot whole (a tensor of another device; CUDA ones
    with ``HostStaging.OFF_DEVICE`` off): the tier plans it on the training thread and copies
    each tensor into its (pinned) staging buffer, and ``save`` returns before the db is written: the write waits here on an
    event while training changes the live tensors; the step restores bit-equal to the state at
    its save, and the staging buffer is reused from save to save."""
    import threading

    from epochal.integrations.dcp import storage
    from epochal.integrations.dcp.staging import HostStaging
    from epochal.integrations.distributed import DistributedCheckpointer
    from epochal.integrations.distributed.tier import RankTier

    monkeypatch.setattr(HostStaging, "snapshot_state", lambda self, state_dict: None)
    go = threading.Event()
    written = []
    write = storage.EpochalStorageWriter.write_deferred

    def held(self):  # type: ignore[no-untyped-def]
        assert go.wait(60)
        written.append(self.pending_db)
        return write(self)

    monkeypatch.setattr(storage.EpochalStorageWriter, "write_deferred", held)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    at = {}
    with DistributedCheckpointer(tmp_path / "store", async_save=True) as ck:
        ck.tier = RankTier(tmp_path / "local", ranks=ck.ranks, keep=2, persist_every=None, replicas=0, stride=None,
                           per_rank=ck.per_rank, async_save=True)
        for step in (1, 2, 3):
            at[step] = {k: v.clone() for k, v in model.state_dict().items()}
            ck.save(step, {"model": model, "step": step})
            assert not ck.tier.steps() or ck.tier.steps()[-1] == step - 1  # not written yet
            assert len(written) == step - 1
            with torch.no_grad():  # training goes on while the write waits
                model.weight.add_(1.0)
                model.bias.mul_(-1.0)
            go.set()
            ck.tier.wait()
            go.clear()
        staged = ck.tier._staging
    assert (staged.allocated, staged.reused) == (1, 2)
    assert CheckpointDirectory(str(tmp_path / "local" / "rank0")).committed_epochs() == [2, 3]
    for step in (2, 3):
        fresh = torch.nn.Linear(64, 32)
        state = {"model": fresh, "step": 0}
        with DistributedCheckpointer(tmp_path / "local" / "rank0") as ck:
            ck._load(step, state)
        assert state["step"] == step
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, at[step][k]), (step, k)
