"""RNGState: the global generators as a blob; restoring it replays the same random numbers."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from epochal.integrations.rng import RNGState
from epochal.storage.encoding import codecs


def roundtrip(value: Any, existing: Any = None) -> Any:
    enc = codecs.encode(value, "rng")
    meta = json.loads(json.dumps(enc.meta))
    codec = codecs.codec_for_kind(enc.kind)
    bufs = codec.allocate(meta, [s.nbytes for s in enc.segments])
    for b, s in zip(bufs, enc.segments):
        if s.nbytes:
            memoryview(b).cast("B")[:] = memoryview(s).cast("B")
    return codec.decode(meta, bufs, existing)


def draws() -> tuple[Any, ...]:
    return (
        [random.random() for _ in range(5)],
        random.gauss(0, 1),
        np.random.rand(5).tolist(),
        np.random.standard_normal(),
    )


def test_python_and_numpy_replay_after_restore() -> None:
    random.seed(1)
    np.random.seed(2)
    random.gauss(0, 1)  # leaves a cached gaussian behind: part of the state
    np.random.standard_normal()
    rng = RNGState(torch=False)
    saved = roundtrip(rng)  # a plain state dict: no live object
    expected = draws()
    random.seed(99)
    np.random.seed(99)
    live = RNGState(torch=False)
    assert roundtrip(rng_state_holder(saved), existing=live) is live
    assert draws() == expected


class _Holder:
    """A stateful object that replays a given state dict (so we save a captured state)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def rng_state_holder(state: dict[str, Any]) -> _Holder:
    return _Holder(state)


def test_state_dict_is_plain_data() -> None:
    st = RNGState(torch=False).state_dict()
    assert set(st) == {"python", "numpy"}
    assert isinstance(st["python"]["state"], list) and len(st["python"]["state"]) == 625
    assert st["numpy"]["keys"].dtype == np.uint32 and st["numpy"]["kind"] == "MT19937"


def test_bad_state_is_value_error() -> None:
    with pytest.raises(ValueError):
        RNGState().load_state_dict({"python": {"state": "x"}})
    with pytest.raises(ValueError):
        RNGState().load_state_dict([])  # type: ignore[arg-type]


def test_import_needs_no_torch() -> None:
    code = (
        "import sys\n"
        "from epochal.integrations.rng import RNGState\n"
        "st = RNGState().state_dict()\n"
        "assert 'torch' not in st and 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_torch_generators_replay() -> None:
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    torch.manual_seed(3)
    rng = RNGState()
    st = rng.state_dict()
    assert "torch" in st and st["torch"]["cpu"].dtype == torch.uint8
    saved = _Holder(roundtrip(rng))
    expected = (torch.rand(4), torch.nn.functional.dropout(torch.ones(8), 0.5), draws())
    torch.manual_seed(42)
    roundtrip(saved, existing=RNGState())
    got = (torch.rand(4), torch.nn.functional.dropout(torch.ones(8), 0.5), draws())
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert got[2] == expected[2]
