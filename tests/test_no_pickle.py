"""Loading a checkpoint never unpickles: every kind of blob loads with pickle and torch.load
patched to fail."""

from __future__ import annotations

import _pickle
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal.integrations.rng import RNGState
from epochal.storage.formats.base import get_db_type


class _Stateful:
    def __init__(self) -> None:
        self.state = {"n": 3, "w": np.arange(4.0), "t": (1, "a"), 5: None}

    def state_dict(self) -> dict[Any, Any]:
        return self.state

    def load_state_dict(self, state: dict[Any, Any]) -> None:
        self.state = state


def _forbidden(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("unpickling attempted during a checkpoint load")


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    try:  # imported first: torch subclasses pickle.Unpickler at import time
        import torch
        import torch.serialization
    except ImportError:
        torch = None  # type: ignore[assignment]
    for mod in (pickle, _pickle):
        for name in ("loads", "load", "Unpickler"):
            monkeypatch.setattr(mod, name, _forbidden)
    monkeypatch.setattr(pickle, "_loads", _forbidden)
    monkeypatch.setattr(pickle, "_load", _forbidden)
    monkeypatch.setattr(pickle, "_Unpickler", _forbidden)
    if torch is None:
        return
    monkeypatch.setattr(torch, "load", _forbidden)
    monkeypatch.setattr(torch.serialization, "load", _forbidden)


def numpy_blobs() -> dict[str, Any]:
    return {
        "arr": np.arange(12, dtype=np.float16).reshape(3, 4),
        "scalar": np.int64(-5),
        "py": [None, True, 2**70, -0.0, "s", b"b"],
        "tree": {"a": {1: (np.ones(2), [])}},
        "stateful": _Stateful(),
        "rng": RNGState(),
    }


def torch_blobs() -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)
    blobs = {
        f"t_{str(dt).removeprefix('torch.')}": torch.zeros(3, dtype=dt)
        for dt in (torch.bool, torch.uint8, torch.int64, torch.float16, torch.bfloat16,
                   torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn)
    }
    blobs.update(
        model=model, opt=opt, sched=sched, param=torch.nn.Parameter(torch.ones(2)),
        scaler=torch.amp.GradScaler("cpu"), gen=torch.Generator().manual_seed(1),
        empty=torch.empty(0, 3), rng=RNGState(), dtype=torch.bfloat16,
    )
    return blobs


@pytest.mark.parametrize("with_live", [False, True], ids=["fresh", "in_place"])
def test_numpy_and_stateful_load_without_pickle(
    tmp_path: Path, with_live: bool, no_unpickling: None
) -> None:
    _roundtrip(tmp_path, numpy_blobs(), with_live)


@pytest.mark.parametrize("with_live", [False, True], ids=["fresh", "in_place"])
def test_torch_load_without_pickle(tmp_path: Path, with_live: bool, request: Any) -> None:
    pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
    blobs = torch_blobs()
    request.getfixturevalue("no_unpickling")
    _roundtrip(tmp_path, blobs, with_live)


def _roundtrip(tmp_path: Path, blobs: dict[str, Any], with_live: bool) -> None:
    backend = get_db_type("native")
    path = str(tmp_path / "node.1")
    backend.write(path, blobs)
    live = blobs if with_live else None
    out = backend.read(path, list(blobs), existing=live)
    assert set(out) == set(blobs)
    if with_live:
        for name in ("stateful", "rng", "model", "opt", "sched", "gen", "param"):
            if name in blobs:
                assert out[name] is blobs[name], name
    # the mmap reader path, too
    from epochal.storage.formats.native import open_native

    with open_native(path, mmap=True) as f:
        assert set(f.read(list(blobs))) == set(blobs)
