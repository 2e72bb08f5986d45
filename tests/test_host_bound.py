"""``max_host_bytes`` bounds the host memory of background saves: a snapshot that would not fit
is not taken, the save is written synchronously from the live state (after the writes in
flight), so back-to-back async saves never hold more than the bound beside the state. Peak
memory is measured in a fresh process (its peak RSS) and by the pool's own accounting."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

import epochal

pytestmark = pytest.mark.system

MIB = 1 << 20
STATE = 96 * MIB

SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    import epochal
    bound = None if sys.argv[2] == "None" else int(sys.argv[2])
    state = {"w": np.ones(int(sys.argv[3]) // 8, dtype=np.float64)}
    state["w"][:] = 1.5
    with epochal.Checkpointer(sys.argv[1], async_save=True, max_host_bytes=bound, keep_last=1) as ck:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        for step in range(1, 5):
            state["w"][0] = step
            ck.save(step, state)
        ck.wait()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        saver = ck._saver
        print(json.dumps({"extra": peak - before, "pooled": saver.pool.pooled_bytes,
                          "synchronous": saver.synchronous, "steps": ck.steps()}))
    restored = {"w": np.zeros_like(state["w"])}
    with epochal.Checkpointer(sys.argv[1]) as ck:
        ck.restore(restored)
    assert restored["w"][0] == 4 and restored["w"][1] == 1.5
""")


def run(tmp_path: Any, bound: int | None) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / f"ck{bound}"), str(bound), str(STATE)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("bound", [0, STATE // 2])
def test_a_bound_below_the_state_writes_synchronously_and_holds(tmp_path: Any, bound: int) -> None:
    got = run(tmp_path, bound)
    assert got["steps"] == [4] and got["synchronous"] == 4 and got["pooled"] == 0
    assert got["extra"] < STATE // 4, got  # no copy of the state: write buffers only


def test_the_default_bound_holds_one_arena_when_each_save_joins_the_last(tmp_path: Any) -> None:
    got = run(tmp_path, None)
    assert got["synchronous"] == 0 and STATE <= got["pooled"] < STATE + MIB
    assert got["extra"] < STATE + STATE // 2, got  # one snapshot's worth (two states at most)


def test_a_bound_of_two_states_keeps_snapshots_off_the_training_thread(tmp_path: Any) -> None:
    got = run(tmp_path, 2 * STATE + MIB)
    assert got["synchronous"] == 0 and got["pooled"] <= 2 * STATE + MIB


def test_a_synchronous_save_is_joined_like_a_background_one(tmp_path: Any) -> None:
    with epochal.Checkpointer(tmp_path, async_save=True, max_host_bytes=0) as ck:
        ck.save(1, {"w": np.arange(10.0)})
        assert ck._saver.synchronous == 1 and ck.steps() == []  # written; committed by wait()
        ck.wait()
        assert ck.steps() == [1]
