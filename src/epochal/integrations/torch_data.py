"""The data position as checkpointable state: a sampler that resumes mid-epoch, exactly.

:class:`ResumableSampler` is a drop-in for ``RandomSampler``/``SequentialSampler`` whose
``state_dict()`` is the data position: the epoch and how many indices of it were handed out.
Each epoch's order is a seeded permutation of ``(seed, epoch)`` alone, so a sampler restored
in a new process hands out exactly the indices the killed one would have handed out next.

The DataLoader pitfall, and why the recipe below is exact: every ``iter(loader)`` draws a base
seed (for worker seeding) from the loader's ``generator``, or, without one, from the global
torch generator that dropout and ``RNGState`` use. A loop resumed mid-epoch calls ``iter()``
once more than the uninterrupted run did, so without a generator of its own every later
dropout mask is one draw off. Hence::

    sampler = ResumableSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, generator=torch.Generator())
    state = {"model": model, "opt": opt, "sched": sched, "sampler": sampler,
             "rng": epochal.RNGState(), "epoch": 0}
    ckpt.restore(state)
    while state["epoch"] < epochs:
        sampler.set_epoch(state["epoch"])   # the loop's epoch decides, not the sampler
        for batch in loader:
            ...                             # saves mid-epoch are exact
        ...                                 # end of epoch: validation, scheduler
        state["epoch"] += 1

Why ``set_epoch``: a checkpoint taken at an epoch's last batch has handed out every index of
the epoch, whether or not the loop has seen the end of it yet (a short last batch is built
after the sampler is exhausted, a full one before). Only the loop knows whether its end of
epoch work has run; ``set_epoch`` with the loop's own (checkpointed) counter makes the
resumed loop finish that epoch (no batch left, then the end-of-epoch work) exactly as the
uninterrupted one did. Without ``set_epoch`` a sampler whose epoch is used up starts the
next one at the next ``iter()``, which is exact for loops that only count steps.

The position counts the indices handed to the loader, which with ``num_workers=0`` is what the
loop consumed. Worker processes fetch ahead (``prefetch_factor`` batches each), so with
``num_workers > 0`` use torchdata's ``StatefulDataLoader`` (its ``state_dict`` accounts for
what was prefetched), and derive any per-sample randomness in workers from the sample index.

Under ``torch.distributed``, ``ResumableSampler(ds, seed=0, num_replicas=world, rank=rank)``
(the same ``seed`` on every rank) hands rank ``r`` the indices ``r, r + world, ...`` of the
epoch's permutation, padded (from its start) to a multiple of ``world`` as
``DistributedSampler`` does; its state is the epoch and this rank's position, so a resume in
a later epoch continues that epoch's order (torchdata's distributed sampler forgets the epoch).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch

from ..storage.encoding import tree as _tree

__all__ = ["ResumableSampler"]


def epoch_seed(seed: int, epoch: int) -> int:
    """The 64-bit seed of ``epoch``'s permutation (independent streams per seed and epoch)."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, np.uint64)[0])


def _nonnegative_int(state: dict[str, Any], key: str) -> int:
    value = state.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"sampler state {key!r} must be a non-negative int, got {value!r}")
    return value


class ResumableSampler(torch.utils.data.Sampler[int]):
    """Indices of ``data_source``, shuffled per epoch with ``seed`` (or in order), resumable.

    Iterating hands out the rest of the current epoch (an iterator abandoned part way leaves
    the position where it stopped, so the next ``iter()`` continues the same epoch); an
    ``iter()`` that finds the epoch used up starts the next one, unless ``set_epoch`` named
    the current epoch since. ``set_epoch(e)`` (as ``DistributedSampler``) moves to the start of
    epoch ``e`` unless that is already the current epoch. ``state_dict()``/
    ``load_state_dict()`` save and restore the position; see the module doc for the recipe.
    """

    def __init__(self, data_source: Sized, *, shuffle: bool = True, seed: int = 0,
                 num_replicas: int = 1, rank: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1 \
                or isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"need 0 <= rank < num_replicas, got rank={rank!r}, num_replicas={num_replicas!r}")
        self.num_replicas, self.rank = num_replicas, rank
        self.data_source = data_source
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._pinned = False  # set_epoch named the current epoch: no rollover at the next iter

    def __len__(self) -> int:
        """The indices of one epoch this rank hands out."""
        n = len(self.data_source)
        return -(-n // self.num_replicas) if n else 0

    def __repr__(self) -> str:
        replicas = f", rank={self.rank}/{self.num_replicas}" if self.num_replicas > 1 else ""
        return (f"ResumableSampler(n={len(self.data_source)}, shuffle={self.shuffle}, seed={self.seed}, "
                f"epoch={self.epoch}, position={self.position}{replicas})")

    def order(self, epoch: int) -> list[int]:
        """Every index of ``epoch`` this sampler (this rank) hands out, in order."""
        n = len(self.data_source)
        if not self.shuffle:
            every = list(range(n))
        else:
            g = torch.Generator()
            g.manual_seed(epoch_seed(self.seed, epoch))
            every = torch.randperm(n, generator=g).tolist()
        if self.num_replicas == 1 or not every:
            return every
        total = len(self) * self.num_replicas
        padded = (every * (total // n + 1))[:total]  # as DistributedSampler: repeat from the start
        return padded[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        n = len(self)
        if self.position >= n > 0 and not self._pinned:
            self.epoch, self.position = self.epoch + 1, 0  # the epoch was used up
        self._pinned = False
        order = self.order(self.epoch)
        while self.position < len(order):
            index = order[self.position]
            self.position += 1  # counted when handed out: the state then says what was taken
            yield index

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch`` (no-op when it is the current epoch: a resumed loop that
        calls ``set_epoch`` at the top of each epoch keeps its position)."""
        if int(epoch) != self.epoch:
            self.epoch, self.position = int(epoch), 0
        self._pinned = True

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                 "shuffle": self.shuffle, "size": len(self.data_source)}
        if self.num_replicas > 1:
            state.update(num_replicas=self.num_replicas, rank=self.rank)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved position (and with the saved seed). ValueError, touching
        nothing, when the state is malformed or was saved for a data set of another size or
        with shuffling on where it is off here (or the reverse)."""
        self.epoch, self.position, self.seed = self._checked(state)
        self._pinned = False

    def _checked(self, state: Any) -> tuple[int, int, int]:
        """(epoch, position, seed) of ``state`` if this sampler can take it; ValueError else."""
        if not isinstance(state, dict):
            raise ValueError(f"a sampler state must be a dict, not {type(state).__name__}")
        epoch, position, seed = (_nonnegative_int(state, k) for k in ("epoch", "position", "seed"))
        size = _nonnegative_int(state, "size")
        if size != len(self.data_source):
            raise ValueError(f"the sampler state is for {size} samples, the data set has {len(self.data_source)}")
        if state.get("shuffle") is not self.shuffle:
            raise ValueError(f"the sampler state has shuffle={state.get('shuffle')!r}, this sampler {self.shuffle}")
        replicas = (state.get("num_replicas", 1), state.get("rank", 0))
        if replicas != (self.num_replicas, self.rank):
            raise ValueError(f"the sampler state is rank {replicas[1]} of {replicas[0]}, this sampler is rank "
                             f"{self.rank} of {self.num_replicas}")
        if position > len(self):
            raise ValueError(f"the sampler state's position {position} is past the {len(self)} samples")
        return epoch, position, seed


def _sampler_problems(sampler: ResumableSampler, saved: Any, live: Any) -> list[str]:
    """What ``load_state_dict`` would refuse, found before any blob of the load is written
    (so a data set that changed size leaves the model and optimizer of the same load as
    they were)."""
    try:
        sampler._checked(saved)
    except ValueError as ex:
        return [str(ex)]
    return []


_tree.register_state_check(lambda o: isinstance(o, ResumableSampler), _sampler_problems)
