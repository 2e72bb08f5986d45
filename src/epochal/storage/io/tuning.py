"""The tuning thresholds of the formats' I/O, named once (each measured; see bench/RESULTS.md).

Modules read them as ``tuning.NAME`` at call time (never ``from tuning import NAME``), so a
test can shrink one with ``monkeypatch.setattr(tuning, "NAME", ...)`` and every read path
sees it. None of them changes a file's bytes: only how the bytes are moved.
"""

from __future__ import annotations

#: a load of more than this many blobs takes the bulk paths: the small-array batch, name
#: lookups through one dict, tables as Python lists, the cyclic GC paused for the load
MANY_BLOBS = 64

#: segments at least this big are read/written on their own, in pieces
BIG_SEGMENT = 1 << 20
#: piece size for big segments written (checksum of piece i, on a thread, overlaps the I/O of
#: piece i+1; small enough that the piece is still in cache when it is checksummed), and of
#: the ring buffers that verify in-place segments when mapping fails
CHUNK = 2 << 20
#: piece size for big segments read into fresh buffers (cold 2 GiB loads, paired: 8 MiB
#: pieces 1.16x and 1.00x the speed of 2 MiB pieces in two runs of N=6 and 8; fewer calls)
READ_PIECE = 8 << 20
#: in-place segments are read into live memory in pieces of this size (progress reports)
DIRECT_PIECE = 8 * CHUNK
#: scratch buffers of CHUNK bytes in the ring that verifies in-place segments
RING = 4

#: small segments are coalesced into one writev/preadv of about this many bytes (small
#: enough to stay in the CPU cache between the copy and the inline checksum)
BATCH_BYTES = 1 << 20
#: loads of many small plain arrays read adjacent segments in groups of about this many
#: bytes, one ``preadv`` into one buffer per group (the arrays are views of it)
GROUP_BYTES = 16 << 20
#: the safetensors writer hands the kernel its tensors in writev batches of about this size
STREAM_BATCH = 8 << 20

#: a load of at least this many bytes asks the kernel to read PREFETCH_WINDOW bytes ahead
PREFETCH_MIN = 4 << 20
PREFETCH_WINDOW = 64 << 20
PREFETCH_STEP = 16 << 20

#: in-place reads, and loads of big segments, of at least this many bytes are split over a
#: few threads
PARALLEL_MIN = 64 << 20
#: threads reading big segments into fresh buffers: for requests in flight, not for cores
#: (cold 2 GiB, paired, N=8: 4 threads 1.27x one thread's speed, and steady: 0.99-1.12 s)
IO_THREADS = 4
#: at most this many threads for the CPU-bound in-place passes (checksums of mapped pages)
CPU_THREADS = 4

#: local files of at least this many bytes are written with O_DIRECT through reused aligned
#: buffers (storage/io/direct.py) instead of through the page cache; None: never. Measured
#: on a quiet machine (bench/bench_torch.py --loop, bench/RESULTS.md "bench_torch.py"): a
#: training loop's saves of 0.94 GiB (N=6) 1.18 s O_DIRECT vs 5.6 s buffered (new page-cache
#: pages cost a host fault each on this VM); 896 MiB native saves, paired N=6: 1.63x (same
#: file rewritten) and 2.45x (a new file each time) the buffered speed, and steady (1.1-1.5 s
#: where buffered took 0.5-9.3 s). Under heavy load from other processes the gain was
#: smaller and sometimes a loss (0.73-1.75x).
DIRECT_MIN: int | None = 512 << 20
#: a file whose data area already lies in memory laid out as that area and left unchanged
#: until the commit (a background save's snapshot arena: storage/native/image.py) is written
#: with O_DIRECT straight from that memory from this size on (None: DIRECT_MIN applies). No
#: copy and no page-cache pages: 256 MiB background saves under 0.3 s epochs, paired, N=4 on a
#: loaded machine: the write 0.40x the buffered one's time, the loop's wait 0.28x
#: (bench/bench_async.py, bench/RESULTS.md "bench_async.py")
DIRECT_MIN_PINNED: int | None = 16 << 20
#: cold loads of big segments from a local file into fresh buffers read their whole pages
#: with O_DIRECT (storage/io/direct.py :func:`read_checked`), straight from the disk into
#: arrays placed congruent to their file offsets, checksummed by the reading threads
#: (bench/bench_resume.py, bare vs bare_pc, bench/RESULTS.md "bench_resume.py"; 8 x 32 MiB
#: arrays, paired, N=7, 2 busy cores: 0.83x the time of the page-cache path; quiet, loaded
#: machine: 1.0-1.1x, within the noise). False: through the page cache
DIRECT_READ = True
#: a cold load into live objects may stage the segments read in place through O_DIRECT
#: copies of at most this many bytes (and half the memory available), checked whole before
#: the first live byte is written, then copied (storage/formats/native/reads/inplace.py
#: :func:`stage_direct`). Off (0) by default: the copies are fresh memory, whose first-touch
#: faults cost about 1 ms per MiB on the VM measured, more than the disk's read (874 MiB LM
#: + AdamW, paired: 1.28x the page-cache path's time quiet, N=5; 1.40x busy, N=6)
DIRECT_STAGE_MAX = 0
#: size of each of those buffers, how many a save uses (kept across saves) and the threads
#: writing them (requests in flight, not cores)
DIRECT_BUFFER = 4 << 20
DIRECT_BUFFERS = 6
DIRECT_THREADS = 4

#: object storage (a source whose ``remote`` is True: storage/io/remote/fsspec_store.py): every big
#: segment is read in REMOTE_PIECE pieces, REMOTE_THREADS requests in flight, each piece
#: checksummed by the thread that fetched it; small segments are coalesced into requests of
#: about REMOTE_BATCH bytes. A request costs a round trip (and on moto's test server a read
#: of the whole object): 64 MiB loads from moto on 127.0.0.1, 2 ranges of 32 MiB took 0.18 s,
#: 4 of 16 MiB 0.24 s, 8 of 8 MiB 0.58 s (bench/RESULTS.md, "bench_remote.py")
REMOTE_PIECE = 32 << 20
REMOTE_THREADS = 8
REMOTE_BATCH = 16 << 20
#: a remote object of at most this many bytes is fetched whole by its first read; a bigger
#: one's first read at offset 0 also fetches its last REMOTE_TAIL bytes (a native db's index)
REMOTE_WHOLE = 256 << 10
REMOTE_TAIL = 64 << 10
#: a remote object a reader will read whole (a full load, a verify: ``hint(0, size)``) of at
#: most this many bytes is fetched by its first read, all its REMOTE_PIECE ranges in flight
#: together (held in memory until the file is closed); a bigger one: an open round trip,
#: then REMOTE_THREADS pieces at a time
REMOTE_WHOLE_LOAD = REMOTE_PIECE * REMOTE_THREADS
#: the part size of multipart uploads to a store with atomic uploads (None: the store's
#: default; s3fs: 50 MiB, one PUT below twice that, parts sent ``max_concurrency`` at a time)
UPLOAD_PART: int | None = None
