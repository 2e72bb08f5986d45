"""The tree codec: nested containers and stateful objects, exact and pickle-free (no torch)."""

from __future__ import annotations

import json
import math
import struct
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest

from epochal.errors import BlobMismatchError, UnsupportedBlobError
from epochal.storage.encoding import codecs
from epochal.storage.encoding.tree import MAX_DEPTH, TreeCodec


def roundtrip(value: Any, existing: Any = None) -> Any:
    """Encode, pass the meta through JSON and the bytes through fresh buffers, decode: what a
    format does, minus the file."""
    enc = codecs.encode(value, "blob")
    meta = json.loads(json.dumps(enc.meta))
    codec = codecs.codec_for_kind(enc.kind)
    bufs = codec.allocate(meta, [s.nbytes for s in enc.segments])
    assert len(bufs) == len(enc.segments)
    for b, s in zip(bufs, enc.segments):
        if s.nbytes:
            memoryview(b).cast("B")[:] = memoryview(s).cast("B")
    return codec.decode(meta, bufs, existing)


def float_bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def same(a: Any, b: Any) -> bool:
    """Equal in value AND type, recursively, floats compared by bits, arrays by bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a.keys()) == list(b.keys()) and all(
            type(ka) is type(kb) and same(a[ka], b[kb]) for ka, kb in zip(a, b)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return float_bits(a) == float_bits(b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return bool(a == b)


NAN_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]


@pytest.mark.parametrize(
    "value",
    [
        {},
        [],
        (),
        {"a": 1, 1: "a", "1": 2},
        [1, [2, [3, (4, 5)]], (), [()]],
        (None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**200, -(2**70)),
        [0.0, -0.0, math.inf, -math.inf, NAN_PAYLOAD, 1e-310, 1 / 3],
        {"s": "", "u": "héllo ✓", "b": b"\x00\xff", "ba": bytearray(b"xy")},
        {None: 1, True: 2, 2.5: 3, (1, "a"): 4, -0.0: 5},
        {"arr": np.arange(6, dtype=np.float16).reshape(2, 3), "s": np.float32(1.5)},
        {"empty": np.zeros((0, 3), dtype=np.int64), "scalar": np.array(7, dtype=np.uint8)},
        OrderedDict([("b", 1), ("a", 2)]),
        ["\udcff lone surrogate"],
    ],
)
def test_roundtrip_exact(value: Any) -> None:
    assert same(roundtrip(value), value)


def test_int_and_str_keys_stay_distinct() -> None:
    out = roundtrip({1: "int", "1": "str"})
    assert out[1] == "int" and out["1"] == "str"
    assert [type(k) for k in out] == [int, str]


def test_tuple_vs_list() -> None:
    out = roundtrip({"betas": (0.9, 0.999), "params": [0, 1]})
    assert isinstance(out["betas"], tuple) and isinstance(out["params"], list)


def test_ordereddict_metadata_kept() -> None:
    od: OrderedDict[str, Any] = OrderedDict(w=np.ones(2))
    od._metadata = {"": {"version": 1}, "fc": {"version": 2}}  # type: ignore[attr-defined]
    out = roundtrip(od)
    assert isinstance(out, OrderedDict)
    assert out._metadata == {"": {"version": 1}, "fc": {"version": 2}}


def test_shared_leaf_decodes_to_one_object() -> None:
    a = np.arange(4.0)
    enc = codecs.encode({"x": a, "y": a})
    assert len(enc.segments) == 1
    out = roundtrip({"x": a, "y": a})
    assert out["x"] is out["y"]


def test_unsupported_leaf_names_path() -> None:
    with pytest.raises(UnsupportedBlobError, match=r"\['inner'\]\[1\]"):
        codecs.encode({"inner": [1, object()]}, "b")


def test_unsupported_key() -> None:
    with pytest.raises(UnsupportedBlobError, match="dict key"):
        codecs.encode({frozenset(): 1}, "b")


def test_cycle_refused() -> None:
    x: list[Any] = [1]
    x.append(x)
    with pytest.raises(UnsupportedBlobError, match="contains itself"):
        codecs.encode(x, "b")


def test_depth_limit() -> None:
    v: Any = 1
    for _ in range(MAX_DEPTH + 5):
        v = [v]
    with pytest.raises(UnsupportedBlobError, match="deeper"):
        codecs.encode(v, "b")


class Counter:
    """A user class with a state dict (what an optimizer or scheduler looks like to epochal)."""

    def __init__(self, n: int = 0, w: np.ndarray | None = None) -> None:
        self.n = n
        self.w = np.zeros(3) if w is None else w
        self.loads = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "w": self.w, "hist": (1.5, None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]
        self.w = state["w"]
        self.loads += 1


def test_stateful_restored_in_place() -> None:
    saved = Counter(5, np.arange(3.0))
    live = Counter()
    out = roundtrip(saved, existing=live)
    assert out is live and live.loads == 1 and live.n == 5
    assert live.w.tolist() == [0.0, 1.0, 2.0]


def test_stateful_without_live_object_is_plain_state_dict() -> None:
    out = roundtrip(Counter(5))
    assert isinstance(out, dict) and out["n"] == 5 and out["hist"] == (1.5, None)
    enc = codecs.encode(Counter(1))
    assert enc.kind == "tree" and enc.meta["stateful"] is True


def test_stateful_shape_mismatch_is_clear_and_touches_nothing() -> None:
    live = Counter(w=np.zeros(4))
    with pytest.raises(BlobMismatchError, match=r"\(3,\).*\(4,\)"):
        roundtrip(Counter(2, np.zeros(3)), existing=live)
    assert live.loads == 0 and live.n == 0


def test_load_state_dict_rejection_becomes_mismatch() -> None:
    class Picky(Counter):
        def load_state_dict(self, state: dict[str, Any]) -> None:
            raise KeyError("missing key 'z'")

    with pytest.raises(BlobMismatchError, match="rejected"):
        roundtrip(Counter(1), existing=Picky())


def test_nested_stateful_in_container_restored_in_place() -> None:
    live = {"c": Counter(), "other": 3}
    out = roundtrip({"c": Counter(9), "other": 4}, existing=live)
    assert out["c"] is live["c"] and live["c"].n == 9 and out["other"] == 4


def test_plain_container_replaces_live_values() -> None:
    live = {"w": np.zeros(3)}
    out = roundtrip({"w": np.ones(5)}, existing=live)
    assert out["w"].shape == (5,) and live["w"].shape == (3,)


@pytest.mark.parametrize(
    "meta",
    [
        {"v": 1, "root": ["x", 0], "leaves": []},
        {"v": 1, "root": ["zz", 1], "leaves": []},
        {"v": 1, "root": 1.5, "leaves": []},
        {"v": 2, "root": None, "leaves": []},
        {"v": 1, "root": ["d", [[["l", []], 1]]], "leaves": []},
        {"v": 1, "root": ["x", 0], "leaves": [["nope", {}, 0]]},
        {"v": 1, "root": None, "leaves": "x"},
    ],
)
def test_bad_meta_is_value_error(meta: dict[str, Any]) -> None:
    codec = TreeCodec()
    with pytest.raises(ValueError):
        codec.decode(meta, [])


def test_segment_count_checked() -> None:
    enc = codecs.encode({"a": np.ones(2)})
    codec = codecs.codec_for_kind("tree")
    with pytest.raises(ValueError, match="segments"):
        codec.allocate(enc.meta, [16, 16])


def test_tree_codec_never_imports_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from epochal.storage.encoding import codecs\n"
        "codecs.encode({'a': [np.ones(2), 1.5]})\n"
        "import epochal.integrations.rng as r; codecs.encode(r.RNGState())\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class Growing:
    """State whose sizes change as it runs: a permutation drawn on first use, a history."""

    def __init__(self) -> None:
        self.perm = np.zeros(0, dtype=np.int64)
        self.hist: list[float] = []
        self.seen: dict[str, int] = {}
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"perm": self.perm, "hist": self.hist, "seen": self.seen, "n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.perm, self.hist, self.seen, self.n = state["perm"], state["hist"], state["seen"], state["n"]


def test_state_whose_sizes_changed_is_restored_with_the_saved_values() -> None:
    saved = Growing()
    saved.perm = np.random.default_rng(0).permutation(48)
    saved.hist, saved.seen, saved.n = [0.5, -0.0, 2.0**70], {"a": 1, "b": 2}, 2**80
    live = roundtrip(saved, existing=Growing())  # a freshly built object: all empty
    assert live.perm.tobytes() == saved.perm.tobytes() and live.perm.dtype == np.int64
    assert same(live.hist, saved.hist) and live.seen == saved.seen and live.n == 2**80
    # and back: state saved before it grew, into an object that already grew
    grown = roundtrip(saved, existing=Growing())
    fresh = roundtrip(Growing(), existing=grown)
    assert fresh.perm.shape == (0,) and fresh.hist == [] and fresh.seen == {} and fresh.n == 0
