"""The upload of a staged db to S3 alone, in one process: epochal's ``upload_to_key`` (one
PUT, or a multipart upload, streamed from the file: ``storage/io/remote/uploads.py``) against s3fs's
``put_file`` of the same local file, to moto's server on 127.0.0.1 (a process of its own).

Both variants upload the same file to fresh keys, alternating, the order flipped every round
(one warm-up round dropped); the figure is the median over N rounds of the paired ratio
``put_file`` time / ours (> 1: ours faster), with its min..max, per size. At 64 MiB both are
one PUT (s3fs reads the file into new memory first); at 256 MiB both are multipart uploads of
50 MiB parts, 10 in flight (s3fs reads each part into new memory).

    .venv/bin/python bench/bench_upload.py --mib 64,256 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _requests import moto_server  # noqa: E402

from epochal.storage.io.remote.fsspec_store import filesystem_for
from epochal.storage.io.remote.uploads import upload_to_key


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", default="64,256", help="sizes in MiB, comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    server, opts = moto_server()
    folder = tempfile.mkdtemp(prefix="epochal-bench-upload-")
    try:
        print(f"N = {args.rounds} rounds; load average {os.getloadavg()[0]:.2f}")
        print("| MiB | put_file s | ours s | put_file / ours |")
        print("|---:|---:|---:|---:|")
        for mib in [int(x) for x in args.mib.split(",")]:
            local = os.path.join(folder, f"db{mib}")
            with open(local, "wb") as f:
                for i in range(mib):
                    f.write(np.random.default_rng(i).bytes(1 << 20))
            size = os.path.getsize(local)
            times: dict[str, list[float]] = {"plain": [], "ours": []}
            for r in range(args.rounds + 1):
                for variant in (["plain", "ours"] if r % 2 else ["ours", "plain"]):
                    url = f"s3://bench/{variant}/m{mib}r{r}/trainer_0.0"
                    fs, key = filesystem_for(url, opts)
                    t = time.perf_counter()
                    if variant == "plain":
                        fs.put_file(local, key)
                    else:
                        upload_to_key(fs, key, local, size, url)
                    dt = time.perf_counter() - t
                    fs.invalidate_cache()
                    assert fs.info(key)["size"] == size, (variant, mib)
                    fs.rm_file(key)
                    if r:
                        times[variant].append(dt)
            ratios = [p / o for p, o in zip(times["plain"], times["ours"])]
            print(f"| {mib} | {statistics.median(times['plain']):.3f} | {statistics.median(times['ours']):.3f} | "
                  f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f}) |", flush=True)
            os.unlink(local)
        print(f"load average {os.getloadavg()[0]:.2f}")
    finally:
        server.terminate()
        server.wait()
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)


if __name__ == "__main__":
    main()
