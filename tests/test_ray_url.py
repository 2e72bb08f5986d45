"""RaySession with checkpoints on moto's S3 server (127.0.0.1): every node writes and reads
its own db from its own process; the driver commits from what the nodes reported and never
opens a node's db."""

from __future__ import annotations

import os
import secrets
import sys
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
pytest.importorskip("s3fs", reason="s3fs is not installed")

from _pipeline import EXPECTED_TOTALS, build_pipeline  # noqa: E402
from test_url_checkpoints import _cat, _db, _forget_after  # noqa: E402

import epochal as ep  # noqa: E402
from epochal.checkpoint.location.view import CheckpointDirectory  # noqa: E402
from epochal.storage.io.remote import fsspec_store  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
NODES = [f"trainer_{n}" for n in range(3)]
LAST = len(EXPECTED_TOTALS)


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ["PYTHONPATH"] = os.pathsep.join([TESTS, *sys.path])  # workers import _pipeline
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def _train(url: str, opts: dict[str, Any]) -> int:
    from epochal.sessions.ray import RaySession

    with ep.Cluster():
        with ep.Job() as job:
            for n in range(len(NODES)):
                build_pipeline(n)
        session = RaySession()
        try:
            mgr = ep.MultiNodeCheckpointManager(url, storage_options=opts,
                                                metadata_handler=ep.DirectoryMetadataHandler())
            return int(ep.JobRunner(job, mgr).train(session))
        finally:
            session.close()


def test_ray_nodes_write_their_own_dbs_at_the_url(ray_cluster: Any, s3: dict[str, Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"s3://ckpts/ray-{secrets.token_hex(4)}/run"
    fsspec_store.set_storage_options("s3://ckpts", None)  # only the manager's options
    opened: list[str] = []
    real = fsspec_store.FsspecSource.__init__

    def spy(self: Any, name: str, what: str = "db") -> None:
        opened.append(name)
        real(self, name, what)

    monkeypatch.setattr(fsspec_store.FsspecSource, "__init__", spy)
    assert _train(url, s3) == LAST
    assert opened == []  # the driver read no node's db: sizes and digests came from the nodes
    d = CheckpointDirectory(url)
    assert d.committed_epochs() == list(range(LAST + 1))
    monkeypatch.undo()
    assert d.check_epoch(LAST, "full") == []
    final = {n: _cat(_db(url, n, LAST)) for n in NODES}

    _forget_after(url, 2)  # a new cluster, no local files: resume from the URL alone
    assert _train(url, s3) == LAST
    for n in NODES:
        assert _cat(_db(url, n, LAST)) == final[n]
