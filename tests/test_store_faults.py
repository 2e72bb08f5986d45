"""The fault-injection seam itself: ``local_store`` swaps the store of plain paths for its block
only, and every format's bytes go through it (so a fault there is what a failing disk looks like
to everything above)."""

from __future__ import annotations

import errno
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _faults import FaultyStore  # noqa: E402

from epochal import get_db_type  # noqa: E402
from epochal.storage.io.seam import disk_store, local_store, store_for  # noqa: E402


@pytest.mark.parametrize("db_type", ["native", "safetensors"])
def test_writes_and_reads_of_every_format_go_through_the_seam(tmp_path, db_type):
    path = str(tmp_path / "a.db")
    blobs = {"w": np.arange(1000, dtype=np.float32)}
    faults = FaultyStore()
    with local_store(faults):
        get_db_type(db_type).write(path, blobs)
        assert faults.writes and set(faults.writes) == {path}
        faults.fail("read", err=errno.EIO)
        with pytest.raises(OSError) as info:
            get_db_type(db_type).read(path, ["w"])
        assert info.value.errno == errno.EIO and faults.hits[0] == (path, "read")
    got = get_db_type(db_type).read(path, ["w"])  # outside the block: the disk again
    assert np.array_equal(got["w"], blobs["w"])


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = str(tmp_path / "b.db")
    get_db_type("native").write(path, {"v": np.zeros(10)})
    before = open(path, "rb").read()
    faults = FaultyStore().fail("write", err=errno.ENOSPC)
    with local_store(faults), pytest.raises(OSError) as info:
        get_db_type("native").write(path, {"v": np.ones(10_000)})
    assert info.value.errno == errno.ENOSPC
    assert open(path, "rb").read() == before and os.listdir(tmp_path) == ["b.db"]


def test_the_store_comes_back_after_an_error_in_the_block(tmp_path):
    faults = FaultyStore()
    with pytest.raises(RuntimeError), local_store(faults):
        assert store_for(str(tmp_path / "x")) is faults
        raise RuntimeError("boom")
    assert store_for(str(tmp_path / "x")) is disk_store()
