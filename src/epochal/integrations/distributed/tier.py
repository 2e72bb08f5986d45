"""The local tier of a Checkpointer under ``torch.distributed``: each rank's part of every step in
its node-local directory, a copy on a peer, and a restore from the nearest intact place.

Each rank saves its own part of a step — the state dict :func:`~.state.dcp_state` gives it
(its shards, its per-rank values, the replicated values) — with the same DCP save the store gets,
but process-group-free (``no_dist``) into ``<local>/rank<r>``: a complete, ordinary epochal
location of one writer (a ``rank0.<step>`` db, a metadata db, a committed manifest, retention
keeping ``local_keep`` steps), which ``epochal ls``/``verify`` read like any other.
``replicas=R``: the files of that step are then sent to the rank ``replica_stride`` away (and
``2 * replica_stride``, ... for R > 1) over the job's own process group (gloo send/recv of
:data:`CHUNK`-byte chunks, each with its CRC-32C, checked on receipt), which commits them as an
ordinary step of its ``<local>/peer/rank<src>`` (the manifest last).

Restore (collective): the ranks agree on the newest step every rank can get — from its own
directory, a peer's copy of its part, or the store — by all-reduces over the steps each holds;
each rank then takes it from the nearest place whose copy is intact (its own, fully verified;
else its peer's, fetched over the process group into ``<local>/fetched/rank<r>``; else the
store). If any rank cannot, every rank moves to an older step together. A step only some ranks
can get is never used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import warnings
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException

from ...checkpoint.handler.directory import DirectoryMetadataHandler
from ...checkpoint.location.view import CheckpointDirectory
from ...errors import CheckpointCorruptError, CheckpointError
from ...storage.io.checksum import checksum
from ...storage.io.seam import committed, disk_store, local_path
from ..dcp import EpochalStorageReader, EpochalStorageWriter
from ..dcp.staging import HostStaging
from ..ranks import RankGroup, unwrap_failure
from .state import dcp_state

__all__ = ["RankTier"]

logger = logging.getLogger("epochal")

#: bytes per message of a copy between ranks (each with its own CRC-32C)
CHUNK = 4 << 20


class RankTier:
    """This rank's local tier (see the module doc). ``ranks``: the job's group (restores);
    ``per_rank``: as the DistributedCheckpointer's."""

    def __init__(self, base: str | os.PathLike[str], *, ranks: RankGroup, keep: int, persist_every: int | None,
                 replicas: int, stride: int | None, per_rank: set[str], async_save: bool) -> None:
        self.base = local_path(base)
        self.rank, self.world = ranks.rank, ranks.world
        self.ranks = ranks
        self.stride = int(stride if stride is not None else os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.replicas = int(replicas)
        if self.replicas < 0 or (self.replicas and (self.stride < 1 or self.replicas * self.stride >= self.world)):
            raise ValueError(f"replicas={replicas} with replica_stride={self.stride} needs a world of more than "
                             f"{max(self.replicas, 1) * max(self.stride, 1)} ranks, not {self.world}: a rank's "
                             "copies must go to other ranks")
        self.keep, self.persist_every, self.per_rank = keep, persist_every, per_rank
        self.directory = os.path.join(self.base, f"rank{self.rank}")
        os.makedirs(self.directory, exist_ok=True)
        self.handler = DirectoryMetadataHandler(keep_last=keep)
        self.handler.set_params(db_prefix=self.directory, db_type="native", node_names=[], path_prefix=None,
                                path_type=None)
        self.handler.acquire_lock()  # this rank's, until close()
        self.saves = 0
        self.async_save = async_save
        self._staging = HostStaging(None)
        # copies to peers from the background thread travel on a group of their own
        self._bg = ranks.fork() if (async_save and self.replicas) else ranks
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: where the last restore took this rank's part from ("local", "peer", "durable")
        self.source: str | None = None

    # -- places
    def peer_dir(self, src: int) -> str:
        """Where this rank keeps its copies of rank ``src``'s part."""
        return os.path.join(self.base, "peer", f"rank{src}")

    def _fetched_dir(self) -> str:
        return os.path.join(self.base, "fetched", f"rank{self.rank}")

    def steps(self) -> list[int]:
        """The steps of this rank's part committed in its local directory, oldest first."""
        return CheckpointDirectory(self.directory).committed_epochs()

    def due(self, preempted: bool) -> bool:
        """Whether this save also goes to the store (every ``persist_every``-th, or after SIGTERM)."""
        self.saves += 1
        return preempted or (self.persist_every is not None and self.saves % self.persist_every == 0)

    # -- save
    def save(self, step: int, sd: dict[str, Any], *, share: bool = False) -> tuple[dict[str, Any], bool] | None:
        """Save this rank's part ``sd`` of ``step`` locally, then copy it to the peers (with
        ``async_save`` both on a thread: ``sd`` is snapshotted first). Collective with replicas.
        ``share``: the snapshot is also written to the store; it is returned (None: none was
        taken) with a hold on its buffer for that write (:meth:`HostStaging.hold`; the caller
        releases it through :attr:`staging` once written), so a step that goes to both places
        is copied once."""
        self.wait()
        if not self.async_save:
            self._write(step, sd)
            return None
        snap = self._staging.snapshot_state(sd)
        if snap is None:
            # a state the staging does not snapshot whole (a tensor of another device, or CUDA
            # without HostStaging.OFF_DEVICE): planned here, each tensor copied into the
            # staging buffer as DCP hands it over, the db written in the background
            deferred: EpochalStorageWriter | None = None
            failed: BaseException | None = None
            try:
                deferred = self._writer(step, deferred=True)
                with _quiet():
                    dcp_save(sd, storage_writer=deferred, no_dist=True)
            except Exception as ex:  # agreed on in the background, as a write's failure
                failed = ex

            def run() -> None:
                try:
                    self._write(step, {}, self._bg, deferred, failed)
                except BaseException as ex:
                    self._error = ex
                finally:
                    if deferred is not None:
                        deferred.discard_deferred()  # (nothing is left after a written save)
        else:
            if share and snap[1]:
                self._staging.hold()

            def run() -> None:
                try:
                    self._write(step, snap[0], self._bg)
                except BaseException as ex:
                    self._error = ex
                finally:
                    if snap[1]:
                        self._staging.release()

        self._thread = threading.Thread(target=run, name="epochal-rank-tier", daemon=True)
        self._thread.start()
        return snap if share else None

    @property
    def staging(self) -> HostStaging:
        """The host memory of this rank's snapshots (see :meth:`save`'s ``share``)."""
        return self._staging

    def _writer(self, step: int, deferred: bool = False) -> EpochalStorageWriter:
        if CheckpointDirectory(self.directory).is_committed(step):
            raise CheckpointError(f"{self.directory}: step {step} is already committed (rank {self.rank})")
        return EpochalStorageWriter(self.directory, step=step, handler=self.handler, lock=False,
                                    deferred=deferred, staging=self._staging if deferred else None)

    def _write(self, step: int, sd: dict[str, Any], group: RankGroup | None = None,
               deferred: EpochalStorageWriter | None = None, failed: BaseException | None = None) -> None:
        """Write ``sd`` as this rank's ``step`` (or, given ``deferred``, the snapshot a deferred
        writer took; ``failed``: this rank could not take it), then copy it to the peers
        (collective with replicas)."""
        problem: BaseException | None = failed
        try:
            if failed is not None:
                pass
            elif deferred is not None:
                deferred.write_deferred()
                deferred.commit_deferred()
            else:
                with _quiet():
                    dcp_save(sd, storage_writer=self._writer(step), no_dist=True)
        except BaseException as ex:
            problem = ex
        if not self.replicas:
            if problem is not None:
                raise problem
            return
        ranks = group or self.ranks
        ranks.agree(problem, f"save step {step} to the local tiers")
        for j in range(1, self.replicas + 1):
            dst, src = (self.rank + j * self.stride) % self.world, (self.rank - j * self.stride) % self.world
            self._exchange(ranks, dst, self._files(self.directory, step), src, self.peer_dir(src), step)

    def busy(self) -> bool:
        """True while this rank's local write or copies of a step are running."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the local write (and copies) in flight; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    # -- copies between ranks
    @staticmethod
    def _files(directory: str, step: int) -> list[tuple[str, str]]:
        """(path, name relative to ``directory``) of every file of ``step``, the manifest last."""
        d = CheckpointDirectory(directory)
        manifest = d.read_manifest(step)
        files = [(os.path.join(directory, e.file), e.file) for e in manifest.nodes.values()]
        mpath = d.manifest_path(step)
        return files + [(mpath, os.path.relpath(mpath, directory))]

    def _exchange(self, ranks: RankGroup, dst: int | None, files: list[tuple[str, str]], src: int | None,
                  into: str, step: int) -> None:
        """Send ``files`` to rank ``dst`` and receive rank ``src``'s into ``into`` (either may be
        None), in :data:`CHUNK`-byte messages, each CRC-32C checked on receipt; the received
        step is committed by its manifest, written last, and older ones beyond ``keep`` go."""
        group = ranks.group
        sends: list[Any] = []

        def isend(t: torch.Tensor) -> None:
            sends.append((dist.isend(t, dst, group=group), t))

        sizes = [os.path.getsize(p) for p, _ in files] if dst is not None else []
        if dst is not None:
            isend(torch.tensor([len(files)], dtype=torch.int64))
            for (_, name), size in zip(files, sizes):
                raw = name.encode()
                isend(torch.tensor([len(raw), size], dtype=torch.int64))
                isend(torch.tensor(list(raw), dtype=torch.uint8))
        incoming: list[tuple[str, int]] = []
        if src is not None:
            n = torch.zeros(1, dtype=torch.int64)
            dist.recv(n, src, group=group)
            for _ in range(int(n.item())):
                head = torch.zeros(2, dtype=torch.int64)
                dist.recv(head, src, group=group)
                got = torch.zeros(int(head[0]), dtype=torch.uint8)
                dist.recv(got, src, group=group)
                incoming.append((bytes(got.tolist()).decode(), int(head[1])))
        for work, _ in sends:
            if work is not None:
                work.wait()
        out = [(p, sz) for (p, _), sz in zip(files, sizes)]
        if src is not None:
            os.makedirs(os.path.join(into, ".epochal"), exist_ok=True)
        _stream(group, dst, out, src, into, incoming, self.rank, step)
        if src is not None:
            _trim(into, self.keep)


    # -- restore
    def restore(self, state: MutableMapping[str, Any], durable: str, options: dict[str, Any] | None) -> int | None:
        """Load the newest step every rank can get, each rank from its nearest intact copy
        (collective; see the module doc). None: no step every rank can get (a fresh start)."""
        self.wait()
        mine = set(self.steps())
        durable_steps = set(CheckpointDirectory(durable).committed_epochs())
        held = self._held_for_me()  # replica index j -> steps rank r + j*stride holds of this rank's part
        bound = 1 << 62
        while True:
            can = mine | durable_steps | set().union(*held.values())
            below = [s for s in can if s <= bound]
            step = -self.ranks.all_max([-(max(below) if below else -1)])[0]
            if step < 0:
                self.source = None
                self._forget_after(-1)
                return None
            everyone = -self.ranks.all_max([-int(step in can)])[0]
            if not everyone:
                bound = step - 1
                continue
            problem: BaseException | None = None
            try:
                self.source = self._load_nearest(state, step, mine, held, durable_steps, durable, options)
            except CheckpointException as ex:
                problem = unwrap_failure(ex, f"load step {step}")
            except (CheckpointError, OSError) as ex:
                problem = ex
            failed = self.ranks.all_max([int(problem is not None)])[0]
            if not failed:
                self._forget_after(step)
                return step
            if problem is not None:
                logger.warning("Rank %d could not restore step %d from any copy: %s", self.rank, step, problem)
            bound = step - 1

    def _forget_after(self, step: int) -> None:
        """Uncommit this machine's copies of steps after ``step``, the one the run resumes from:
        the steps of the run that is abandoned, which the resumed run saves again. The files of
        a peer's copy cut short (never committed) go too: they would hold host memory for good."""
        peers = [self.peer_dir((self.rank - j * self.stride) % self.world) for j in range(1, self.replicas + 1)]
        for d in [self.directory, *peers]:
            if os.path.isdir(d):
                _drop(d, [s for s in CheckpointDirectory(d).committed_epochs() if s > step])
        for d in peers:
            if os.path.isdir(d):
                _sweep(d)

    def _held_for_me(self) -> dict[int, set[int]]:
        """For each replica j, the steps of this rank's part that rank r + j*stride holds
        (collective: every rank tells, in one all-reduce, the steps it holds of each source)."""
        width = self.keep + 2
        rows = torch.full((self.replicas, self.world, width), -1, dtype=torch.int64)
        for j in range(1, self.replicas + 1):
            src = (self.rank - j * self.stride) % self.world
            steps = CheckpointDirectory(self.peer_dir(src)).committed_epochs()[-width:] \
                if os.path.isdir(self.peer_dir(src)) else []
            rows[j - 1, src, :len(steps)] = torch.tensor(steps, dtype=torch.int64)
        got = self.ranks.all_max(rows.reshape(-1).tolist()) if self.replicas else []
        table = torch.tensor(got, dtype=torch.int64).reshape(self.replicas, self.world, width) if got else rows
        return {j: {int(s) for s in table[j - 1, self.rank].tolist() if s >= 0} for j in range(1, self.replicas + 1)}

    def _load_nearest(self, state: MutableMapping[str, Any], step: int, mine: set[int],
                      held: dict[int, set[int]], durable_steps: set[int], durable: str,
                      options: dict[str, Any] | None) -> str:
        """Load this rank's part of ``step`` from its own copy, else a peer's, else the store
        (the fetch from a peer is collective: every rank takes part)."""
        own_ok = step in mine and self._try_load(self.directory, step, state, "local")
        want = 0 if own_ok else next((j for j in sorted(held) if step in held[j]), 0)
        fetched = self._fetch(step, want)  # (every rank takes part)
        if own_ok:
            return "local"
        if fetched is not None:
            try:
                took = self._try_load(fetched, step, state, "peer")
            finally:  # (the fetched copy holds host memory: it goes once loaded)
                shutil.rmtree(fetched, ignore_errors=True)
            if took:
                return "peer"
        if step not in durable_steps:
            raise CheckpointCorruptError(self.directory, f"rank {self.rank} holds no intact copy of step {step}")
        self._load(durable, step, state, options)
        return "durable"

    def _fetch(self, step: int, want: int) -> str | None:
        """(Collective.) Every rank says which replica it wants ``step`` of its part from (0:
        none); each holder sends, each asker receives into its fetched directory."""
        if not self.replicas:
            return None
        asks = self.ranks.all_max([want if r == self.rank else 0 for r in range(self.world)])
        got: str | None = None
        for j in range(1, self.replicas + 1):
            src = (self.rank - j * self.stride) % self.world  # whose part this rank holds as replica j
            dst = (self.rank + j * self.stride) % self.world  # who holds this rank's as replica j
            serve = src if asks[src] == j else None
            take = dst if asks[self.rank] == j else None
            if serve is None and take is None:
                continue
            files = self._files(self.peer_dir(src), step) if serve is not None else []
            into = self._fetched_dir()
            if take is not None:
                shutil.rmtree(into, ignore_errors=True)
            self._exchange(self.ranks, serve, files, take, into, step)
            if take is not None:
                got = into
        return got

    def _try_load(self, directory: str, step: int, state: MutableMapping[str, Any], what: str) -> bool:
        """Load this rank's part of ``step`` from a copy on this machine; False (a warning
        naming the file at fault) when the copy is damaged."""
        try:
            CheckpointDirectory(directory).require_intact(step, "quick", word="step")
            self._load(directory, step, state, None)
            return True
        except (Exception, CheckpointException) as ex:  # (DCP's is a BaseException)
            err = unwrap_failure(ex, f"load step {step}")
            if not isinstance(err, (CheckpointCorruptError, CheckpointError, OSError)):
                raise err from ex
            logger.warning("Rank %d: the %s copy of step %d in %s is damaged: %s; using the next copy",
                           self.rank, what, step, directory, err)
            return False

    def _load(self, directory: str, step: int, state: MutableMapping[str, Any],
              options: dict[str, Any] | None) -> None:
        """This rank's part of ``step`` from ``directory`` into ``state`` (no collective)."""
        reader = EpochalStorageReader(directory, step=step, storage_options=options)
        saved = set(reader.read_metadata().state_dict_metadata)
        sd, after = dcp_state(state, self.rank, self.per_rank, saved, directory)
        with _quiet():
            dcp_load(sd, storage_reader=reader, no_dist=True)
        for key, apply in after.items():
            apply(sd[key])

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.handler.flush()
            self.handler.release_lock()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it assumes one process without a process group: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _stream(group: Any, dst: int | None, out: list[tuple[str, int]], src: int | None, into: str,
            incoming: list[tuple[str, int]], rank: int, step: int) -> None:
    """Send the files ``out`` (path, size) to ``dst`` while receiving ``incoming`` (name, size)
    from ``src`` into ``into``, chunk by chunk in lockstep (one chunk each way in flight)."""
    def chunks(files: list[tuple[str, int]]) -> list[tuple[int, int, int]]:
        return [(i, off, min(CHUNK, size - off)) for i, (_, size) in enumerate(files)
                for off in range(0, max(size, 1), CHUNK) if size]

    send_plan, recv_plan = chunks(out), chunks(incoming)
    sinks: dict[int, Any] = {}
    sources: dict[int, Any] = {}
    # one buffer each way, reused for every chunk (a send is waited for before the next
    # chunk is read into it): fresh 4 MiB buffers per chunk cost a page fault per page
    sendbuf = torch.empty(CHUNK if send_plan else 0, dtype=torch.uint8)
    recvbuf = torch.empty(CHUNK if recv_plan else 0, dtype=torch.uint8)
    send_head, recv_head = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    try:
        for k in range(max(len(send_plan), len(recv_plan))):
            pending = []
            if k < len(send_plan):
                i, off, n = send_plan[k]
                f = sources.get(i) or sources.setdefault(i, open(out[i][0], "rb", buffering=0))
                f.seek(off)
                buf = sendbuf[:n]
                view = buf.numpy().data
                got = 0
                while got < n:
                    r = f.readinto(view[got:])
                    if not r:
                        raise CheckpointCorruptError(out[i][0], f"ended at byte {off + got} while sent to rank {dst}")
                    got += r
                send_head[0], send_head[1] = n, checksum(buf.numpy(), "crc32c")
                pending += [dist.isend(send_head, dst, group=group), dist.isend(buf, dst, group=group)]
            if k < len(recv_plan):
                i, off, n = recv_plan[k]
                dist.recv(recv_head, src, group=group)
                name = incoming[i][0]
                if int(recv_head[0]) != n:
                    raise CheckpointCorruptError(os.path.join(into, name), f"chunk at byte {off} of step {step} "
                                                 f"from rank {src} has {int(recv_head[0])} bytes, not {n}")
                buf = recvbuf[:n]
                dist.recv(buf, src, group=group)
                if checksum(buf.numpy(), "crc32c") != int(recv_head[1]):
                    raise CheckpointCorruptError(os.path.join(into, name), f"chunk at byte {off} of step {step} "
                                                 f"from rank {src} failed its CRC-32C check on rank {rank}")
                if i not in sinks:
                    path = os.path.join(into, name)
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    sinks[i] = disk_store().create(path, incoming[i][1])
                sinks[i].write(buf.numpy())
                if off + n >= incoming[i][1]:
                    with committed(sinks.pop(i)):
                        pass
            for p in pending:
                if p is not None:
                    p.wait()
        for name, size in incoming:  # (an empty file has no chunk)
            if not size:
                with committed(disk_store().create(os.path.join(into, name), 0)):
                    pass
    finally:
        for f in sources.values():
            f.close()
        for sink in sinks.values():
            sink.abort()


def _trim(directory: str, keep: int) -> None:
    """Drop the committed steps of a peer copy beyond the newest ``keep`` (manifest first: a
    step is uncommitted before its dbs go)."""
    _drop(directory, CheckpointDirectory(directory).committed_epochs()[:-keep])


def _sweep(directory: str) -> None:
    """Remove the files of a peer's copy that no committed step names (a copy cut short)."""
    named = {path for step in CheckpointDirectory(directory).committed_epochs()
             for path, _ in RankTier._files(directory, step)}
    meta = os.path.join(directory, ".epochal")
    for d in (directory, meta):
        for entry in os.scandir(d) if os.path.isdir(d) else ():
            if entry.is_file() and entry.path not in named:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(entry.path)


def _drop(directory: str, steps: list[int]) -> None:
    """Remove ``steps`` of ``directory``, each manifest first (uncommitted before its dbs go)."""
    for step in steps:
        files = RankTier._files(directory, step)
        for path, _ in reversed(files):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
