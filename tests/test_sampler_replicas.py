"""ResumableSampler(num_replicas=, rank=): each rank its share of the epoch's order, resumable
in any epoch; state checked against the rank layout."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")

from torch.utils.data import DistributedSampler  # noqa: E402

from epochal.integrations.torch import ResumableSampler  # noqa: E402


@pytest.mark.parametrize("n", [10, 11, 3])
def test_ranks_share_the_epoch_as_distributed_sampler_does(n: int) -> None:
    data = list(range(n))
    ours = [list(ResumableSampler(data, shuffle=False, num_replicas=4, rank=r)) for r in range(4)]
    theirs = [list(DistributedSampler(data, num_replicas=4, rank=r, shuffle=False)) for r in range(4)]
    assert ours == theirs
    shuffled = [ResumableSampler(data, seed=7, num_replicas=4, rank=r) for r in range(4)]
    shares = [s.order(2) for s in shuffled]
    assert all(len(s) == len(shuffled[0]) == -(-n // 4) for s in shares)
    assert set().union(*shares) == set(data)  # every index, padding repeats the first ones
    whole = ResumableSampler(data, seed=7).order(2)
    assert [shares[i % 4][i // 4] for i in range(n)] == whole  # interleaved: the one permutation


def test_resume_mid_epoch_in_a_later_epoch_continues_that_epochs_order() -> None:
    data = list(range(20))
    a = ResumableSampler(data, seed=3, num_replicas=2, rank=1)
    a.set_epoch(3)
    it = iter(a)
    taken = [next(it) for _ in range(4)]
    state = a.state_dict()
    assert state["epoch"] == 3 and state["position"] == 4 and state["rank"] == 1 and state["num_replicas"] == 2
    rest = list(it)
    b = ResumableSampler(data, seed=3, num_replicas=2, rank=1)
    b.load_state_dict(state)
    b.set_epoch(3)
    assert list(b) == rest
    assert taken + rest == a.order(3) != a.order(0)


def test_state_of_another_rank_layout_is_refused_naming_both() -> None:
    data = list(range(8))
    state = ResumableSampler(data, num_replicas=2, rank=0).state_dict()
    s = ResumableSampler(data, num_replicas=2, rank=1)
    with pytest.raises(ValueError, match="rank 0 of 2.*rank 1 of 2"):
        s.load_state_dict(state)
    with pytest.raises(ValueError, match="rank 0 of 2.*rank 0 of 1"):
        ResumableSampler(data).load_state_dict(state)
    assert "num_replicas" not in ResumableSampler(data).state_dict()  # one process: as before
    with pytest.raises(ValueError, match="rank"):
        ResumableSampler(data, num_replicas=2, rank=2)
