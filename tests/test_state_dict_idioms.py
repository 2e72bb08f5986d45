"""``state = {"model": model.state_dict(), ...}`` restores the model in
place (its tensors alias the parameters), an optimizer's state_dict() held in the state is
restored in place only where nothing is lost and refused otherwise, and a live module,
sampler or RNGState is never swapped for a saved value of another kind."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from epochal import Checkpointer  # noqa: E402
from epochal.errors import BlobMismatchError  # noqa: E402


def _model(seed: int) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _trained(seed: int = 1) -> tuple[Any, Any]:
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    return model, opt


def _bits(model: Any) -> dict[str, bytes]:
    return {k: v.detach().numpy().tobytes() for k, v in model.state_dict().items()}


def _opt_bits(opt: Any) -> dict[tuple[int, str], bytes]:
    return {(i, k): v.numpy().tobytes() for i, st in opt.state_dict()["state"].items() for k, v in st.items()}


@pytest.mark.parametrize("saved_as", ["module", "state_dict"])
def test_both_idioms_restore_the_same_model_bits(tmp_path, saved_as):
    model, opt = _trained()
    want = _bits(model)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model if saved_as == "module" else model.state_dict()})
    restored = {}
    for idiom in ("module", "state_dict"):
        fresh = _model(seed=99)
        assert _bits(fresh) != want
        state = {"model": fresh if idiom == "module" else fresh.state_dict()}
        with Checkpointer(tmp_path) as ckpt:
            assert ckpt.restore(state) == 1
        restored[idiom] = _bits(fresh)  # the module itself, whichever idiom held it
    assert restored["module"] == restored["state_dict"] == want


def test_an_optimizer_state_dict_is_restored_in_place_where_nothing_is_lost(tmp_path):
    model, opt = _trained(1)
    want_model, want_opt = _bits(model), _opt_bits(opt)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model.state_dict(), "opt": opt.state_dict()})
    model2, opt2 = _trained(7)  # stepped: its state exists, same lr
    assert _opt_bits(opt2) != want_opt
    state = {"model": model2.state_dict(), "opt": opt2.state_dict()}
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(state) == 1
    assert _bits(model2) == want_model and _opt_bits(opt2) == want_opt


@pytest.mark.parametrize("case", ["fresh optimizer", "other lr"])
def test_an_optimizer_state_dict_that_cannot_be_restored_in_place_is_refused(tmp_path, case):
    model, opt = _trained(1)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model.state_dict(), "opt": opt.state_dict()})
    model2 = _model(5)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    if case == "other lr":
        opt2.zero_grad()
        model2(torch.randn(5, 4)).sum().backward()
        opt2.step()
        for g in opt2.param_groups:
            g["lr"] = 0.5
    before, before_opt = _bits(model2), _opt_bits(opt2)
    state = {"model": model2.state_dict(), "opt": opt2.state_dict()}
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(BlobMismatchError, match="blob 'opt'.*hold the optimizer itself"):
            ckpt.restore(state)
    assert _bits(model2) == before and _opt_bits(opt2) == before_opt  # nothing written


def test_a_state_dict_tensor_of_another_shape_is_refused_before_anything_is_written(tmp_path):
    model, _ = _trained(1)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model.state_dict(), "w": torch.ones(3)})
    other = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.ReLU(), torch.nn.Linear(9, 2))
    w = torch.zeros(3)
    before = _bits(other)
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(BlobMismatchError, match="blob 'model'.*0.weight"):
            ckpt.restore({"model": other.state_dict(), "w": w})
    assert _bits(other) == before and w.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("saved", ["a str", ["a", "list"], {"not": "a state dict of it"}, np.arange(3)],
                         ids=["str", "list", "dict", "array"])
def test_a_live_module_is_never_swapped_for_a_plain_value(tmp_path, saved):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": saved, "x": np.zeros(2)})
    model = _model(3)
    before = _bits(model)
    state: dict[str, Any] = {"model": model, "x": np.ones(2)}
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(BlobMismatchError, match="blob 'model'"):
            ckpt.restore(state)
    assert state["model"] is model and _bits(model) == before
    assert state["x"].tolist() == [1.0, 1.0]


def test_a_live_sampler_and_rng_state_are_never_swapped(tmp_path):
    from epochal import RNGState
    from epochal.integrations.torch_data import ResumableSampler

    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"rng": "not an rng", "sampler": [1, 2, 3]})
    rng, sampler = RNGState(), ResumableSampler(list(range(10)), seed=1)
    state: dict[str, Any] = {"rng": rng, "sampler": sampler}
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(BlobMismatchError) as info:
            ckpt.restore(state)
    assert "blob 'rng'" in str(info.value) and "blob 'sampler'" in str(info.value)
    assert state["rng"] is rng and state["sampler"] is sampler


def test_a_state_dict_saved_as_a_dict_restores_a_live_module(tmp_path):
    model, _ = _trained(2)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": dict(model.state_dict())})  # a plain dict, not an OrderedDict
    fresh = _model(4)
    state = {"model": fresh}
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(state) == 1
    assert state["model"] is fresh and _bits(fresh) == _bits(model)
