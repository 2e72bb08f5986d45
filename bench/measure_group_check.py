"""The cost of the checksum-group agreement check (segment checksums
combined against the group's, from the index alone) on a warm load of 20,000 float32 arrays
of 1-64 KiB: paired, alternating loads with and without it in one process, medians.

    PYTHONPATH=src python bench/measure_group_check.py [DIR]
"""
import gc
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from epochal.storage.formats.native import NativeBackend, write_native
from epochal.storage.formats.native import index as index_mod

rng = np.random.default_rng(0)
sizes = np.exp(rng.uniform(np.log(1024), np.log(65536), 20000)).astype(int) // 4
blobs = {f"a{i:05d}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)}
path = os.path.join(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(), "b.db")
write_native(path, blobs)
del blobs
B = NativeBackend()
real = index_mod.Index.disagreeing_groups
def off(self, ids, fn):
    return []
B.read(path)
on_t, off_t, ratios, check_t = [], [], [], []
for r in range(9):
    for mode in (("on", "off") if r % 2 else ("off", "on")):
        index_mod.Index.disagreeing_groups = real if mode == "on" else off
        gc.collect()
        t = time.perf_counter()
        B.read(path)
        dt = time.perf_counter() - t
        (on_t if mode == "on" else off_t).append(dt)
    ratios.append(on_t[-1] / off_t[-1])
index_mod.Index.disagreeing_groups = real
from epochal.storage.formats.native import NativeFile  # noqa: E402
from epochal.storage.io.checksum import checksum_function  # noqa: E402 - after the timing above

with NativeFile(path) as f:
    idx = f._index
    fn = checksum_function(idx.header.algorithm, inline=True)
    ids = list(range(len(idx.recs)))
    for _ in range(9):
        t = time.perf_counter()
        idx.disagreeing_groups(ids, fn)
        check_t.append(time.perf_counter() - t)
print(f"groups {len(idx.groups)}, segments {len(idx.segs)}")
print(f"warm load with check: median {statistics.median(on_t)*1000:.1f} ms; without: {statistics.median(off_t)*1000:.1f} ms; paired ratio median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
print(f"the check alone: median {statistics.median(check_t)*1000:.2f} ms")
