"""PyTorch support: tensors, dtypes, devices and generators as blobs, raw and pickle-free.

Importing this module registers its codecs; :mod:`epochal.storage.encoding.codecs` imports it lazily the
first time it meets a torch value or a ``torch.*`` blob kind, so ``import epochal`` never
imports torch. Stateful torch objects (``nn.Module``, optimizers, LR schedulers, GradScaler)
need nothing here beyond tensors: :mod:`epochal.storage.encoding.tree` stores their state dicts.

Tensors (kind ``torch.tensor``) are stored as their raw bytes, taken through a ``uint8`` view of
the contiguous CPU tensor, never through numpy dtypes. So every dtype round-trips bit for bit,
bfloat16, float8, complex32 and the bit/sub-byte dtypes included, as do NaN payloads and -0.0.
The meta records dtype name, shape, device and ``requires_grad``; a dtype is found again by
name as an attribute of ``torch`` that must be a ``torch.dtype``: nothing is evaluated.

Where a loaded tensor goes, in order:

1. a live tensor in the workspace under the blob's name receives the data in place
   (``copy_``): a model that shares its parameters with the workspace sees the restored
   values. Shape and dtype must match, else :class:`~epochal.errors.BlobMismatchError`;
2. the ``map_location`` of the load's :class:`~epochal.storage.encoding.codecs.LoadOptions` (a device, a device string, or a dict mapping saved device
   strings to targets), when set, maps the tensor there;
3. with ``keep_device`` (the default, as in the seed's Load), back to the device it was saved
   from when that device exists here; otherwise to the CPU with a warning.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import BlobMismatchError, UnsupportedBlobError
from ..storage.encoding import tree as _tree  # state dicts of torch objects need it
from ..storage.encoding.codecs import (
    LOAD_OPTIONS,
    Encoded,
    LoadOptions,
    buffer_address,
    check_shape,
    register_codec,
)
from ..storage.encoding.fit import BLOB, KeyReport
from ..storage.encoding.staged import staged

__all__ = [
    "TensorCodec",
    "TorchDtypeCodec",
    "TorchDeviceCodec",
    "GeneratorCodec",
    "dtype_from_name",
    "resolve_device",
]


#: every dtype torch defines, by name: what a checkpoint may name (never a getattr on torch,
#: which would import whatever submodule a forged name says, ``onnx`` say)
_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}


def dtype_from_name(name: Any) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``); ValueError for anything else."""
    if not isinstance(name, str) or len(name) > 64:
        raise ValueError(f"bad torch dtype name {str(name)[:80]!r}")
    dt = _DTYPES.get(name)
    if dt is None:
        raise ValueError(f"unknown torch dtype {name!r}")
    return dt


def parse_device(text: Any) -> torch.device:
    """``torch.device(text)`` for a string a checkpoint holds; ValueError (not torch's raw
    RuntimeError) for anything torch does not parse."""
    if not isinstance(text, str) or len(text) > 64:
        raise ValueError(f"bad device {str(text)[:80]!r}")
    try:
        return torch.device(text)
    except (RuntimeError, TypeError, ValueError) as ex:
        raise ValueError(f"bad device {text!r}: {ex}") from None


def dtype_name(dt: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dt).removeprefix("torch.")


_available: dict[str, bool] = {}


def _device_available(dev: torch.device) -> bool:
    """True when tensors can be placed on ``dev`` in this process (cached per device)."""
    key = str(dev)
    if key not in _available:
        if dev.type == "cpu":
            ok = True
        elif dev.type == "cuda":
            ok = torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()
        else:
            try:
                torch.empty(0, device=dev)
                ok = dev.type != "meta"
            except Exception:
                ok = False
        _available[key] = ok
    return _available[key]


def resolve_device(saved: str, options: LoadOptions | None = None) -> torch.device:
    """The device a tensor saved from ``saved`` goes to under ``options`` (those of the load
    in progress when None; see the module doc)."""
    opts = LOAD_OPTIONS.get() if options is None else options
    ml = opts.map_location
    if isinstance(ml, dict):
        ml = ml.get(saved)
    if ml is not None:
        if not isinstance(ml, (str, torch.device)):
            raise TypeError(f"map_location must be a device, a string or a dict, not {ml!r}")
        return torch.device(ml)
    if not opts.keep_device:
        return torch.device("cpu")
    try:
        dev = torch.device(saved)
    except (RuntimeError, TypeError):
        dev = None
    if dev is not None and _device_available(dev):
        return dev
    warnings.warn(
        f"a tensor was saved on device {saved!r}, which this process does not have; "
        "loading it to the CPU (pass map_location to choose a device)",
        RuntimeWarning,
        stacklevel=2,
    )
    return torch.device("cpu")


def _bytes_of(u8: torch.Tensor) -> memoryview:
    """A memoryview over a 1-d uint8 CPU tensor's memory (it keeps the tensor alive)."""
    arr: Any = u8.numpy()
    return memoryview(arr)


def _empty_buffer() -> memoryview:
    return memoryview(bytearray())


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` in C order, as a memoryview that keeps them alive (no copy when
    ``t`` is already a contiguous CPU tensor)."""
    if t.numel() == 0:
        return _empty_buffer()
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type == "cuda":
        return _cuda_bytes(t)
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    u8 = t.reshape(-1).view(torch.uint8)
    return _bytes_of(u8)  # a uint8 array over the tensor's memory: no dtype involved


def _cuda_bytes(t: torch.Tensor) -> memoryview:
    """A CUDA tensor's bytes copied into pinned host memory (torch's caching host allocator
    reuses it from save to save), the copy issued without waiting: a snapshot keeps this
    private copy as it is and waits once for all of its device copies (storage/encoding/staged);
    anywhere else the copy is waited for here."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    seg = _bytes_of(host.reshape(-1).view(torch.uint8))
    if not staged(seg, torch.cuda.synchronize):
        torch.cuda.synchronize()
    return seg


def _live_bytes(t: torch.Tensor, nbytes: int) -> memoryview | None:
    """A writable memoryview over exactly the ``nbytes`` bytes of the live tensor ``t``, when
    its memory can take raw bytes directly (a dense, contiguous, plain CPU tensor), else None."""
    if (
        nbytes == 0
        or type(t) not in (torch.Tensor, torch.nn.Parameter)
        or t.layout != torch.strided
        or t.device.type != "cpu"
        or t.is_quantized
        or t.is_nested
        or t.is_conj()
        or t.is_neg()
        or not t.is_contiguous()
        or t.numel() * t.element_size() != nbytes
    ):
        return None
    try:
        return _bytes_of(t.detach().reshape(-1).view(torch.uint8))
    except (RuntimeError, TypeError, ValueError):
        return None


def _holds(buf: memoryview, t: torch.Tensor) -> bool:
    """True when ``buf`` is the memory of the live tensor ``t`` (the bytes are in place)."""
    return (
        buf.nbytes > 0
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and t.numel() * t.element_size() == buf.nbytes
        and buffer_address(buf) == t.data_ptr()
    )


def _check_tensor(t: torch.Tensor) -> None:
    if t.layout != torch.strided:
        raise UnsupportedBlobError(f"a tensor with layout {t.layout} (only dense tensors)")
    if t.is_quantized:
        raise UnsupportedBlobError("a quantized tensor (dequantize it first)")
    if t.is_nested:
        raise UnsupportedBlobError("a nested tensor")
    if t.device.type == "meta":
        raise UnsupportedBlobError("a tensor on the meta device has no data")
    if isinstance(t, torch.nn.parameter.UninitializedParameter):
        raise UnsupportedBlobError("an uninitialized (lazy) parameter")
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedBlobError(
            f"a tensor subclass {type(t).__module__}.{type(t).__qualname__} "
            "(only torch.Tensor and nn.Parameter are stored)"
        )


class TensorCodec:
    """Dense torch tensors and parameters of every dtype, stored as raw bytes."""

    kind = "torch.tensor"
    #: a tensor leaf of a plain container (a state dict held in the state) is copied into the
    #: live tensor there (it aliases a parameter, a buffer or optimizer state): see storage.tree
    inplace_leaf = True

    def accepts(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def encode(self, value: Any) -> Encoded:
        t: torch.Tensor = value
        _check_tensor(t)
        meta: dict[str, Any] = {
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "device": str(t.device),
        }
        if t.requires_grad:
            meta["requires_grad"] = True
        if isinstance(t, torch.nn.Parameter):
            meta["parameter"] = True
        return Encoded(self.kind, meta, [_raw_bytes(t)])

    @staticmethod
    def _layout(meta: dict[str, Any]) -> tuple[torch.dtype, tuple[int, ...], int]:
        dt = dtype_from_name(meta.get("dtype"))
        shape = check_shape(meta.get("shape"))
        return dt, shape, math.prod(shape) * dt.itemsize

    #: decode takes any fresh buffer of the segment's size (``torch.frombuffer``): a reader
    #: may place it congruent to its file offset for O_DIRECT (native reader.allocate)
    placeable = True

    def allocate(self, meta: dict[str, Any], sizes: Sequence[int]) -> list[memoryview]:
        dt, shape, nbytes = self._layout(meta)
        if len(sizes) != 1 or sizes[0] != nbytes:
            raise ValueError(f"{list(sizes)} bytes do not fit a {dt} tensor of shape {shape}")
        if nbytes == 0:
            return [_empty_buffer()]
        return [_bytes_of(torch.empty(nbytes, dtype=torch.uint8))]

    @staticmethod
    def _check_live(existing: torch.Tensor, dt: torch.dtype, shape: tuple[int, ...]) -> None:
        if tuple(existing.shape) != shape or existing.dtype != dt:
            raise BlobMismatchError(
                f"checkpoint tensor has shape {shape} and dtype {dt}, the live tensor has "
                f"shape {tuple(existing.shape)} and dtype {existing.dtype}"
            )

    def check(self, meta: dict[str, Any], existing: Any) -> None:
        """BlobMismatchError when a live tensor has another shape or dtype than the blob."""
        if isinstance(existing, torch.Tensor):
            dt, shape, _ = self._layout(meta)
            self._check_live(existing, dt, shape)

    def inplace_targets(
        self, meta: dict[str, Any], sizes: Sequence[int], existing: Any
    ) -> list[memoryview | None] | None:
        """The live CPU tensor's own memory, when the blob can be read straight into it
        (see :mod:`epochal.storage.encoding.codecs`); BlobMismatchError when it does not fit."""
        if not isinstance(existing, torch.Tensor):
            return None
        dt, shape, nbytes = self._layout(meta)
        self._check_live(existing, dt, shape)
        if len(sizes) != 1 or sizes[0] != nbytes:
            return None
        mv = _live_bytes(existing, nbytes)
        return None if mv is None else [mv]

    def decode(
        self, meta: dict[str, Any], buffers: Sequence[memoryview], existing: Any = None
    ) -> Any:
        dt, shape, nbytes = self._layout(meta)
        if len(buffers) != 1 or buffers[0].nbytes != nbytes:
            raise ValueError(f"the data does not fit a {dt} tensor of shape {shape}")
        buf = buffers[0]
        if isinstance(existing, torch.Tensor):
            self._check_live(existing, dt, shape)
            if _holds(buf, existing):  # read in place by the format: nothing to copy
                return existing
        if nbytes == 0:
            cpu = torch.empty(shape, dtype=dt)
        else:
            if buf.readonly:
                buf = memoryview(bytearray(buf))
            cpu = torch.frombuffer(buf, dtype=torch.uint8).view(dt).reshape(shape)
        if isinstance(existing, torch.Tensor):
            with torch.no_grad():
                existing.copy_(cpu)
            return existing
        saved_device = meta.get("device", "cpu")
        if not isinstance(saved_device, str):
            raise ValueError(f"bad device {saved_device!r}")
        dev = resolve_device(saved_device)
        t = cpu if dev.type == "cpu" else cpu.to(dev)
        rg = meta.get("requires_grad") is True and (t.is_floating_point() or t.is_complex())
        if meta.get("parameter") is True:
            return torch.nn.Parameter(t, requires_grad=rg)
        if rg:
            t.requires_grad_(True)
        return t


class TorchDtypeCodec:
    """A ``torch.dtype`` value (it appears in some state dicts), stored by name."""

    kind = "torch.dtype"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, torch.dtype)

    def encode(self, value: Any) -> Encoded:
        return Encoded(self.kind, {"name": dtype_name(value)})

    def allocate(self, meta: dict[str, Any], sizes: Sequence[int]) -> list[memoryview]:
        if list(sizes):
            raise ValueError("a torch.dtype has no data segments")
        return []

    def decode(
        self, meta: dict[str, Any], buffers: Sequence[memoryview], existing: Any = None
    ) -> Any:
        return dtype_from_name(meta.get("name"))


class TorchDeviceCodec:
    """A ``torch.device`` value, stored as its string (``"cuda:0"``), restored as it was."""

    kind = "torch.device"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, torch.device)

    def encode(self, value: Any) -> Encoded:
        return Encoded(self.kind, {"device": str(value)})

    def allocate(self, meta: dict[str, Any], sizes: Sequence[int]) -> list[memoryview]:
        if list(sizes):
            raise ValueError("a torch.device has no data segments")
        return []

    def decode(
        self, meta: dict[str, Any], buffers: Sequence[memoryview], existing: Any = None
    ) -> Any:
        return parse_device(meta.get("device"))


class GeneratorCodec:
    """A ``torch.Generator`` (e.g. a DataLoader's): its state bytes; restored in place
    (``set_state``) into a live generator, else into a new one on the saved device."""

    kind = "torch.generator"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, torch.Generator)

    def encode(self, value: Any) -> Encoded:
        state = value.get_state()
        return Encoded(self.kind, {"device": str(value.device)}, [_raw_bytes(state)])

    def allocate(self, meta: dict[str, Any], sizes: Sequence[int]) -> list[memoryview]:
        if len(sizes) != 1 or not 0 <= sizes[0] <= 1 << 24:
            raise ValueError(f"bad generator state sizes {list(sizes)}")
        return [_bytes_of(torch.empty(sizes[0], dtype=torch.uint8))]

    def decode(
        self, meta: dict[str, Any], buffers: Sequence[memoryview], existing: Any = None
    ) -> Any:
        state = torch.frombuffer(bytearray(buffers[0]), dtype=torch.uint8)
        if isinstance(existing, torch.Generator):
            gen = existing
        else:
            saved = meta.get("device", "cpu")
            dev = resolve_device(saved if isinstance(saved, str) else "cpu")
            gen = torch.Generator(device=dev)
        try:
            gen.set_state(state)
        except RuntimeError as e:
            raise BlobMismatchError(f"generator state does not fit the generator: {e}") from e
        return gen


def _inplace_stateful(obj: Any) -> bool:
    """Live torch objects whose state dict tensors may be read into in place before their
    ``load_state_dict`` runs: plain ``nn.Module`` and optimizer loading (no override, no
    load pre-hooks that could rewrite the state dict)."""
    if isinstance(obj, torch.nn.Module):
        return type(obj).load_state_dict is torch.nn.Module.load_state_dict and not any(
            m._load_state_dict_pre_hooks for m in obj.modules()
        )
    if isinstance(obj, torch.optim.Optimizer):
        return type(obj).load_state_dict is torch.optim.Optimizer.load_state_dict and not getattr(
            obj, "_optimizer_load_state_dict_pre_hooks", None
        )
    return False


def _names(keys: Any, limit: int = 8) -> str:
    keys = sorted(map(str, keys))
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _module_problems(module: Any, saved: Any, live: Any) -> list[str]:
    """What a strict ``Module.load_state_dict`` would refuse: missing and unexpected keys
    (shapes are compared by the tree codec)."""
    if not isinstance(saved, dict) or not isinstance(live, dict):
        return []
    out = []
    missing, unexpected = set(live) - set(saved), set(saved) - set(live)
    opts = LOAD_OPTIONS.get()
    if not opts.strict:  # restore(..., strict=False): load_state_dict(strict=False) takes the rest
        if isinstance(opts.keys, KeyReport):
            opts.keys.add(BLOB.get(), sorted(map(str, missing)), sorted(map(str, unexpected)))
        return []
    if missing:
        out.append(f"keys missing from the checkpoint: {_names(missing)}")
    if unexpected:
        out.append(f"keys the live module lacks: {_names(unexpected)}")
    return out


def _optimizer_problems(opt: Any, saved: Any, live: Any) -> list[str]:
    """What ``Optimizer.load_state_dict`` would refuse: another number of parameter groups,
    or groups of other sizes."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, (list, tuple)):
        return ["the checkpoint holds no param_groups"]
    if len(groups) != len(opt.param_groups):
        return [f"checkpoint has {len(groups)} parameter groups, the live optimizer {len(opt.param_groups)}"]
    out = []
    for i, (g, mine) in enumerate(zip(groups, opt.param_groups)):
        params = g.get("params") if isinstance(g, dict) else None
        n = len(params) if isinstance(params, (list, tuple)) else None
        if n != len(mine["params"]):
            out.append(f"parameter group {i} has {n} parameters in the checkpoint, "
                       f"{len(mine['params'])} in the live optimizer")
    return out


_tree.register_state_check(lambda o: isinstance(o, torch.nn.Module), _module_problems)
_tree.register_state_check(lambda o: isinstance(o, torch.optim.Optimizer), _optimizer_problems)

for _codec in (TorchDtypeCodec(), TorchDeviceCodec(), GeneratorCodec(), TensorCodec()):
    register_codec(_codec)
_tree.register_inplace_stateful(_inplace_stateful)
_tree.register_fixed_shapes(lambda obj: isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)))

from .torch_data import ResumableSampler  # noqa: E402  (epochal.integrations.torch.ResumableSampler)

__all__ += ["ResumableSampler"]
