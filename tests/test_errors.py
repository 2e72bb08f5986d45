"""The messages and fields of epochal's exceptions that carry more than a message."""

from __future__ import annotations

import epochal as ep


def test_node_lost_error_names_the_node_the_others_and_the_epoch() -> None:
    e = ep.NodeLostError("trainer_1", "its Ray actor is gone", nodes=["trainer_1", "trainer_3"], epoch=4)
    assert isinstance(e, ep.CheckpointError)
    assert (e.node, e.nodes, e.epoch) == ("trainer_1", ["trainer_1", "trainer_3"], 4)
    assert str(e) == ("node 'trainer_1' was lost: its Ray actor is gone (lost too: trainer_3); "
                      "last committed epoch: 4")
    alone = ep.NodeLostError("n0", "gone")
    assert (alone.nodes, alone.epoch, str(alone)) == (["n0"], None, "node 'n0' was lost: gone")
