"""Segments an encoder already copied into memory of its own (a CUDA tensor's, in pinned host
memory) are kept by a background save's snapshot as they are: not copied a second time, not
in the snapshot's arena, and their copies settled once before the snapshot returns. A stand-in
for a device value (its encoder copies its bytes and hands them over, as the torch codec does
for a CUDA tensor) checks it here, where CI has no GPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _fresh  # noqa: E402

from epochal import Checkpointer  # noqa: E402
from epochal.checkpoint.tasks.background import BackgroundSaver  # noqa: E402
from epochal.storage.encoding.codecs import NdarrayCodec, register_codec  # noqa: E402
from epochal.storage.encoding.staged import staged, staging_scope  # noqa: E402

SETTLED: list[int] = []
HANDED: list[memoryview] = []


def _settle() -> None:
    """The device copies landed (one callback, as ``torch.cuda.synchronize`` is)."""
    SETTLED.append(1)


class OnDevice:
    """A value whose bytes live elsewhere (standing for a CUDA tensor)."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr


class OnDeviceCodec:
    """Encodes an OnDevice as the ndarray it holds, from a private copy it hands over."""

    kind = "test.on_device"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, OnDevice)

    def encode(self, value: Any) -> Any:
        enc = NdarrayCodec().encode(value.arr.copy())  # the "device-to-host copy"
        seg = enc.segments[0]
        if not staged(seg, _settle):
            SETTLED.append(0)  # (settled at once, outside a snapshot)
        HANDED.append(seg)
        return enc

    def allocate(self, meta: dict[str, Any], sizes: Any) -> Any:
        raise AssertionError("read back as an ndarray")

    decode = allocate


register_codec(OnDeviceCodec())


@pytest.fixture(autouse=True)
def _clean() -> None:
    SETTLED.clear()
    HANDED.clear()


def test_a_snapshot_keeps_staged_segments_and_settles_them_once() -> None:
    saver = BackgroundSaver()
    try:
        a, b = np.arange(1000, dtype=np.float32), np.ones((64, 64))
        plain = np.full(4096, 7, dtype=np.uint8)
        snap = saver.snapshot("o", {"a": OnDevice(a), "b": OnDevice(b), "plain": plain})
        assert SETTLED == [1]  # one settle for both device values, before snapshot returned
        got = {n: f.encoded.segments[0] for n, f in snap.blobs.items()}
        assert got["a"] is HANDED[0] and got["b"] is HANDED[1]  # kept, not copied again
        assert got["plain"].obj is not plain and np.array_equal(np.frombuffer(got["plain"], np.uint8), plain)
        assert snap.arena is not None and snap.arena.layout == (4096,)  # only the plain blob's bytes
        assert snap.nbytes == a.nbytes + b.nbytes + plain.nbytes
        saver.pool.release(snap.arena)
    finally:
        saver.close()


def test_outside_a_snapshot_the_encoder_settles_itself() -> None:
    with staging_scope() as scope:
        pass
    OnDeviceCodec().encode(OnDevice(np.zeros(3)))
    assert SETTLED == [0] and not scope.has(HANDED[0])


@pytest.mark.system
def test_async_save_of_only_staged_values_restores_in_a_fresh_process(tmp_path: Path) -> None:
    """A state whose every segment was staged needs no arena at all; the step holds the values
    at the save, not the ones changed right after, read back by a process that never saw them."""
    w = np.random.default_rng(0).normal(size=(256, 128)).astype(np.float32)
    want = w.copy()
    with Checkpointer(tmp_path / "ck", async_save=True) as ck:
        ck.save(1, {"w": OnDevice(w)})
        w += 1.0  # training goes on
        ck.wait()
    assert SETTLED == [1]
    np.save(tmp_path / "want.npy", want)
    script = tmp_path / "read.py"
    script.write_text(
        "import sys\nimport numpy as np\nfrom epochal import Checkpointer\n"
        "state = {'w': None}\n"
        "with Checkpointer(sys.argv[1]) as ck:\n"
        "    step = ck.restore(state)\n"
        "assert step == 1, step\n"
        "assert np.array_equal(state['w'], np.load(sys.argv[2])), 'different'\n"
        "print('OK', state['w'].dtype, state['w'].shape)\n")
    p = _fresh.run(str(script), [str(tmp_path / "ck"), str(tmp_path / "want.npy")], timeout=120)
    assert p.returncode == 0 and "OK float32 (256, 128)" in p.stdout, p.stdout + p.stderr
