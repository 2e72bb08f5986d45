"""The JSON vocabulary of array metas: numpy dtypes to JSON and back (never an object dtype;
parsed dtypes cached), shapes validated, the byte size a dtype and shape must have. Codecs,
formats and readers all check metas with these, from bytes alone."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...errors import UnsupportedBlobError

__all__ = ["MAX_DIM", "check_shape", "dtype_from_json", "dtype_to_json", "expected_nbytes"]


def dtype_to_json(dt: np.dtype) -> Any:
    """A JSON form of a numpy dtype that rebuilds it exactly; refuses object dtypes."""
    if dt.hasobject:
        raise UnsupportedBlobError(f"dtype {dt} holds Python objects")
    if dt.fields is not None or dt.subdtype is not None:
        return {"descr": _descr_to_json(dt.descr)}
    return dt.str


def _descr_to_json(descr: Any) -> Any:
    out = []
    for item in descr:
        name, typ, *shape = item
        typ = _descr_to_json(typ) if isinstance(typ, list) else typ
        out.append([name, typ, *[list(s) for s in shape]])
    return out


def _descr_from_json(descr: Any) -> Any:
    out = []
    for item in descr:
        if not isinstance(item, list) or len(item) not in (2, 3):
            raise ValueError(f"bad dtype description {item!r}")
        name, typ, *shape = item
        typ = _descr_from_json(typ) if isinstance(typ, list) else str(typ)
        out.append((str(name), typ, *[tuple(int(d) for d in s) for s in shape]))
    return out


#: parsed plain (string) dtypes: ``np.dtype(str)`` costs ~1 µs, and a load of many small
#: arrays asks for the same few dtypes over and over (dtypes are immutable, so sharing is safe)
_DTYPE_CACHE: dict[str, np.dtype] = {}


def dtype_from_json(obj: Any) -> np.dtype:
    """Inverse of :func:`dtype_to_json`; raises ValueError on anything that is not a plain dtype."""
    if type(obj) is str:
        cached = _DTYPE_CACHE.get(obj)
        if cached is not None:
            return cached
    try:
        if isinstance(obj, str) and len(obj) < 64:
            if "O" == obj.lstrip("<>|=")[:1]:
                raise ValueError(f"object dtype {obj!r} is not allowed")
            dt = np.dtype(obj)
            if not dt.hasobject and type(obj) is str and len(_DTYPE_CACHE) < 1024:
                _DTYPE_CACHE[obj] = dt
        elif isinstance(obj, dict) and isinstance(obj.get("descr"), list):
            dt = np.dtype(_descr_from_json(obj["descr"]))
        else:
            raise ValueError(f"unknown dtype {obj!r}")
    except (TypeError, SyntaxError) as e:
        raise ValueError(f"unknown dtype {obj!r}: {e}") from None
    if dt.hasobject:
        raise ValueError(f"object dtype {obj!r} is not allowed")
    return dt


#: the largest dimension a shape may have
MAX_DIM = 2**62


def check_shape(shape: Any, what: str = "shape") -> tuple[int, ...]:
    """Validate a JSON shape: a list of non-negative ints of sane rank."""
    if not isinstance(shape, list) or len(shape) > 64:
        raise ValueError(f"bad {what} {shape!r}")
    out = []
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0 or d > MAX_DIM:
            raise ValueError(f"bad {what} {shape!r}")
        out.append(d)
    return tuple(out)


def expected_nbytes(dt: np.dtype, shape: tuple[int, ...]) -> int:
    """The bytes of an array of ``dt`` and ``shape``; ValueError for elements of zero bytes
    (``S0``, a structured dtype without fields): numpy would allocate one byte per element
    (or hand out a huge array of nothing), so no file may claim them."""
    count = math.prod(shape)
    if dt.itemsize == 0 and count:
        raise ValueError(f"{count} elements of the zero-byte dtype {dt}")
    return count * dt.itemsize
