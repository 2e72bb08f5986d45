"""A checkpoint that does not fit the live objects is refused before any of them is written:
after the error every live model, optimizer and tensor is bit for bit what it was."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from _live import tensors as snapshot  # noqa: E402

from epochal import BlobMismatchError, get_db_type  # noqa: E402
from epochal.checkpoint.tasks.steps import LoadBlobs  # noqa: E402
from epochal.execution.workspace import Workspace  # noqa: E402


def mlp(layers: int, width: int = 8, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def stepped_adam(model: torch.nn.Module, groups: int = 1) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if groups == 1:
        opt = torch.optim.Adam(params, lr=1e-2)
    else:
        half = len(params) // 2
        opt = torch.optim.Adam([{"params": params[:half]}, {"params": params[half:], "weight_decay": 0.1}], lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return opt


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(params=["native", "safetensors"])
def db_type(request):
    if request.param == "safetensors":
        pytest.importorskip("safetensors")
    return request.param


def save(path, db_type, **blobs):
    get_db_type(db_type).write(str(path), blobs)


def load_into(path, db_type, **live):
    ws = Workspace()
    for k, v in live.items():
        ws[k] = v
    LoadBlobs(str(path), db_type, list(live), node="n", epoch=3, keep_device=True)(ws)
    return ws


@pytest.mark.parametrize("saved_layers,live_layers", [(2, 3), (3, 2)])
def test_a_model_of_another_depth_is_refused_untouched(tmp_path, db_type, saved_layers, live_layers):
    m_saved = mlp(saved_layers, seed=1)
    save(tmp_path / "db", db_type, model=m_saved, opt=stepped_adam(m_saved))
    live = mlp(live_layers, seed=2)
    opt = stepped_adam(live)
    before = snapshot(live, opt)
    with pytest.raises(BlobMismatchError) as info:
        load_into(tmp_path / "db", db_type, model=live, opt=opt)
    msg = str(info.value)
    assert "'model'" in msg and "nothing was restored" in msg and "node 'n', epoch 3" in msg, msg
    assert ("missing from the checkpoint" in msg) == (live_layers > saved_layers), msg
    assert ("live module lacks" in msg) == (saved_layers > live_layers), msg
    assert same(snapshot(live, opt), before)


def test_an_optimizer_of_another_group_layout_leaves_the_model_untouched(tmp_path, db_type):
    m = mlp(2, seed=1)
    save(tmp_path / "db", db_type, model=m, opt=stepped_adam(m, groups=1))
    live = mlp(2, seed=2)
    opt = stepped_adam(live, groups=2)
    before = snapshot(live, opt)
    with pytest.raises(BlobMismatchError, match="'opt'.*1 parameter groups, the live optimizer 2"):
        load_into(tmp_path / "db", db_type, model=live, opt=opt)
    assert same(snapshot(live, opt), before)  # the model blob fits, but was not restored either


def test_a_group_of_another_size_is_refused(tmp_path, db_type):
    m = mlp(2, seed=1)
    save(tmp_path / "db", db_type, opt=stepped_adam(m, groups=2))
    m2 = mlp(2, seed=2)
    params = list(m2.parameters())
    opt = torch.optim.Adam([{"params": params[:1]}, {"params": params[1:]}])
    with pytest.raises(BlobMismatchError, match="parameter group 0 has 2 parameters in the checkpoint, 1"):
        load_into(tmp_path / "db", db_type, opt=opt)


def test_a_tensor_of_another_shape_after_a_model_leaves_both_untouched(tmp_path, db_type):
    m = mlp(2, seed=1)
    save(tmp_path / "db", db_type, a_model=m, z_tensor=torch.ones(5))
    live, t = mlp(2, seed=2), torch.zeros(6)
    before = snapshot(live, t)
    with pytest.raises(BlobMismatchError, match="'z_tensor'.*shape"):
        load_into(tmp_path / "db", db_type, a_model=live, z_tensor=t)
    assert same(snapshot(live, t), before)
    t2 = torch.zeros(5, dtype=torch.float64)  # another dtype: refused too
    with pytest.raises(BlobMismatchError, match="dtype"):
        load_into(tmp_path / "db", db_type, a_model=live, z_tensor=t2)
    assert same(snapshot(live), before[:-1])


def test_a_nested_module_in_a_dict_is_checked(tmp_path, db_type):
    m = mlp(2, seed=1)
    save(tmp_path / "db", db_type, state={"model": m, "step": 3})
    live = mlp(3, seed=2)
    before = snapshot(live)
    with pytest.raises(BlobMismatchError, match=r"model.*keys missing from the checkpoint: 4.bias, 4.weight"):
        load_into(tmp_path / "db", db_type, state={"model": live, "step": 0})
    assert same(snapshot(live), before)


def test_a_fitting_checkpoint_still_restores_bit_for_bit(tmp_path, db_type):
    m = mlp(2, seed=1)
    opt = stepped_adam(m, groups=2)
    save(tmp_path / "db", db_type, model=m, opt=opt)
    live = mlp(2, seed=2)
    lopt = stepped_adam(live, groups=2)
    load_into(tmp_path / "db", db_type, model=live, opt=lopt)
    assert same(snapshot(live, lopt), snapshot(m, opt))


def test_native_checks_live_objects_inside_its_read(tmp_path, monkeypatch):
    """The native read checks every live object itself, with the index it opened (no second
    open to describe the db), and refuses the whole load untouched, naming every blob that
    does not fit; called directly too, without a loader step."""
    from epochal.storage.formats.native import NativeBackend

    m = mlp(2, seed=1)
    save(tmp_path / "db", "native", a=m, b=stepped_adam(m), c=torch.ones(3))
    described = []
    monkeypatch.setattr(NativeBackend, "describe", lambda self, path: described.append(path) or [])
    live, t = mlp(3, seed=2), torch.zeros(4)
    opt = stepped_adam(live)
    before = snapshot(live, opt, t)
    with pytest.raises(BlobMismatchError) as info:
        load_into(tmp_path / "db", "native", a=live, b=opt, c=t)
    msg = str(info.value)
    assert "node 'n', epoch 3" in msg and "nothing was restored" in msg
    assert "blob 'a'" in msg and "blob 'b'" in msg and "blob 'c'" in msg, msg
    assert same(snapshot(live, opt, t), before) and described == []
    with pytest.raises(BlobMismatchError, match=r"checkpoint .*db does not fit the live objects.*blob 'c'"):
        get_db_type("native").read(str(tmp_path / "db"), ["c"], existing={"c": t})
    assert same(snapshot(t), before[-1:])
    fits = mlp(2, seed=3)
    load_into(tmp_path / "db", "native", a=fits)
    assert same(snapshot(fits), snapshot(m)) and described == []
