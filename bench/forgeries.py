"""The forgery classes of bench/fuzz.py and tests/test_fuzz_quick.py: files crafted from a
base db with every checksum valid, so only the readers' own checks stand in the way.
``forge(db_type, name, raw)`` returns the forged bytes of the base file ``raw``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from _forge import NativeParts, st_blobs_crc, st_pack, st_parts


def _empty_segment(p: NativeParts, k: int) -> None:
    """Segment ``k`` becomes empty (its bytes cut out, the later ones moved up)."""
    off, ln, _crc, pad = (int(x) for x in p.segs[k].tolist())
    cut = ln + pad
    start = off - 64
    p.data = p.data[:start] + p.data[start + cut :]
    p.segs["length"][k] = p.segs["pad"][k] = p.segs["crc"][k] = 0
    p.segs["offset"][k + 1 :] -= cut
    p.data_bytes -= ln


def _meta0(p: NativeParts, meta: Any, kind: str = "ndarray") -> None:
    ents = json.loads(p.metas)
    ents[int(p.recs["meta_id"][0])] = [kind, meta]
    p.set_metas(ents)


def _n_meta_pointer(p: NativeParts) -> None:
    p.moffs[0] = p.moffs[1].copy()


def _n_s0(p: NativeParts) -> None:
    _empty_segment(p, 0)
    _meta0(p, {"dtype": "S0", "shape": [1 << 33]})


def _n_descr(p: NativeParts) -> None:
    _empty_segment(p, 0)
    _meta0(p, {"dtype": {"descr": []}, "shape": [1 << 33]})


def _n_wrap(p: NativeParts) -> None:
    ioff = 64 + len(p.data)
    n = len(p.segs)
    p.segs["pad"] = 0
    offs = [64, 2**63, 2**64 - 64] + [ioff] * (n - 3)
    lens = [2**63 - 64, 2**63 - 64, ioff + 64 - ioff] + [0] * (n - 3)
    lens[2] = ioff + 64
    p.segs["offset"], p.segs["length"] = offs, lens
    p.data_bytes = ioff - 64


def _n_dup_names(p: NativeParts) -> None:
    r0, r1 = p.recs[0], p.recs[1]
    p.recs["name_off"][1], p.recs["name_len"][1] = r0["name_off"], r0["name_len"]
    del r1


def _n_unsorted(p: NativeParts) -> None:
    p.order = p.order[::-1].copy()


def _n_not_perm(p: NativeParts) -> None:
    p.order[:] = 0


def _n_dup_json(p: NativeParts) -> None:
    text = p.metas.decode()
    i = text.index('{"dtype":')
    forged = text[:i] + '{"dtype":"<i8",' + text[i + 1 :]
    grow = len(forged) - len(text)
    mid = next(k for k, (o, _ln) in enumerate(p.moffs.tolist()) if o <= i < o + _ln)
    p.metas = forged.encode()
    p.moffs["len"][mid] += grow
    p.moffs["off"][mid + 1 :] += grow


def _n_big_json(p: NativeParts) -> None:
    ents = json.loads(p.metas)
    mid = int(p.recs["meta_id"][0])
    ents[mid] = ["ndarray", {**ents[mid][1], "x": [[]] * (21 << 20)}]
    p.set_metas(ents)


def _n_huge_shape(p: NativeParts) -> None:
    _meta0(p, {"dtype": "<f4", "shape": [1 << 40]})


def _n_object_dtype(p: NativeParts) -> None:
    _meta0(p, {"dtype": "|O", "shape": [2]})


def _n_unknown_kind(p: NativeParts) -> None:
    _meta0(p, {"dtype": "<f4", "shape": [16]}, kind="pickle")


def _n_deep(p: NativeParts) -> None:
    ents = json.loads(p.metas)
    mid = int(p.recs["meta_id"][0])
    p.set_metas(ents)
    deep = "[" * 100_000 + "]" * 100_000
    text = p.metas.decode()
    o, ln = (int(x) for x in p.moffs[mid].tolist())
    forged = text[:o] + deep + text[o + ln :]
    p.metas = forged.encode()
    p.moffs["len"][mid] = len(deep)
    p.moffs["off"][mid + 1 :] += len(deep) - ln


def _n_names_outside(p: NativeParts) -> None:
    p.recs["name_len"][0] = 2**32 - 1


def _n_segments_swapped(p: NativeParts) -> None:
    p.recs["seg_first"][0], p.recs["seg_first"][1] = 1, 0


NATIVE: dict[str, Callable[[NativeParts], None]] = {
    "meta table points at another entry": _n_meta_pointer,
    "S0 dtype, huge shape": _n_s0,
    "empty structured dtype, huge shape": _n_descr,
    "segments tile modulo 2**64": _n_wrap,
    "duplicate blob names": _n_dup_names,
    "unsorted name order": _n_unsorted,
    "name order not a permutation": _n_not_perm,
    "duplicate JSON keys": _n_dup_json,
    "64 MB JSON meta": _n_big_json,
    "huge shape": _n_huge_shape,
    "object dtype": _n_object_dtype,
    "unknown kind": _n_unknown_kind,
    "100,000-deep JSON": _n_deep,
    "name outside the heap": _n_names_outside,
    "blob table out of order": _n_segments_swapped,
}
NATIVE_FORGERIES = list(NATIVE)


def _rec(recs: list[dict[str, Any]], pred: Callable[[dict[str, Any]], bool]) -> int:
    return next(i for i, r in enumerate(recs) if pred(r))


def _st_records(edit: Callable[[list[dict[str, Any]]], Any]) -> Callable[[dict[str, Any]], None]:
    def apply(header: dict[str, Any]) -> None:
        recs = json.loads(header["__metadata__"]["epochal.blobs"])
        header["__metadata__"]["epochal.blobs"] = json.dumps(edit(recs))
        st_blobs_crc(header)
    return apply


def _set(i_of: Callable[[list[dict[str, Any]]], int], **fields: Any) -> Callable[[list[dict[str, Any]]], Any]:
    def edit(recs: list[dict[str, Any]]) -> Any:
        i = i_of(recs)
        recs[i] = {**recs[i], **fields}
        return recs
    return edit


def _direct(recs: list[dict[str, Any]]) -> int:
    return _rec(recs, lambda r: r["segs"] and "tensor" in r["segs"][0] and r["segs"][0]["tensor"] == r["name"])


def _inline(recs: list[dict[str, Any]]) -> int:
    return _rec(recs, lambda r: r["segs"] and "b64" in r["segs"][0])


def _two_names(recs: list[dict[str, Any]]) -> Any:
    recs[1] = {**recs[1], "name": recs[0]["name"]}
    return recs


def _tensor_twice(recs: list[dict[str, Any]]) -> Any:
    j = _inline(recs)
    recs[j] = {**recs[j], "segs": recs[_direct(recs)]["segs"]}
    return recs


ST: dict[str, Callable[[dict[str, Any]], None]] = {
    "blob list not a list": _st_records(lambda recs: {"x": 1}),
    "record not a dict": _st_records(lambda recs: [*recs[:-1], ["name"]]),
    "name not a str": _st_records(_set(lambda r: 0, name=5)),
    "extra record key": _st_records(_set(lambda r: 0, unsupported="BF16")),
    "segment without crc": _st_records(lambda recs: _set(_direct, segs=[{"tensor": recs[_direct(recs)]["name"]}])(recs)),
    "crc not hex": _st_records(lambda recs: _set(_direct, segs=[{"tensor": recs[_direct(recs)]["name"], "crc": "zzzzzzzz"}])(recs)),
    "b64 not a str": _st_records(_set(_inline, segs=[{"b64": 12, "crc": "00000000"}])),
    "b64 of another length": _st_records(_set(_inline, segs=[{"b64": "aGVsbG8hIQ==", "crc": "00000000"}])),
    "duplicate names": _st_records(_two_names),
    "tensor used twice": _st_records(_tensor_twice),
    "tensor of another dtype": _st_records(_set(_direct, meta={"dtype": "<i4", "shape": [16]})),
    "huge shape": _st_records(_set(_inline, meta={"dtype": ">i4", "shape": [2**40]})),
    "S0 huge shape": _st_records(_set(_inline, kind="ndarray", meta={"dtype": "S0", "shape": [2**40]})),
    "unknown kind": _st_records(_set(_inline, kind="pickle")),
    "meta not a dict": _st_records(_set(lambda r: 0, meta=[1])),
}
ST_FORGERIES = [*ST, "duplicate tensor key", "huge header of empty lists"]


def forge(db_type: str, name: str, raw: bytes) -> bytes:
    if db_type == "native":
        p = NativeParts.parse(raw)
        NATIVE[name](p)
        return p.pack()
    header, data = st_parts(raw)
    if name == "duplicate tensor key":
        text = json.dumps(header, separators=(",", ":"))
        t = next(k for k in header if k != "__metadata__")
        entry = json.dumps(header[t], separators=(",", ":"))
        return st_pack(header, data, text.replace("{", "{" + json.dumps(t) + ":" + entry + ",", 1).encode())
    if name == "huge header of empty lists":
        text = '{"x":[' + ",".join(["[]"] * (12 << 20)) + "]}"
        return st_pack(header, data, text.encode())
    ST[name](header)
    return st_pack(header, data)
