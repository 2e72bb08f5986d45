"""torch tensors and state dicts as blobs: every dtype bit for bit, devices, in-place loads."""

from __future__ import annotations

import json
import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")

from epochal.errors import BlobMismatchError, UnsupportedBlobError  # noqa: E402
from epochal.storage.encoding import codecs  # noqa: E402
from epochal.storage.encoding.codecs import LOAD_OPTIONS, LoadOptions, load_options  # noqa: E402


def roundtrip(value: Any, existing: Any = None, *, tamper: Any = None) -> Any:
    """Encode, JSON the meta, copy the bytes into allocated buffers, decode (a format's job)."""
    enc = codecs.encode(value, "blob")
    meta = json.loads(json.dumps(enc.meta))
    if tamper is not None:
        tamper(meta)
    codec = codecs.codec_for_kind(enc.kind)
    bufs = codec.allocate(meta, [s.nbytes for s in enc.segments])
    for b, s in zip(bufs, enc.segments):
        if s.nbytes:
            memoryview(b).cast("B")[:] = memoryview(s).cast("B")
    return codec.decode(meta, bufs, existing)


def raw(t: Any) -> bytes:
    if t.numel() == 0:
        return b""
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def all_dtypes() -> list[Any]:
    out = []
    for name in dir(torch):
        dt = getattr(torch, name)
        if isinstance(dt, torch.dtype) and dt not in out and not str(dt).startswith("torch.q"):
            out.append(dt)
    return out


def random_bits(dt: Any, shape: tuple[int, ...], seed: int = 0) -> Any:
    """A tensor of dtype ``dt`` whose bytes are random: NaN payloads, -0.0, denormals, all."""
    n = int(np.prod(shape)) * dt.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dt)
    b = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if dt == torch.bool:
        b &= 1
    return torch.from_numpy(b).view(dt).reshape(shape)


DTYPES = all_dtypes()
SHAPES = [(), (0,), (3, 0, 2), (7,), (2, 3, 4)]


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_dtype_and_shape_bit_exact(dt: Any, shape: tuple[int, ...]) -> None:
    t = random_bits(dt, shape)
    out = roundtrip(t)
    assert type(out) is torch.Tensor
    assert out.dtype == dt and tuple(out.shape) == shape and out.device.type == "cpu"
    assert raw(out) == raw(t)


def test_special_float_values() -> None:
    bits = torch.tensor(
        [0x7FF8_0000_DEAD_BEEF, -(2**63), 0xFFF0_0000_0000_0001 - 2**64, 1], dtype=torch.int64
    )
    t = bits.view(torch.float64)
    out = roundtrip(t)
    assert out.view(torch.int64).tolist() == bits.tolist()
    bf = torch.tensor([-0.0, float("nan"), float("inf"), 1e-40], dtype=torch.bfloat16)
    assert raw(roundtrip(bf)) == raw(bf)


def test_no_numpy_detour_for_bfloat16() -> None:
    t = torch.randn(5).to(torch.bfloat16)
    enc = codecs.encode(t)
    assert enc.meta["dtype"] == "bfloat16" and enc.segments[0].nbytes == 10


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(24.0).reshape(4, 6).t(),
        lambda: torch.arange(24.0)[::3],
        lambda: torch.arange(24, dtype=torch.int16).reshape(2, 3, 4)[:, 1:, ::2],
        lambda: torch.ones(3).expand(4, 3),
        lambda: torch.arange(10.0)[4:],
        lambda: torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t(),
        lambda: torch.randn(3, 2, dtype=torch.complex64).conj(),
        lambda: torch.randn(3, dtype=torch.complex128).conj().imag,
    ],
)
def test_non_contiguous_and_views(make: Any) -> None:
    t = make()
    out = roundtrip(t)
    assert out.is_contiguous() and tuple(out.shape) == tuple(t.shape)
    assert torch.equal(out, t.resolve_conj().resolve_neg())
    assert raw(out) == raw(t.resolve_conj().resolve_neg())


def test_zero_copy_encode_of_contiguous_tensor() -> None:
    t = torch.arange(1000.0)
    seg = codecs.encode(t).segments[0]
    t[0] = 42.0
    assert np.frombuffer(seg, dtype=np.float32)[0] == 42.0


def test_parameter_and_requires_grad() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    out = roundtrip(p)
    assert isinstance(out, torch.nn.Parameter) and out.requires_grad
    assert torch.equal(out, p)
    t = torch.randn(2, requires_grad=True)
    assert roundtrip(t).requires_grad
    assert not roundtrip(torch.randn(2)).requires_grad


def test_existing_tensor_loaded_in_place() -> None:
    live = torch.zeros(2, 3)
    model_view = live  # e.g. a model that shares its parameter with the workspace
    saved = torch.arange(6.0).reshape(2, 3)
    out = roundtrip(saved, existing=live)
    assert out is live and torch.equal(model_view, saved)


def test_existing_parameter_loaded_in_place() -> None:
    lin = torch.nn.Linear(3, 2)
    saved = torch.randn(2, 3)
    out = roundtrip(saved, existing=lin.weight)
    assert out is lin.weight and torch.equal(lin.weight.detach(), saved)
    assert lin.weight.requires_grad


def test_existing_tensor_shape_mismatch_names_both_shapes() -> None:
    with pytest.raises(BlobMismatchError, match=r"\(2, 3\).*\(3, 2\)"):
        roundtrip(torch.zeros(2, 3), existing=torch.zeros(3, 2))
    with pytest.raises(BlobMismatchError, match="dtype"):
        roundtrip(torch.zeros(2), existing=torch.zeros(2, dtype=torch.float64))


def test_missing_device_falls_back_to_cpu_with_warning() -> None:
    def to_cuda7(meta: dict[str, Any]) -> None:
        meta["device"] = "cuda:7"

    with pytest.warns(RuntimeWarning, match="cuda:7"):
        out = roundtrip(torch.ones(2), tamper=to_cuda7)
    assert out.device.type == "cpu" and torch.equal(out, torch.ones(2))


def test_map_location_option() -> None:
    def to_cuda7(meta: dict[str, Any]) -> None:
        meta["device"] = "cuda:7"

    for opts in (LoadOptions(map_location="cpu"), LoadOptions(map_location={"cuda:7": "cpu"}),
                 LoadOptions(keep_device=False)):
        with load_options(opts):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                out = roundtrip(torch.ones(2), tamper=to_cuda7)
        assert LOAD_OPTIONS.get() == LoadOptions()  # put back after the block
        assert out.device.type == "cpu"


def test_refused_tensors() -> None:
    with pytest.raises(UnsupportedBlobError, match="layout"):
        codecs.encode(torch.eye(3).to_sparse(), "s")
    with pytest.raises(UnsupportedBlobError, match="meta"):
        codecs.encode(torch.empty(3, device="meta"), "m")


@pytest.mark.parametrize(
    "meta",
    [
        {"dtype": "__class__", "shape": [1]},
        {"dtype": "Tensor", "shape": [1]},
        {"dtype": "float32", "shape": [-1]},
        {"dtype": "float32", "shape": "1"},
    ],
)
def test_bad_tensor_meta(meta: dict[str, Any]) -> None:
    codec = codecs.codec_for_kind("torch.tensor")
    with pytest.raises(ValueError):
        codec.allocate(meta, [4])


def test_allocate_checks_sizes() -> None:
    codec = codecs.codec_for_kind("torch.tensor")
    with pytest.raises(ValueError, match="do not fit"):
        codec.allocate({"dtype": "float32", "shape": [3]}, [8])


def test_dtype_device_generator_values() -> None:
    out = roundtrip({"d": torch.bfloat16, "dev": torch.device("cpu")})
    assert out == {"d": torch.bfloat16, "dev": torch.device("cpu")}
    g = torch.Generator().manual_seed(3)
    live = torch.Generator().manual_seed(99)
    expected = torch.randn(4, generator=torch.Generator().manual_seed(3))
    assert roundtrip(g, existing=live) is live
    assert torch.equal(torch.randn(4, generator=live), expected)
    fresh = roundtrip(g)
    assert torch.equal(torch.randn(4, generator=fresh), expected)


# ------------------------------------------------------------ stateful torch objects
def make_model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )


def train_steps(model: Any, opt: Any, sched: Any, n: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(16, 4, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def state_equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(state_equal, a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)
    return bool(a == b) and type(a) is type(b)


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.SGD, torch.optim.AdamW])
def test_module_optimizer_scheduler_restored_in_place(opt_cls: Any) -> None:
    model = make_model()
    kwargs = {"momentum": 0.9} if opt_cls is torch.optim.SGD else {}
    opt = opt_cls(model.parameters(), lr=0.01, **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train_steps(model, opt, sched, 3)

    model2 = make_model(seed=5)
    opt2 = opt_cls(model2.parameters(), lr=0.5, **kwargs)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    weight_ref = model2[0].weight
    assert roundtrip(model, existing=model2) is model2
    assert roundtrip(opt, existing=opt2) is opt2
    assert roundtrip(sched, existing=sched2) is sched2
    assert model2[0].weight is weight_ref  # in place: the same Parameter objects
    assert state_equal(model.state_dict(), model2.state_dict())
    assert state_equal(opt.state_dict(), opt2.state_dict())
    assert sched.state_dict() == sched2.state_dict()
    # and training continues identically
    train_steps(model, opt, sched, 2)
    train_steps(model2, opt2, sched2, 2)
    assert state_equal(model.state_dict(), model2.state_dict())


def test_optimizer_state_keeps_dtype_and_int_keys() -> None:
    model = make_model().to(torch.float64)
    opt = torch.optim.Adam(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    train_steps_f64 = lambda: model(torch.randn(4, 4, dtype=torch.float64)).sum().backward()  # noqa: E731
    train_steps_f64()
    opt.step()
    del sched
    out = roundtrip(opt)
    assert set(out["state"]) == set(opt.state_dict()["state"])
    assert all(isinstance(k, int) for k in out["state"])
    assert out["state"][0]["exp_avg"].dtype == torch.float64
    assert isinstance(out["param_groups"][0]["betas"], tuple)


def test_module_state_dict_without_live_object() -> None:
    model = make_model()
    out = roundtrip(model)
    assert state_equal(dict(out), dict(model.state_dict()))
    assert getattr(out, "_metadata", None) == model.state_dict()._metadata


def test_grad_scaler_roundtrip() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    live = torch.amp.GradScaler("cpu")
    assert roundtrip(scaler, existing=live) is live
    assert live.state_dict() == scaler.state_dict()


def test_state_dict_shape_mismatch_names_entry_and_both_shapes() -> None:
    saved = torch.nn.Linear(4, 3)
    live = torch.nn.Linear(4, 5)
    before = live.weight.detach().clone()
    with pytest.raises(BlobMismatchError) as ei:
        roundtrip(saved, existing=live)
    msg = str(ei.value)
    assert "weight" in msg and "(3, 4)" in msg and "(5, 4)" in msg
    assert torch.equal(live.weight.detach(), before)  # untouched


def test_tied_weights_stored_once() -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    enc = codecs.encode(model)
    assert len(enc.segments) == 1
    out = roundtrip(model)
    assert out["emb.weight"] is out["head.weight"]
