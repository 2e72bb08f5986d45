"""The commit record of an epoch: ``.epochal/manifest.<epoch>.json``, parsed and validated.

An epoch exists only when its manifest does. A manifest lists, per node, the db file with its
size and digest. Since version 2 it also carries a CRC-32C of its own content: a manifest
whose bytes were damaged (one flipped bit in a file name, say) is refused, never trusted
with deletes. Files a manifest names must be exactly that epoch's dbs of the nodes it lists
(``<prefix><node>.<epoch>``, at a URL with its writer's token after it: see
:mod:`.naming`), so retention and mirror pulls can never be pointed at other
files. Duplicate JSON keys are refused too (the last would silently win).

:class:`Manifest` is the typed record that the directory handler, the remote mirror and the
tools pass to each other (:meth:`Manifest.decode` reads and validates one, :meth:`Manifest.encode`
gives its bytes); :func:`decode_manifest` and :func:`encode_manifest` are the same as JSON
dicts (what ``CheckpointDirectory.manifest`` returns to users). Both produce exactly the same
bytes for what epochal writes; keys a newer or foreign writer added are kept (``extra``).
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

from ...errors import CheckpointCorruptError, CheckpointVersionError
from .naming import check_node_name, get_ckpt_filename, without_token

MANIFEST_FORMAT = "epochal-manifest"
#: 2: adds ``checksum`` (required from this version on)
MANIFEST_VERSION = 2
MANIFEST_RE = re.compile(r"^manifest\.(0|[1-9][0-9]*)\.json$")


def manifest_name(epoch: int) -> str:
    """The file name of the manifest of ``epoch``: ``manifest.<epoch>.json``."""
    return f"manifest.{int(epoch)}.json"


def parse_manifest_name(name: str) -> int | None:
    """The epoch of a manifest file name, None for any other name."""
    m = MANIFEST_RE.match(name)
    return int(m.group(1)) if m is not None else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _canonical(data: dict[str, Any]) -> bytes:
    body = {k: v for k, v in data.items() if k != "checksum"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _crc(algorithm: str, raw: bytes) -> str | None:
    if algorithm == "crc32":
        return f"{zlib.crc32(raw) & 0xFFFFFFFF:08x}"
    if algorithm == "crc32c":
        try:
            import crc32c
        except ImportError:  # pragma: no cover - crc32c is a dependency
            return None
        return f"{crc32c.crc32c(raw):08x}"
    return None


def content_checksum(data: dict[str, Any]) -> str:
    """The checksum of a manifest's content (every field but ``checksum``, canonical JSON)."""
    raw = _canonical(data)
    value = _crc("crc32c", raw)
    return f"crc32c:{value}" if value is not None else f"crc32:{_crc('crc32', raw)}"


def _checksum_ok(data: dict[str, Any], stored: str) -> bool:
    algorithm, _, value = stored.partition(":")
    return _crc(algorithm, _canonical(data)) == value


def encode_manifest(data: dict[str, Any]) -> bytes:
    """The bytes of a manifest: ``data`` with its content checksum, as indented JSON."""
    out = {k: v for k, v in data.items() if k != "checksum"}
    out["version"] = MANIFEST_VERSION
    out["checksum"] = content_checksum(out)
    return (json.dumps(out, indent=1) + "\n").encode("utf-8")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def decode_manifest(raw: bytes, where: str, epoch: int) -> dict[str, Any]:
    """Parse and validate the manifest bytes of ``epoch`` read from ``where`` (a path or URL).

    CheckpointCorruptError naming ``where`` when it is not valid JSON, not a manifest of that
    epoch, or fails its checksum; CheckpointVersionError when a newer epochal wrote it."""
    try:
        data = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as ex:
        raise CheckpointCorruptError(where, f"manifest is not valid JSON ({ex})") from None
    validate_manifest(where, data, epoch)
    return data  # type: ignore[no-any-return]


def validate_manifest(where: str, data: Any, epoch: int) -> None:
    """Raise CheckpointCorruptError naming ``where`` unless ``data`` is a valid manifest of
    ``epoch`` (see the module docstring)."""

    def bad(message: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(where, f"invalid manifest: {message}")

    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise bad(f"format is not {MANIFEST_FORMAT!r}")
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise bad("no version")
    if version > MANIFEST_VERSION:
        raise CheckpointVersionError(
            where, f"manifest version {version} is newer than this epochal reads ({MANIFEST_VERSION})"
        )
    if version >= 2:
        stored = data.get("checksum")
        if not isinstance(stored, str) or not _checksum_ok(data, stored):
            raise bad("its checksum does not match its content (damaged or edited)")
    if data.get("epoch") != epoch or not _is_int(data.get("epoch")):
        raise bad(f"epoch is {data.get('epoch')!r}, the file name says {epoch}")
    if not isinstance(data.get("db_type"), str) or not data["db_type"]:
        raise bad("db_type is missing")
    if not isinstance(data.get("final", False), bool):
        raise bad("final is not a boolean")
    metrics = data.get("metrics", {})
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and (v is None or isinstance(v, (int, float)) and not isinstance(v, bool))
        for k, v in metrics.items()
    ):  # null: a value that was NaN or infinite (see epochal.checkpoint.location.best)
        raise bad("metrics is not a mapping of names to numbers (or null)")
    nodes = data.get("nodes")
    if not isinstance(nodes, dict) or not nodes:
        raise bad("nodes is missing or empty")
    for node, entry in nodes.items():
        try:
            check_node_name(node)
        except ValueError as ex:
            raise bad(str(ex)) from None
        if not isinstance(entry, dict):
            raise bad(f"node {node!r} has no entry")
        file = entry.get("file")
        own = get_ckpt_filename(node, epoch)
        if not isinstance(file, str) or "/" in file or "\\" in file or not without_token(file).endswith(own):
            raise bad(f"node {node!r}: file {file!r} is not the name of its db of epoch {epoch} "
                      f"({own}, or that with a writer token)")
        size = entry.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad(f"node {node!r}: size {size!r}")
        digest = entry.get("digest")
        if digest is not None and not isinstance(digest, str):
            raise bad(f"node {node!r}: digest {digest!r}")


#: the keys :class:`Manifest` has fields for; any other key is kept in ``Manifest.extra``
_KNOWN_KEYS = ("format", "version", "checksum", "epoch", "db_type", "created", "final", "nodes", "metrics",
               "keep_best")


@dataclass(frozen=True)
class DbEntry:
    """One node's db in a manifest: its file name (beside the records directory), size in
    bytes and digest (the backend's cheap content identity; None when it has none)."""

    file: str
    size: int
    digest: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "size": self.size, "digest": self.digest}


@dataclass(frozen=True)
class KeepBest:
    """The best-k settings of the handler that wrote a manifest (``"keep_best"``), so tools can
    rank a directory's epochs without knowing the job: keep the ``k`` epochs with the best
    ``metric`` under ``mode`` (``"min"`` or ``"max"``)."""

    k: int
    metric: str
    mode: str

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "metric": self.metric, "mode": self.mode}

    @classmethod
    def parse(cls, raw: Any) -> KeepBest | None:
        """From a manifest's ``"keep_best"``: None unless it has exactly the shape epochal
        writes (the manifest then keeps it, unread, in ``extra``)."""
        if not isinstance(raw, dict) or set(raw) != {"k", "metric", "mode"}:
            return None
        k, metric, mode = raw["k"], raw["metric"], raw["mode"]
        if not _is_int(k) or not isinstance(metric, str) or not isinstance(mode, str):
            return None
        return cls(k, metric, mode)


@dataclass(frozen=True)
class Manifest:
    """The commit record of one epoch, typed: the db of each node, what wrote them and when,
    whether it is the job's last epoch, and the metrics recorded for it.

    ``metrics`` values are numbers as written (ints stay ints) or None (a NaN or infinite
    value: never ranked). ``extra``: keys of the JSON that epochal does not know (a newer or
    foreign writer), kept so that rewriting the manifest (``final``) does not drop them.
    :meth:`encode` of a manifest epochal wrote gives back exactly its bytes."""

    epoch: int
    db_type: str
    nodes: dict[str, DbEntry]
    final: bool = False
    created: str | None = None
    metrics: dict[str, float | int | None] = field(default_factory=dict)
    keep_best: KeepBest | None = None
    version: int = MANIFEST_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def decode(cls, raw: bytes, where: str, epoch: int) -> Manifest:
        """Parse and validate manifest bytes (see :func:`decode_manifest`: the same errors)."""
        return cls.from_dict(decode_manifest(raw, where, epoch))

    def encode(self) -> bytes:
        """The bytes of this manifest, with its content checksum (:func:`encode_manifest`)."""
        return encode_manifest(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """From a dict :func:`validate_manifest` accepted."""
        keep_best = KeepBest.parse(data["keep_best"]) if "keep_best" in data else None
        extra = {k: v for k, v in data.items() if k not in _KNOWN_KEYS}
        if "keep_best" in data and keep_best is None:
            extra["keep_best"] = data["keep_best"]  # not the shape epochal writes: kept, unread
        created = data.get("created")
        return cls(
            epoch=int(data["epoch"]),
            db_type=str(data["db_type"]),
            nodes={n: DbEntry(str(e["file"]), int(e["size"]), e.get("digest")) for n, e in data["nodes"].items()},
            final=bool(data.get("final", False)),
            created=str(created) if created is not None else None,
            metrics=dict(data.get("metrics", {})),
            keep_best=keep_best,
            version=int(data["version"]),
            extra=extra,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON content (without the checksum, which :func:`encode_manifest` adds), keys
        in the order epochal has always written them."""
        out: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "epoch": self.epoch,
            "db_type": self.db_type,
        }
        if self.created is not None:
            out["created"] = self.created
        out["final"] = self.final
        out["nodes"] = {n: e.to_dict() for n, e in self.nodes.items()}
        if self.metrics:
            out["metrics"] = dict(self.metrics)
        if self.keep_best is not None:
            out["keep_best"] = self.keep_best.to_dict()
        out.update(self.extra)
        return out

    @property
    def size(self) -> int:
        """Bytes of every db the manifest lists."""
        return sum(e.size for e in self.nodes.values())
