"""The ``safetensors`` db_type: files the safetensors library (and so the Hugging Face
ecosystem) opens as they are, holding every epochal blob.

Layout (the safetensors format: an 8-byte little-endian header length, a JSON header, then
the tensor bytes back to back):

* numpy arrays whose dtype safetensors knows (bool, (u)int8-64, float16/32/64), little-endian,
  become real tensors under the blob's own name;
* torch tensors, also the tensors inside state dicts (models, optimizers), become real tensors
  of their own dtype (bf16 and float8 too) and shape, named ``<blob>`` for a tensor blob and
  ``<blob>/<key path>`` inside a state dict (``model/fc.weight``, ``opt/state/0/exp_avg``): a
  tensor met twice (tied weights) is stored once, under the first name;
* everything else (Python and numpy scalars, strings, bytes, big-endian or structured arrays,
  other codecs' kinds such as state-dict trees) is described in ``__metadata__``: the codec's
  kind and meta as JSON, with each raw segment either inline (base64, when small) or in a
  hidden ``U8`` tensor named ``__epochal__/<blob index>/<segment>``;
* ``__metadata__["epochal.blobs"]`` lists every blob in order (JSON), with a CRC-32C of every
  segment; ``__metadata__["epochal.blobs.crc"]`` is the checksum of that JSON string, so
  damage to data or to the blob list is detected on load (safetensors itself has no checksums).
  ``"format": "pt"`` is set so transformers accepts the file.

The file is written by epochal itself, streaming from the arrays' memory through the byte
store of :mod:`epochal.storage.io` (local: temp name, fsync, rename, directory fsync), so the safetensors package is not
needed to write or read; files written by other tools (no ``epochal.blobs``) are read too, one
ndarray blob per tensor. Nothing is pickled or evaluated.
"""

from __future__ import annotations

import base64
import json
import os
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import (
    CheckpointCorruptError,
    CheckpointError,
    MissingBlobError,
    UnsupportedBlobError,
)
from ..encoding import codecs as _codecs
from ..encoding import strict_json
from ..encoding.codecs import flat_segment
from ..io import tuning
from ..io.checksum import ChecksumFn, checksum_function, default_algorithm, format_checksum
from ..io.reads import read_exact
from ..io.seam import ByteSource, committed, store_for
from .base import BlobInfo, DbBackend, DbStat, ReadStats, register_db_type
from .safetensors_names import named_tensors
from .stream import stream_segments

__all__ = ["SafetensorsBackend", "SAFETENSORS_DTYPES"]

#: numpy dtype (little-endian str) -> safetensors dtype name
SAFETENSORS_DTYPES: dict[str, str] = {
    "|b1": "BOOL", "|u1": "U8", "|i1": "I8", "<i2": "I16", "<u2": "U16", "<f2": "F16",
    "<i4": "I32", "<u4": "U32", "<f4": "F32", "<f8": "F64", "<i8": "I64", "<u8": "U64",
}
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4,
                "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8, "C64": 8, "F8_E4M3": 1,
                "F8_E5M2": 1}
_ST_TO_NUMPY = {v: k for k, v in SAFETENSORS_DTYPES.items()}
HIDDEN = "__epochal__/"
INLINE_MAX = 4096
MAX_HEADER = 100 << 20  # the safetensors library's own limit
_CRC_PLACEHOLDER = "00000000"
#: the ``__metadata__`` keys of a file epochal wrote (any one of them present: all are checked)
_OWN_KEYS = frozenset({"epochal.version", "epochal.checksum", "epochal.blobs", "epochal.blobs.crc"})
_REC_KEYS = frozenset({"name", "kind", "meta", "segs"})
_HEX8 = re.compile(r"[0-9a-f]{8}")


def _corrupt(path: str, msg: str, blob: str | None = None) -> CheckpointCorruptError:
    return CheckpointCorruptError(path, msg, blob)


class SafetensorsBackend(DbBackend):
    """``db_type="safetensors"``: see the module docstring."""

    name = "safetensors"
    load_verifies = True

    # ------------------------------------------------------------------ write
    def write(self, path: str, blobs: Mapping[str, Any]) -> int:
        path = os.fspath(path)
        algorithm = default_algorithm()
        fn = checksum_function(algorithm)
        tensors: list[tuple[str, str, list[int], memoryview]] = []  # name, dtype, shape, data
        records: list[dict[str, Any]] = []
        crc_slots: list[tuple[dict[str, Any], int]] = []  # (record, segment index) per tensor
        inline_crcs: list[tuple[dict[str, Any], int, memoryview]] = []
        used: set[str] = {str(n) for n in blobs}  # a named tensor never takes a blob's name
        for bi, (name, value) in enumerate(blobs.items()):
            if not isinstance(name, str):
                raise UnsupportedBlobError(f"blob name {name!r} is not a str")
            enc = _codecs.encode(value, name)
            segs = [flat_segment(s) for s in enc.segments]
            rec: dict[str, Any] = {"name": name, "kind": enc.kind, "meta": enc.meta, "segs": []}
            st_dtype = (
                SAFETENSORS_DTYPES.get(enc.meta.get("dtype", ""))
                if enc.kind == "ndarray" and isinstance(enc.meta.get("dtype"), str)
                else None
            )
            direct = (
                st_dtype is not None
                and len(segs) == 1
                and name != "__metadata__"
                and not name.startswith(HIDDEN)
            )
            named = {} if direct else named_tensors(name, enc.kind, enc.meta)
            for j, seg in enumerate(segs):
                real = named.get(j)
                if real is not None and (real[0] in used and real[0] != name or real[0].startswith(HIDDEN)
                                         or real[0] == "__metadata__"):
                    real = None  # the name is taken: a hidden tensor instead
                if direct:
                    tensors.append((name, st_dtype or "", list(enc.meta["shape"]), seg))
                    rec["segs"].append({"tensor": name, "crc": _CRC_PLACEHOLDER})
                    crc_slots.append((rec, j))
                elif real is not None:  # a torch tensor, also inside a state dict: a real tensor
                    used.add(real[0])
                    tensors.append((real[0], real[1], list(real[2]), seg))
                    rec["segs"].append({"tensor": real[0], "crc": _CRC_PLACEHOLDER})
                    crc_slots.append((rec, j))
                elif seg.nbytes <= INLINE_MAX:
                    rec["segs"].append({"b64": base64.b64encode(seg).decode("ascii"),
                                        "crc": _CRC_PLACEHOLDER})
                    inline_crcs.append((rec, j, seg))
                else:
                    tname = f"{HIDDEN}{bi}/{j}"
                    tensors.append((tname, "U8", [seg.nbytes], seg))
                    rec["segs"].append({"tensor": tname, "crc": _CRC_PLACEHOLDER})
                    crc_slots.append((rec, j))
            records.append(rec)
        for rec, j, seg in inline_crcs:
            rec["segs"][j]["crc"] = f"{fn(seg, 0):08x}"

        def header_bytes() -> bytes:
            try:
                blobs_json = json.dumps(records, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as e:
                raise UnsupportedBlobError(f"codec meta is not JSON: {e}") from None
            meta = {
                "format": "pt",
                "epochal.version": "1",
                "epochal.checksum": algorithm,
                "epochal.blobs": blobs_json,
                "epochal.blobs.crc": f"{fn(blobs_json.encode(), 0):08x}",
            }
            header: dict[str, Any] = {"__metadata__": meta}
            off = 0
            for tname, dt, shape, seg in tensors:
                header[tname] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + seg.nbytes]}
                off += seg.nbytes
            raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
            return raw + b" " * ((-len(raw)) % 8)  # data starts 8-aligned, as safetensors pads

        head = header_bytes()
        data_len = sum(t[3].nbytes for t in tensors)
        total = 8 + len(head) + data_len
        with committed(store_for(path).create(path, size=total)) as out:
            out.write(struct.pack("<Q", len(head)) + head)  # placeholder, same length as the final
            segs = [t[3] for t in tensors]
            crcs = stream_segments(out, fn, segs, [sg.nbytes for sg in segs],
                                   batch_bytes=tuning.STREAM_BATCH)
            for (rec, j), crc in zip(crc_slots, crcs):
                rec["segs"][j]["crc"] = f"{crc:08x}"
            final = header_bytes()
            if len(final) != len(head):  # pragma: no cover - crcs are fixed width
                raise AssertionError("safetensors header changed size")
            out.patch(0, struct.pack("<Q", len(final)) + final)
        return total

    # ------------------------------------------------------------------ read
    def _open(self, path: str) -> tuple[ByteSource, _Header]:
        src = store_for(path).open_read(path, what="safetensors db")
        try:
            return src, _Header(path, src)
        except BaseException:
            src.close()
            raise

    def describe(self, path: str) -> list[BlobInfo]:
        src, h = self._open(path)
        src.close()
        out = []
        for rec in h.records:
            sizes = [h.seg_size(rec, s) for s in rec["segs"]]
            crcs = [s.get("crc") for s in rec["segs"]]
            meta = rec["meta"]
            dtype = meta.get("dtype")
            if dtype is not None and not isinstance(dtype, str):
                dtype = json.dumps(dtype, separators=(",", ":"))
            try:
                shape = _codecs.check_shape(meta["shape"]) if "shape" in meta else None
            except ValueError:
                shape = None
            checksum = None
            if crcs and all(isinstance(c, str) for c in crcs):
                checksum = format_checksum(h.algorithm, int(crcs[0], 16)) + "".join(f"+{c}" for c in crcs[1:])
            out.append(BlobInfo(rec["name"], rec["kind"], dtype, shape, sum(sizes), checksum, meta))
        return out

    def digest(self, path: str) -> str | None:
        """CRC of the header (which holds every segment's CRC) plus the file size."""
        src, h = self._open(path)
        src.close()
        return h.digest

    def stat(self, path: str) -> DbStat:
        """From the header alone; the checksum algorithm only for files epochal wrote."""
        src, h = self._open(path)
        src.close()
        data = sum(h.seg_size(rec, seg) for rec in h.records for seg in rec["segs"])
        return DbStat(
            path, self.name, h.file_size, len(h.records), data, h.digest,
            None, h.algorithm if h.has_crcs else None,
        )

    def sniff(self, head: bytes, size: int) -> bool:
        """An 8-byte little-endian header length that fits the file, then a JSON object."""
        if len(head) <= 8 or head[8:9] != b"{":
            return False
        n = int.from_bytes(head[:8], "little")
        return 0 < n < MAX_HEADER and n + 8 <= size

    def read(
        self,
        path: str,
        names: Sequence[str] | None = None,
        *,
        allow_incomplete: bool = False,
        existing: Mapping[str, Any] | None = None,
        verify: bool = True,
        stats: ReadStats | None = None,
    ) -> dict[str, Any]:
        path = os.fspath(path)
        src, h = self._open(path)
        try:
            if names is None:
                recs = list(h.records)
            else:
                if isinstance(names, str):
                    names = [names]
                by_name = {r["name"]: r for r in h.records}
                recs = []
                for nm in dict.fromkeys(names):
                    r = by_name.get(nm)
                    if r is None:
                        if allow_incomplete:
                            continue
                        raise MissingBlobError(f"{path}: no blob {nm!r} in this db")
                    recs.append(r)
            # phase 1: allocate
            plan = []
            for rec in recs:
                name, kind, meta = rec["name"], rec["kind"], rec["meta"]
                if "unsupported" in rec:
                    raise UnsupportedBlobError(
                        f"{path}: blob {name!r}: safetensors dtype {rec['unsupported']} has no numpy "
                        "equivalent (load it with the torch integration)"
                    )
                sizes = [h.seg_size(rec, s) for s in rec["segs"]]
                try:
                    codec = _codecs.codec_for_kind(kind)
                    bufs = [flat_segment(b) for b in codec.allocate(meta, sizes)]
                except CheckpointError:
                    raise
                except (ValueError, TypeError, KeyError, IndexError, OverflowError, MemoryError) as e:
                    raise _corrupt(path, f"bad {kind} meta: {e}", name) from None
                if len(bufs) != len(sizes) or any(b.nbytes != s or b.readonly for b, s in zip(bufs, sizes)):
                    raise _corrupt(path, "codec buffers do not fit the stored segments", name)
                plan.append((rec, codec, bufs))
            # phase 2: fill and verify
            fn = h.fn
            for rec, _codec, bufs in plan:
                for seg, buf in zip(rec["segs"], bufs):
                    if "b64" in seg:
                        try:
                            raw = base64.b64decode(seg["b64"], validate=True)
                        except (ValueError, TypeError):
                            raise _corrupt(path, "bad inline segment", rec["name"]) from None
                        if len(raw) != buf.nbytes:
                            raise _corrupt(path, "bad inline segment length", rec["name"])
                        buf[:] = raw
                    else:
                        begin, _end = h.tensor_range(seg["tensor"], rec["name"])
                        read_exact(src, [buf], h.data_start + begin, rec["name"])
                    if verify and h.has_crcs:
                        if fn is None or fn(buf, 0) != int(seg["crc"], 16):
                            raise _corrupt(path, "data checksum mismatch (blob damaged)", rec["name"])
            # phase 3: decode
            out: dict[str, Any] = {}
            for rec, codec, bufs in plan:
                name = rec["name"]
                live = existing.get(name) if existing is not None else None
                try:
                    out[name] = codec.decode(rec["meta"], bufs, live)
                except CheckpointError:
                    raise
                except (ValueError, TypeError, KeyError, IndexError, OverflowError, UnicodeError) as e:
                    raise _corrupt(path, f"cannot decode {rec['kind']} blob: {e}", name) from None
                if stats is not None:
                    stats.blobs += 1
                    stats.nbytes += sum(b.nbytes for b in bufs)
            return out
        finally:
            src.close()


class _Header:
    """The parsed, validated header of a safetensors file."""

    def __init__(self, path: str, src: ByteSource) -> None:
        self.path = path
        self.file_size = src.size()
        raw = src.read(8, 0)
        if len(raw) < 8:
            raise _corrupt(path, "file is truncated: no safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > self.file_size:
            raise _corrupt(path, f"absurd safetensors header length {n}")
        text = src.read(n, 8)
        if len(text) != n:
            raise _corrupt(path, "file is truncated inside the header")
        self.header_crc = checksum_function("crc32")(text, 0)
        self.digest = f"safetensors:{self.header_crc:08x}:{self.file_size}"
        try:
            header = strict_json.loads(text)
        except (ValueError, RecursionError) as err:
            raise _corrupt(path, f"safetensors header is not valid JSON: {err}") from None
        if not isinstance(header, dict):
            raise _corrupt(path, "safetensors header is not a JSON object")
        self.data_start = 8 + n
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise _corrupt(path, "bad __metadata__")
        self.tensors: dict[str, tuple[int, int]] = {}
        self._dtypes: dict[str, tuple[str, tuple[int, ...]]] = {}
        spans = []
        for tname, t in header.items():
            try:
                dt, shape, (b, e) = t["dtype"], t["shape"], t["data_offsets"]
                shape = _codecs.check_shape(shape)
                if not (isinstance(b, int) and isinstance(e, int)) or not 0 <= b <= e:
                    raise ValueError
                if dt not in _ST_ITEMSIZE or _ST_ITEMSIZE[dt] * int(np.prod(shape, dtype=object)) != e - b:
                    raise ValueError
            except (KeyError, TypeError, ValueError):
                raise _corrupt(path, f"bad tensor entry {tname!r}") from None
            self.tensors[tname] = (b, e)
            self._dtypes[tname] = (dt, shape)
            spans.append((b, e))
        spans.sort()
        pos = 0
        for b, e in spans:
            if b != pos:
                raise _corrupt(path, "tensor data does not tile the data area")
            pos = e
        if self.data_start + pos != self.file_size:
            raise _corrupt(path, f"file is truncated or too long: {self.file_size} bytes, header needs "
                                 f"{self.data_start + pos}")
        self.algorithm = "crc32c"
        self.has_crcs = False
        self.fn: ChecksumFn | None = None
        if _OWN_KEYS.intersection(meta):  # written by epochal: every key is checked
            self.records = self._own_records(meta)
        else:  # a foreign file: every tensor is an ndarray blob (known numpy dtypes only)
            self.records = []
            for tname, (dt, shape) in self._dtypes.items():
                np_dt = _ST_TO_NUMPY.get(dt)
                rec: dict[str, Any] = {"name": tname, "kind": "ndarray",
                                       "meta": {"dtype": np_dt or dt, "shape": list(shape)},
                                       "segs": [{"tensor": tname}]}
                if np_dt is None:
                    rec["unsupported"] = dt
                self.records.append(rec)

    def _own_records(self, meta: dict[str, Any]) -> list[dict[str, Any]]:
        """The blob list of a file epochal wrote, checked so that any damage to the header
        is reported: the exact set of metadata keys, the version, the blob list's checksum,
        every record's shape, and every tensor against the record that uses it."""
        path = self.path
        if set(meta) != _OWN_KEYS | {"format"}:
            odd = sorted(set(meta) ^ (_OWN_KEYS | {"format"}))
            raise _corrupt(path, f"epochal metadata damaged (keys {', '.join(map(repr, odd))})")
        if meta["epochal.version"] != "1" or meta["format"] != "pt":
            raise _corrupt(path, f"epochal metadata damaged (version {meta['epochal.version']!r}, "
                                 f"format {meta['format']!r})")
        self.algorithm = str(meta["epochal.checksum"])
        self.has_crcs = True
        try:
            fn = self.fn = checksum_function(self.algorithm)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
        blobs_json = meta["epochal.blobs"]
        if not isinstance(blobs_json, str) or f"{fn(blobs_json.encode('utf-8', 'surrogatepass'), 0):08x}" != meta["epochal.blobs.crc"]:
            raise _corrupt(path, "epochal blob list checksum mismatch (header damaged)")
        try:
            records = strict_json.loads(blobs_json)
        except (ValueError, RecursionError) as e:
            raise _corrupt(path, f"epochal blob list is not valid JSON: {e}") from None
        if not isinstance(records, list):
            raise _corrupt(path, "bad epochal blob list")
        used: set[str] = set()
        names: set[str] = set()
        for bi, r in enumerate(records):
            if not (isinstance(r, dict) and set(r) == _REC_KEYS and isinstance(r["name"], str)
                    and isinstance(r["kind"], str) and isinstance(r["meta"], dict)
                    and isinstance(r["segs"], list)):
                raise _corrupt(path, f"bad epochal blob list (record {bi})")
            name = r["name"]
            if name in names:
                raise _corrupt(path, "blob name stored twice", name)
            names.add(name)
            named = named_tensors(name, r["kind"], r["meta"])
            for j, seg in enumerate(r["segs"]):
                self._check_seg(r, seg, used, named.get(j))
        if used != set(self.tensors):
            raise _corrupt(path, f"tensors no blob uses: {', '.join(map(repr, sorted(set(self.tensors) - used)))}")
        return records

    def _check_seg(self, rec: dict[str, Any], seg: Any, used: set[str],
                   named: tuple[str, str, list[int]] | None = None) -> None:
        """``named``: the real tensor this segment may be (a torch tensor, also inside a state
        dict: see ``_named_tensors``); its header entry must then have that dtype and shape."""
        name = rec["name"]
        if not (isinstance(seg, dict) and isinstance(seg.get("crc"), str) and _HEX8.fullmatch(seg["crc"])
                and (set(seg) == {"b64", "crc"} and isinstance(seg["b64"], str)
                     or set(seg) == {"tensor", "crc"} and isinstance(seg["tensor"], str))):
            raise _corrupt(self.path, "bad segment record", name)
        if "b64" in seg:
            return
        tname = seg["tensor"]
        if tname not in self.tensors:
            raise _corrupt(self.path, f"segment tensor {tname!r} is missing", name)
        if tname in used:
            raise _corrupt(self.path, f"segment tensor {tname!r} used twice", name)
        used.add(tname)
        dt, shape = self._dtypes[tname]
        if named is not None and tname == named[0]:  # a named torch tensor: header and meta agree
            if dt != named[1] or list(shape) != list(named[2]):
                raise _corrupt(self.path, "tensor entry does not match the blob list (header damaged)", name)
        elif tname == name:  # a real tensor: header and record must agree
            meta = rec["meta"]
            if (rec["kind"] != "ndarray" or len(rec["segs"]) != 1
                    or SAFETENSORS_DTYPES.get(meta.get("dtype")) != dt  # type: ignore[arg-type]
                    or meta.get("shape") != list(shape)):
                raise _corrupt(self.path, "tensor entry does not match the blob list (header damaged)", name)
        elif not tname.startswith(HIDDEN) or dt != "U8" or len(shape) != 1:
            raise _corrupt(self.path, f"bad hidden tensor {tname!r}", name)

    def tensor_range(self, tname: Any, blob: str) -> tuple[int, int]:
        r = self.tensors.get(tname) if isinstance(tname, str) else None
        if r is None:
            raise _corrupt(self.path, f"segment tensor {tname!r} is missing", blob)
        return r

    def seg_size(self, rec: dict[str, Any], seg: dict[str, Any]) -> int:
        if "b64" in seg:
            b64 = seg["b64"]
            if not isinstance(b64, str):
                raise _corrupt(self.path, "bad inline segment", rec["name"])
            return len(b64) // 4 * 3 - b64[-2:].count("=") if b64 else 0
        b, e = self.tensor_range(seg["tensor"], rec["name"])
        return e - b


register_db_type("safetensors", SafetensorsBackend)
