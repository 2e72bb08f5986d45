"""Blob codecs: the one place that turns a value into raw segments plus a JSON meta, and back.

A codec never pickles. ``encode`` returns an :class:`Encoded` (a kind, a JSON-able meta dict,
and raw byte segments that a format writes as they are). Loading is two-phase so that a format
can verify every checksum before any live object is touched:

1. ``allocate(meta, sizes)`` returns fresh writable buffers, one per segment, that the format
   fills (``readinto``) and verifies;
2. ``decode(meta, buffers, existing)`` builds the value, restoring into ``existing`` (a live
   object under the same name in the workspace) in place when the codec knows how.

Optional capability, for loads into live objects: ``inplace_targets(meta, sizes, existing)``
returns, per segment, a writable flat memoryview over the memory of ``existing`` that can take
that segment's bytes directly (or None for a segment that must be staged), or None for no
target at all. It must raise :class:`~epochal.errors.BlobMismatchError` when ``existing``
does not fit, as ``decode`` would (so a mismatch is reported before anything is written). A
format may then verify those segments' checksums first and read them straight into the live
memory, skipping staging and the copy; ``decode`` then gets those views as ``buffers`` and
must recognise (:func:`same_memory`) that the bytes are already in place. A format that
ignores the capability stays correct: ``decode`` sees fresh buffers and restores as before.

Codecs are picked by ``accepts(value)`` in registration order (newest first) and found again
by ``kind`` on load. Integrations (torch) register their own codecs; the lazy table
(:func:`register_lazy_codecs`: kind prefix -> module name, install hint) imports them on first
use, by name, so the core imports with numpy alone and storage imports no integration. The
tree codec (state dicts, containers) is registered by ``epochal.storage`` itself.
"""

from __future__ import annotations

import importlib
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ...errors import UnsupportedBlobError
from .dtypes import check_shape, dtype_from_json, dtype_to_json, expected_nbytes

Buffer = memoryview

@dataclass(frozen=True)
class LoadOptions:
    """How values are loaded, for the codecs that need to know.

    - ``map_location``: where torch tensors go: a device, a device string, or a dict from
      the saved device string to a target (None: see ``keep_device``);
    - ``keep_device``: back to the device a tensor was saved from when this process has it
      (the seed's Load), else to the CPU;
    - ``where``: how errors name the load ("checkpoint DB (node N, epoch E)"; None: the file);
    - ``whole``: the load reads (nearly) every blob of the db, as a resume does, so a format
      may fetch the whole file at once (a remote db: storage/io/remote/fsspec_store.py);
    - ``strict``: a dict of tensors held in the state must have the checkpoint's key set
      (False: the keys both have are restored, the differences go to ``keys``, a
      :class:`~epochal.storage.encoding.fit.KeyReport`; see that module).
    """

    map_location: Any = None
    keep_device: bool = True
    where: str | None = None
    whole: bool = False
    strict: bool = True
    keys: Any = None


#: The :class:`LoadOptions` of the load in progress, set around a load with
#: :func:`load_options` (the codec hooks, called deep inside a format's reader, read it with
#: ``LOAD_OPTIONS.get()``); outside a load: the defaults.
LOAD_OPTIONS: ContextVar[LoadOptions] = ContextVar("epochal_load_options", default=LoadOptions())  # noqa: B039 - frozen


@contextmanager
def load_options(options: LoadOptions) -> Iterator[LoadOptions]:
    """Make ``options`` the load options of this context for the ``with`` block."""
    token = LOAD_OPTIONS.set(options)
    try:
        yield options
    finally:
        LOAD_OPTIONS.reset(token)


@dataclass
class Encoded:
    """A value ready to be written: ``segments`` are written raw, ``meta`` as JSON."""

    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    segments: list[memoryview] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


@runtime_checkable
class Codec(Protocol):
    """How one family of values becomes segments and back. See the module docstring."""

    kind: str

    def accepts(self, value: Any) -> bool: ...

    def encode(self, value: Any) -> Encoded: ...

    def allocate(self, meta: dict[str, Any], sizes: Sequence[int]) -> list[memoryview]: ...

    def decode(self, meta: dict[str, Any], buffers: Sequence[memoryview], existing: Any = None) -> Any: ...


def _bytes_view(obj: Any) -> memoryview:
    """A flat, C-contiguous uint8 view of ``obj`` (copied only when it is not contiguous)."""
    mv = memoryview(obj)
    if not mv.c_contiguous:
        mv = memoryview(np.ascontiguousarray(obj))  # type: ignore[arg-type]
    return mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv


def flat_segment(seg: Any) -> memoryview:
    """A flat unsigned-byte view of a segment to be written (copied only if it is not
    contiguous)."""
    mv = memoryview(seg)
    if mv.ndim == 1 and mv.format == "B":
        return mv
    if not mv.c_contiguous:
        return memoryview(mv.tobytes())
    return mv.cast("B")


def flat_writable(b: Any) -> memoryview:
    """A flat unsigned-byte view of a buffer a codec allocated (or a live target)."""
    mv = memoryview(b)
    if mv.ndim == 1 and mv.format == "B":
        return mv
    return mv.cast("B")


def fresh_buffers(sizes: Sequence[int]) -> list[memoryview]:
    """Uninitialised writable buffers of the given sizes (numpy's allocator: no zeroing)."""
    return [memoryview(np.empty(int(n), dtype=np.uint8)) for n in sizes]  # type: ignore[arg-type]


def buffer_address(mv: memoryview) -> int:
    """The address of the first byte of a non-empty buffer (read-only ones included)."""
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


def same_memory(a: memoryview, b: memoryview) -> bool:
    """True when the flat buffers ``a`` and ``b`` are the same non-empty bytes of memory."""
    return a.nbytes == b.nbytes and a.nbytes > 0 and buffer_address(a) == buffer_address(b)


# ---------------------------------------------------------------- codecs
class NdarrayCodec:
    """numpy arrays of every non-object dtype, any shape (0-d and empty included), raw bytes."""

    kind = "ndarray"
    placeable = True  # decode takes any fresh buffer: a reader may place it (O_DIRECT)

    def accepts(self, value: Any) -> bool:
        return isinstance(value, np.ndarray)

    def encode(self, value: Any) -> Encoded:
        arr = np.asarray(value)
        if arr.dtype.itemsize == 0 and arr.size:
            raise UnsupportedBlobError(f"an array of {arr.size} elements of the zero-byte dtype {arr.dtype}")
        meta = {"dtype": dtype_to_json(arr.dtype), "shape": list(arr.shape)}
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        return Encoded(self.kind, meta, [_bytes_view(arr.reshape(-1).view(np.uint8))
                                          if arr.size else memoryview(b"")])

    def allocate(self, meta: dict[str, Any], sizes: Sequence[int]) -> list[memoryview]:
        dt = dtype_from_json(meta.get("dtype"))
        shape = check_shape(meta.get("shape"))
        if len(sizes) != 1 or sizes[0] != expected_nbytes(dt, shape):
            raise ValueError(f"{list(sizes)} bytes do not fit dtype {dt} and shape {shape}")
        # Allocate with the final dtype so the decoded array owns aligned memory.
        arr = np.empty(shape, dtype=dt)
        flat = arr.reshape(-1).view(np.uint8)
        return [memoryview(flat) if arr.size else memoryview(bytearray())]  # type: ignore[arg-type]

    def decode(self, meta: dict[str, Any], buffers: Sequence[memoryview], existing: Any = None) -> Any:
        dt = dtype_from_json(meta.get("dtype"))
        shape = check_shape(meta.get("shape"))
        buf = buffers[0]
        if buf.nbytes != expected_nbytes(dt, shape):
            raise ValueError(f"{buf.nbytes} bytes do not fit dtype {dt} and shape {shape}")
        if buf.nbytes == 0:
            return np.empty(shape, dtype=dt)
        base = buf.obj if isinstance(buf.obj, np.ndarray) else None
        if base is not None and base.dtype == dt and base.shape == shape and buf.nbytes == base.nbytes:
            return base
        return np.frombuffer(buf, dtype=dt).reshape(shape)


class NumpyScalarCodec:
    """numpy scalars (np.float32(1.5), np.bool_(True), np.str_...), kept as their numpy type."""

    kind = "npscalar"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, np.generic)

    def encode(self, value: Any) -> Encoded:
        arr = np.asarray(value)
        return Encoded(self.kind, {"dtype": dtype_to_json(arr.dtype)}, [_bytes_view(arr.tobytes())])

    def allocate(self, meta: dict[str, Any], sizes: Sequence[int]) -> list[memoryview]:
        dt = dtype_from_json(meta.get("dtype"))
        if len(sizes) != 1 or sizes[0] != dt.itemsize:
            raise ValueError(f"{list(sizes)} bytes do not fit a scalar of dtype {dt}")
        return fresh_buffers(sizes)

    def decode(self, meta: dict[str, Any], buffers: Sequence[memoryview], existing: Any = None) -> Any:
        dt = dtype_from_json(meta.get("dtype"))
        if buffers[0].nbytes != dt.itemsize:
            raise ValueError(f"{buffers[0].nbytes} bytes do not fit a scalar of dtype {dt}")
        return np.frombuffer(buffers[0], dtype=dt)[0].copy()


class PyScalarCodec:
    """Python None, bool, int (any size), float (bit-exact: NaN payloads, -0.0), str, bytes."""

    kind = "py"

    def accepts(self, value: Any) -> bool:
        return value is None or type(value) in (bool, int, float, str, bytes, bytearray)

    def encode(self, value: Any) -> Encoded:
        t = type(value)
        if value is None:
            return Encoded(self.kind, {"type": "none"})
        if t is bool:
            return Encoded(self.kind, {"type": "bool", "value": bool(value)})
        if t is int:
            return Encoded(self.kind, {"type": "int", "value": str(value)})
        if t is float:
            bits = struct.unpack("<Q", struct.pack("<d", value))[0]
            return Encoded(self.kind, {"type": "float", "bits": f"{bits:016x}"})
        if t is str:
            return Encoded(self.kind, {"type": "str"}, [memoryview(value.encode("utf-8", "surrogatepass"))])
        return Encoded(self.kind, {"type": "bytes" if t is bytes else "bytearray"}, [memoryview(bytes(value))])

    def allocate(self, meta: dict[str, Any], sizes: Sequence[int]) -> list[memoryview]:
        return fresh_buffers(sizes)

    def decode(self, meta: dict[str, Any], buffers: Sequence[memoryview], existing: Any = None) -> Any:
        t = meta.get("type")
        if t == "none":
            return None
        if t == "bool":
            v = meta.get("value")
            if not isinstance(v, bool):
                raise ValueError("bad bool value")
            return v
        if t == "int":
            v = meta.get("value")
            if not isinstance(v, str) or len(v) > 100_000:
                raise ValueError("bad int value")
            return int(v)
        if t == "float":
            return struct.unpack("<d", struct.pack("<Q", int(str(meta.get("bits")), 16)))[0]
        if len(buffers) != 1:
            raise ValueError(f"a {t} needs one segment, got {len(buffers)}")
        if t == "str":
            return bytes(buffers[0]).decode("utf-8", "surrogatepass")
        if t == "bytes":
            return bytes(buffers[0])
        if t == "bytearray":
            return bytearray(buffers[0])
        raise ValueError(f"unknown Python scalar type {t!r}")


#: ``alloc(nbytes) -> writable flat uint8 memoryview``: where a snapshot's segment copies go
SegmentAlloc = Callable[[int], memoryview]


def _fresh_segment(nbytes: int) -> memoryview:
    return memoryview(np.empty(nbytes, dtype=np.uint8))  # type: ignore[arg-type]


class Frozen:
    """A value already encoded, with its segments copied: a snapshot that later changes to
    the live value cannot reach. Background saves write these while training goes on.

    ``alloc`` gives the memory each segment is copied into (fresh memory by default; a
    background saver passes buffers it reuses across epochs, see
    :mod:`epochal.checkpoint.tasks.background`)."""

    __slots__ = ("encoded",)

    def __init__(self, value: Any, name: str = "?", alloc: SegmentAlloc | None = None) -> None:
        self.encoded = copy_segments(encode(value, name), alloc)

    @classmethod
    def of(cls, encoded: Encoded) -> Frozen:
        """A snapshot of segments already copied (they must not change until written)."""
        frozen = cls.__new__(cls)
        frozen.encoded = encoded
        return frozen

    @property
    def nbytes(self) -> int:
        return self.encoded.nbytes


def copy_segments(enc: Encoded, alloc: SegmentAlloc | None = None,
                  keep: Callable[[Any], bool] | None = None) -> Encoded:
    """``enc`` with every segment copied into memory from ``alloc`` (fresh by default), but
    those ``keep`` says are private copies already (see :mod:`.staged`): kept as they are."""
    alloc = alloc or _fresh_segment
    copies = []
    for seg in enc.segments:
        if keep is not None and keep(seg):
            copies.append(seg)
            continue
        src = flat_segment(seg)
        if not src.nbytes:
            copies.append(memoryview(b""))
            continue
        dst = alloc(src.nbytes)
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
        copies.append(dst)
    return Encoded(enc.kind, enc.meta, copies)


class FrozenCodec:
    """Writes a :class:`Frozen` snapshot as the value it was taken of (same kind and meta), so
    it reads back with that value's own codec."""

    kind = "__frozen__"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, Frozen)

    def encode(self, value: Any) -> Encoded:
        return value.encoded  # type: ignore[no-any-return]

    def allocate(self, meta: dict[str, Any], sizes: Sequence[int]) -> list[memoryview]:
        raise ValueError("frozen snapshots are never read back as such")

    def decode(self, meta: dict[str, Any], buffers: Sequence[memoryview], existing: Any = None) -> Any:
        raise ValueError("frozen snapshots are never read back as such")


# ---------------------------------------------------------------- registry
_codecs: list[Codec] = []
_by_kind: dict[str, Codec] = {}


@dataclass(frozen=True)
class LazyCodecs:
    """Where the codecs of some blob kinds live, imported by name on first use (as fsspec's
    registry names filesystem classes), so storage imports no integration: ``module``
    registers them when imported; ``install`` says what to install when that fails;
    ``value_package``: values whose type lives in this top-level package need it to save."""

    module: str
    install: str
    value_package: str | None = None


#: blob kind prefix -> the module registering those codecs
_lazy: dict[str, LazyCodecs] = {
    "torch.": LazyCodecs("epochal.integrations.torch", "pip install 'epochal[torch]'", "torch"),
    # a sharded array saved chunk by chunk (storage/encoding/chunks.py), read into torch
    "torch.chunked_tensor": LazyCodecs("epochal.integrations.torch_chunks", "pip install 'epochal[torch]'"),
}


def register_lazy_codecs(prefix: str, module: str, install: str = "", value_package: str | None = None) -> None:
    """Load kinds starting with ``prefix`` (and save values of ``value_package``'s types) with
    the codecs that ``module`` registers when it is first needed."""
    _lazy[prefix] = LazyCodecs(module, install, value_package)


def lazy_integrations() -> list[LazyCodecs]:
    """The lazily imported integrations (see :func:`register_lazy_codecs`)."""
    return list(_lazy.values())


def register_codec(codec: Codec, *, first: bool = True) -> None:
    """Add a codec; ``first`` puts it ahead of the others when values are matched."""
    if codec.kind in _by_kind:
        _codecs.remove(_by_kind[codec.kind])
    _by_kind[codec.kind] = codec
    if first:
        _codecs.insert(0, codec)
    else:
        _codecs.append(codec)


for _c in (FrozenCodec(), NdarrayCodec(), NumpyScalarCodec(), PyScalarCodec()):
    register_codec(_c, first=False)


def _lazy_import_for_value(value: Any) -> bool:
    """Import the lazy codecs for the package of ``value``'s type; False when none apply."""
    package = (type(value).__module__ or "").split(".")[0]
    for entry in _lazy.values():
        if entry.value_package == package:
            importlib.import_module(entry.module)
            return True
    return False


def codec_for_value(value: Any, name: str = "?") -> Codec:
    """The codec that stores ``value``; :class:`UnsupportedBlobError` naming the blob if none."""
    for attempt in range(2):
        for codec in _codecs:
            if codec.accepts(value):
                return codec
        if attempt == 0 and not _lazy_import_for_value(value):
            break
    raise UnsupportedBlobError(
        f"blob {name!r}: cannot store a value of type {type(value).__module__}.{type(value).__qualname__} "
        "without pickle (supported: numpy arrays and scalars, int, float, bool, str, bytes, None, "
        "torch tensors, objects with state_dict()/load_state_dict(), and dicts/lists of those)"
    )


def codec_for_kind(kind: str) -> Codec:
    """The codec that reads ``kind``; ValueError if no codec (or lazy integration) knows it."""
    codec = _by_kind.get(kind)
    if codec is None:
        for prefix, entry in sorted(_lazy.items(), key=lambda kv: -len(kv[0])):  # the longest first
            if kind.startswith(prefix):
                try:
                    importlib.import_module(entry.module)
                except ImportError as e:
                    hint = f" ({entry.install})" if entry.install else ""
                    raise ValueError(f"blob kind {kind!r} needs {entry.module}: {e}{hint}") from e
                codec = _by_kind.get(kind)
                break
    if codec is None:
        raise ValueError(f"unknown blob kind {kind!r}")
    return codec


_PROBE = np.zeros(1, dtype=np.float32)


def plain_ndarray_codec() -> NdarrayCodec | None:
    """The built-in NdarrayCodec when it is the codec for plain arrays (both ways), else None
    (someone registered their own: the formats' fast paths for plain arrays then step aside)."""
    codec = _by_kind.get("ndarray")
    if type(codec) is not NdarrayCodec:
        return None
    for c in _codecs:
        if c is codec:
            return codec
        if c.accepts(_PROBE):  # a codec ahead of it claims plain arrays
            return None
    return None


def encode(value: Any, name: str = "?") -> Encoded:
    """Encode ``value`` (named ``name`` in errors) with the codec that accepts it."""
    codec = codec_for_value(value, name)
    try:
        return codec.encode(value)
    except UnsupportedBlobError as e:
        raise UnsupportedBlobError(f"blob {name!r}: {e}") from None


#: values a load replaces rather than restores in place (nothing to check against)
PLAIN_VALUES = (np.ndarray, np.generic, int, float, complex, str, bytes, bool, type(None))
