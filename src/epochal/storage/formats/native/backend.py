"""``db_type="native"``: the native format behind the db backend interface."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ....errors import CheckpointCorruptError, CheckpointError
from ...encoding.codecs import LOAD_OPTIONS
from ...io.extents import ExtentSource
from ..base import BlobInfo, DbBackend, DbProblem, DbStat, ReadStats, register_db_type
from .layout import is_native
from .reader import NativeFile, stat_native
from .write import write_native

__all__ = ["NativeBackend"]


class NativeBackend(DbBackend):
    """``db_type="native"``: the format of this package (docs/format.md)."""

    name = "native"
    load_verifies = True
    checks_live = True

    def write(self, path: str, blobs: Mapping[str, Any]) -> int:
        return write_native(path, blobs)

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
        whole = names is None or LOAD_OPTIONS.get().whole
        with NativeFile(path, mmap=False, whole=whole) as f:
            return f.read(
                names, allow_incomplete=allow_incomplete, existing=existing, verify=verify,
                stats=stats,
            )

    def describe(self, path: str) -> list[BlobInfo]:
        with NativeFile(path, mmap=False) as f:
            return f.describe()

    def digest(self, path: str) -> str | None:
        """``native1:<algorithm>:<index checksum>:<file size>``: read from the superblock only;
        the index checksum covers every data checksum, so it identifies the content."""
        return stat_native(path).digest

    def verify(self, path: str) -> None:
        with NativeFile(path, mmap=False, whole=True) as f:  # (its exit names a damaged older file)
            f.verify()


    def check(self, path: str) -> list[DbProblem]:
        """Every damaged blob, each named (the checks go on past a damaged blob); a damaged
        header or index is one problem without a blob."""
        problems: list[DbProblem] = []
        try:
            with NativeFile(path, mmap=False, whole=True) as f:
                try:
                    f.verify()  # one pass when the file is sound (checksum groups included)
                    return problems
                except CheckpointCorruptError as e:  # (not kept: its frames hold buffers)
                    whole = DbProblem.of(e, path, e.blob)
                try:
                    _blame_refs(f)
                except CheckpointCorruptError as e:  # an older step's file it takes bytes from
                    problems.append(DbProblem.of(e, path))
                for blob in f.names():
                    try:
                        f.verify([blob])
                    except CheckpointCorruptError as e:
                        problems.append(DbProblem.of(e, path, blob))
                if not problems:  # only a checksum group disagrees with its segments
                    problems.append(whole)
        except (CheckpointError, OSError, ValueError) as e:
            problems.append(DbProblem.of(e, path))
        return problems

    def stat(self, path: str) -> DbStat:
        """From the 64-byte superblock alone."""
        st = stat_native(path)
        return DbStat(
            path, self.name, st.file_bytes, st.blob_count, st.data_bytes, st.digest,
            st.format_version, st.checksum_algorithm,
        )

    def sniff(self, head: bytes, size: int) -> bool:
        return is_native(head)


def _blame_refs(f: NativeFile) -> None:
    """For an incremental db whose data did not verify: raise the error naming the older
    step's file whose referenced bytes are damaged, if that is where the damage is."""
    src = getattr(f, "_src", None)
    if isinstance(src, ExtentSource):
        src.check_refs()


register_db_type("native", NativeBackend)
