"""Fault injection: SIGKILL a training subprocess at random moments, most of them inside saves.

After every kill the directory holds only complete dbs under checkpoint names, every committed
epoch verifies, the rerun resumes from the newest committed epoch and loads exactly the state
an uninterrupted run had after it, and the job, once finished, ends bit-identical to an
uninterrupted run. tests/_crash_job.py is the job and the harness; bench/soak_kill.py runs
hundreds of trials.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _crash_job as cj  # noqa: E402

from epochal.storage.io.extents import EXTENT_MAGIC  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform == "win32", reason="needs SIGKILL")]

JOB_ARGS = ["--epochs", "5", "--mb", "1.5", "--epoch-ms", "10"]
TRIALS = 16  # x 2 kills each = 32 SIGKILLs
POLICIES = ([], ["--keep-last", "2"], ["--keep-every", "2", "--keep-last", "1"])


def test_sigkill_at_random_moments_never_loses_a_committed_epoch(tmp_path):
    ref = cj.reference_run(str(tmp_path / "reference"), JOB_ARGS)
    assert len(ref.epochs) == 6 and ref.done[0] == 5 and ref.done[1] == ref.epochs[5]

    def trial(i: int) -> cj.TrialResult:
        args = JOB_ARGS + POLICIES[i % len(POLICIES)]
        return cj.run_trial(str(tmp_path / f"trial{i}"), args, ref, seed=1000 + i, kills=2)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(trial, range(TRIALS)))
    errors = [e for r in results for e in r.errors]
    kills = sum(r.kills for r in results)
    in_save = sum(r.kills_in_save for r in results)
    mid_write = sum(r.kills_leaving_temp for r in results)
    resumed = sum(1 for r in results for e in r.resumes if e is not None)
    print(f"\n{kills} kills, {in_save} inside a save, {mid_write} left a temp file, {resumed} resumes")
    assert not errors, "\n".join(errors)
    assert kills >= 30
    assert in_save >= kills // 3, f"only {in_save} of {kills} kills landed inside a save"
    assert mid_write >= 1 and resumed >= 10


@pytest.mark.system
def test_sigkill_during_incremental_saves_and_retention_never_loses_a_committed_epoch(tmp_path):
    """The same kills with DirectoryMetadataHandler(incremental=True): a frozen blob and a
    table of which 2% of the rows change per epoch, saved as references to older epochs' dbs;
    after every kill each committed epoch verifies (references followed) and the rerun loads
    exactly the state of an uninterrupted run."""
    args = JOB_ARGS + ["--incremental"]
    ref = cj.reference_run(str(tmp_path / "reference"), args)
    first, last = (tmp_path / "reference" / f"trainer_0.{e}" for e in (0, 5))
    with open(last, "rb") as f:
        assert f.read(8) == EXTENT_MAGIC  # an incremental db...
    assert last.stat().st_size < first.stat().st_size - (2 << 20)  # ...without the frozen blob's 3 MB
    assert len(ref.epochs) == 6 and ref.done[1] == ref.epochs[5]

    def trial(i: int) -> cj.TrialResult:
        policy = (["--keep-last", "2"], ["--keep-every", "2", "--keep-last", "1"])[i % 2]
        return cj.run_trial(str(tmp_path / f"trial{i}"), args + policy, ref, seed=2000 + i, kills=2)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(trial, range(8)))
    errors = [e for r in results for e in r.errors]
    kills = sum(r.kills for r in results)
    assert not errors, "\n".join(errors)
    assert kills >= 14 and sum(r.kills_in_save for r in results) >= kills // 3
