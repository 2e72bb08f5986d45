"""Loads into live tensors, modules and optimizers read verified bytes straight into the live
memory (no staging, no copy): bit-exact, same results as the staged path, and a damaged file
or a mismatch leaves every live object bit for bit untouched."""

from __future__ import annotations

import copy
import mmap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")

from epochal.errors import BlobMismatchError, CheckpointCorruptError  # noqa: E402
from epochal.storage.formats.native import NativeBackend, NativeFile, write_native  # noqa: E402
from epochal.storage.formats.native.reads import inplace  # noqa: E402
from epochal.storage.io import tuning  # noqa: E402

W = 600  # a 600 x 600 float32 weight is 1.4 MiB: big enough to be read in place


@pytest.fixture()
def direct_log(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Names of the blobs whose segments went through the in-place path, per read."""
    log: list[list[str]] = []
    orig = inplace.read_direct

    def spy(f: Any, plan: Any, direct: Any, staged: Any = None) -> None:
        log.append([d.name for d in direct])
        orig(f, plan, direct, staged)

    monkeypatch.setattr(inplace, "read_direct", spy)
    return log


def make(seed: int, layers: int = 3, width: int = W) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def snapshot(model: Any, opt: Any) -> dict[str, Any]:
    """A deep, bit-level picture of a model and its optimizer."""
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": copy.deepcopy(opt.state_dict()),
    }


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                           b.contiguous().reshape(-1).view(torch.uint8))  # bit for bit
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


def seg_offset(path: Path, blob: str, seg: int = 0) -> tuple[int, int]:
    with NativeFile(path, mmap=False) as f:
        idx = f._index
        i = idx.find(blob)
        assert i is not None
        k = int(idx.recs["seg_first"][i]) + seg
        return int(idx.segs["offset"][k]), int(idx.segs["length"][k])


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def big_segment(path: Path, blob: str) -> tuple[int, int]:
    """(offset, length) of the first segment of ``blob`` that is read in place."""
    with NativeFile(path, mmap=False) as f:
        idx = f._index
        i = idx.find(blob)
        assert i is not None
        for k in idx.seg_range(i):
            if int(idx.segs["length"][k]) >= tuning.BIG_SEGMENT:
                return int(idx.segs["offset"][k]), int(idx.segs["length"][k])
    raise AssertionError("no big segment")


def test_module_and_optimizer_restored_in_place(tmp_path: Path, direct_log: list[list[str]]) -> None:
    src_model, src_opt = make(0)
    want = snapshot(src_model, src_opt)
    path = tmp_path / "ck.db"
    write_native(path, {"model": src_model, "opt": src_opt})
    model, opt = make(1)
    params = [(p, p.data_ptr()) for p in model.parameters()]
    big_state = {(i, k): v for i, st in enumerate(opt.state.values())
                 for k, v in st.items() if v.numel() * v.element_size() >= tuning.BIG_SEGMENT}
    out = NativeBackend().read(str(path), existing={"model": model, "opt": opt})
    assert out["model"] is model and out["opt"] is opt
    assert sorted(set(direct_log[0])) == ["model", "opt"]
    # parameters are the same objects over the same memory, now holding the saved bytes
    assert [(p, p.data_ptr()) for p in model.parameters()] == params
    assert_same(snapshot(model, opt), want)
    # big optimizer state tensors were read into in place and are still the live state
    after = {(i, k): v for i, st in enumerate(opt.state.values()) for k, v in st.items()}
    assert big_state and all(after[key] is t for key, t in big_state.items())
    # training goes on identically from both
    for m, o in ((model, opt), (src_model, src_opt)):
        torch.manual_seed(5)
        loss = m(torch.randn(4, W)).square().sum()
        loss.backward()
        o.step()
    assert_same(snapshot(model, opt), snapshot(src_model, src_opt))


def test_same_result_as_staged_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src_model, src_opt = make(0)
    path = tmp_path / "ck.db"
    write_native(path, {"model": src_model, "opt": src_opt, "t": torch.randn(W, W)})
    fast_m, fast_o = make(1)
    fast_t = torch.zeros(W, W)
    NativeBackend().read(str(path), existing={"model": fast_m, "opt": fast_o, "t": fast_t})
    monkeypatch.setattr(inplace, "direct_targets", lambda f, plan, existing: [])
    slow_m, slow_o = make(1)
    slow_t = torch.zeros(W, W)
    NativeBackend().read(str(path), existing={"model": slow_m, "opt": slow_o, "t": slow_t})
    assert_same(snapshot(fast_m, fast_o), snapshot(slow_m, slow_o))
    assert_same(fast_t, slow_t)
    assert [type(v) for st in fast_o.state.values() for v in st.values()] == \
        [type(v) for st in slow_o.state.values() for v in st.values()]


def test_live_tensor_in_place(tmp_path: Path, direct_log: list[list[str]]) -> None:
    saved = torch.randn(W, W, dtype=torch.float64)
    path = tmp_path / "t.db"
    write_native(path, {"t": saved, "p": torch.nn.Parameter(torch.randn(W, W))})
    live = torch.zeros(W, W, dtype=torch.float64)
    param = torch.nn.Parameter(torch.zeros(W, W))
    ptr = live.data_ptr()
    out = NativeBackend().read(str(path), existing={"t": live, "p": param})
    assert len(direct_log) == 1 and sorted(direct_log[0]) == ["p", "t"]
    assert out["t"] is live and live.data_ptr() == ptr and torch.equal(live, saved)
    assert out["p"] is param and param.requires_grad


def test_non_contiguous_live_tensor_is_staged(tmp_path: Path, direct_log: list[list[str]]) -> None:
    saved = torch.randn(W, W)
    path = tmp_path / "t.db"
    write_native(path, {"t": saved})
    live = torch.zeros(W, W).t()  # a transposed view: its memory is not in C order
    NativeBackend().read(str(path), existing={"t": live})
    assert direct_log == []
    assert torch.equal(live, saved)


@pytest.mark.parametrize("where", ["model-big", "model-small", "opt-big", "tensor"])
@pytest.mark.parametrize("mapped", [True, False])
def test_damaged_file_leaves_live_objects_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, mapped: bool
) -> None:
    if not mapped:  # the streamed verification used when the file cannot be mapped
        def no_map(*a: Any, **k: Any) -> Any:
            raise OSError("no mmap here")
        monkeypatch.setattr(mmap, "mmap", no_map)
    src_model, src_opt = make(0)
    path = tmp_path / "ck.db"
    write_native(path, {"model": src_model, "opt": src_opt, "tensor": torch.randn(W, W)})
    blob = where.split("-")[0]
    if where == "model-small":  # a bias: staged, not read in place
        off, ln = seg_offset(path, "model", 1)
        assert ln < tuning.BIG_SEGMENT
    else:
        off, ln = big_segment(path, blob)
    flip(path, off + ln // 2)
    model, opt = make(1)
    tensor = torch.full((W, W), 3.0)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointCorruptError) as ei:
        NativeBackend().read(str(path), existing={"model": model, "opt": opt, "tensor": tensor})
    assert ei.value.blob == blob
    assert_same(snapshot(model, opt), before)
    assert torch.equal(tensor, torch.full((W, W), 3.0))


def test_damaged_padding_leaves_live_untouched(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    write_native(path, {"t": torch.randn(W * W + 3)})  # 4 * (W*W + 3) bytes: padded
    off, ln = seg_offset(path, "t")
    assert ln % 64
    flip(path, off + ln + 1)
    live = torch.zeros(W * W + 3)
    with pytest.raises(CheckpointCorruptError, match="padding"):
        NativeBackend().read(str(path), existing={"t": live})
    assert not live.any()


def test_shape_mismatch_raises_before_anything_is_written(tmp_path: Path) -> None:
    src_model, src_opt = make(0)
    path = tmp_path / "ck.db"
    write_native(path, {"model": src_model, "opt": src_opt})
    torch.manual_seed(3)
    # same first two layers (they would be read in place), a different last one
    model = torch.nn.Sequential(torch.nn.Linear(W, W), torch.nn.Linear(W, W), torch.nn.Linear(W, W + 1))
    opt = torch.optim.Adam(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_model, opt_opt = make(1)
    opt_before = snapshot(opt_model, opt_opt)
    with pytest.raises(BlobMismatchError) as ei:
        NativeBackend().read(str(path), existing={"model": model, "opt": opt})
    msg = str(ei.value)
    assert "'model'" in msg and "2.weight" in msg and str((W, W)) in msg and str((W + 1, W)) in msg
    assert_same({k: v.clone() for k, v in model.state_dict().items()}, before)
    # the optimizer blob (after the model in the file) was not touched either, even when
    # it alone is fine: here a live optimizer whose state fits, next to the bad model
    with pytest.raises(BlobMismatchError):
        NativeBackend().read(str(path), existing={"model": model, "opt": opt_opt})
    assert_same(snapshot(opt_model, opt_opt), opt_before)


def test_tensor_mismatch_raises_before_anything_is_written(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    write_native(path, {"a": torch.randn(W, W), "b": torch.randn(W, W)})
    a = torch.zeros(W, W)
    b = torch.zeros(W, W, dtype=torch.float64)
    with pytest.raises(BlobMismatchError, match=r"blob 'b'.*float32.*float64"):
        NativeBackend().read(str(path), existing={"a": a, "b": b})
    assert not a.any() and not b.any()


def test_partial_load(tmp_path: Path, direct_log: list[list[str]]) -> None:
    src_model, src_opt = make(0)
    path = tmp_path / "ck.db"
    write_native(path, {"model": src_model, "opt": src_opt})
    model, opt = make(1)
    opt_before = copy.deepcopy(opt.state_dict())
    out = NativeBackend().read(str(path), ["model", "nope"], allow_incomplete=True,
                               existing={"model": model, "opt": opt})
    assert list(out) == ["model"] and direct_log == [["model"] * 3]
    assert_same({k: v for k, v in model.state_dict().items()}, dict(src_model.state_dict()))
    assert_same(opt.state_dict(), opt_before)
    with NativeFile(path, mmap=False) as f:
        f.read(["opt"], existing={"opt": opt})
    assert_same(opt.state_dict(), src_opt.state_dict())


def test_fresh_optimizer_and_other_dtype_fall_back_correctly(
    tmp_path: Path, direct_log: list[list[str]]
) -> None:
    src_model, src_opt = make(0)
    path = tmp_path / "ck.db"
    write_native(path, {"model": src_model, "opt": src_opt})
    model = copy.deepcopy(src_model).double()  # load_state_dict converts float32 -> float64
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # no state yet: another structure
    NativeBackend().read(str(path), existing={"model": model, "opt": opt})
    assert direct_log == []
    for k, v in src_model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v.double())
    got, want = opt.state_dict()["state"], src_opt.state_dict()["state"]
    assert list(got) == list(want)
    for k, st in want.items():  # Adam casts its state to the parameters' dtype
        assert list(got[k]) == list(st)
        assert all(torch.equal(got[k][n], v.to(got[k][n].dtype)) for n, v in st.items())


def test_tied_weights(tmp_path: Path) -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(W, W, bias=False)
            self.b = torch.nn.Linear(W, W, bias=False)
            self.b.weight = self.a.weight

    src = Tied()
    path = tmp_path / "t.db"
    write_native(path, {"m": src})
    live = Tied()
    NativeBackend().read(str(path), existing={"m": live})
    assert live.b.weight is live.a.weight and torch.equal(live.a.weight, src.a.weight)
    # saved untied, loaded into a tied model: the staged result (the last key wins)
    untied = torch.nn.Sequential(torch.nn.Linear(W, W, bias=False), torch.nn.Linear(W, W, bias=False))
    path2 = tmp_path / "u.db"
    write_native(path2, {"m": untied})
    seq = torch.nn.Sequential(torch.nn.Linear(W, W, bias=False), torch.nn.Linear(W, W, bias=False))
    seq[1].weight = seq[0].weight
    NativeBackend().read(str(path2), existing={"m": seq})
    assert torch.equal(seq[0].weight, untied[1].weight)


def test_load_pre_hook_disables_in_place(tmp_path: Path, direct_log: list[list[str]]) -> None:
    src = torch.nn.Linear(W, W)
    path = tmp_path / "t.db"
    write_native(path, {"m": src})
    live = torch.nn.Linear(W, W)
    seen: list[int] = []
    live._register_load_state_dict_pre_hook(lambda *a, **k: seen.append(1))
    NativeBackend().read(str(path), existing={"m": live})
    assert direct_log == [] and seen
    assert torch.equal(live.weight, src.weight)


def test_verify_false_and_mmap_reads(tmp_path: Path, direct_log: list[list[str]]) -> None:
    src_model, src_opt = make(0)
    path = tmp_path / "ck.db"
    write_native(path, {"model": src_model, "opt": src_opt})
    model, opt = make(1)
    NativeBackend().read(str(path), existing={"model": model, "opt": opt}, verify=False)
    assert len(direct_log) == 1
    assert_same(snapshot(model, opt), snapshot(src_model, src_opt))
    model, opt = make(1)
    with NativeFile(path, mmap=True) as f:  # the mapped reader keeps copying from the map
        f.read(existing={"model": model, "opt": opt})
    assert len(direct_log) == 1
    assert_same(snapshot(model, opt), snapshot(src_model, src_opt))
