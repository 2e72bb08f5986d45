"""Shared fixtures: every test gets fresh context stacks and a quiet runner."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Callable, Iterator

import pytest

os.environ.setdefault("EPOCHAL_QUIET", "1")
# Ray drivers keep 127.0.0.1 as it is (else Ray swaps in the host's routable IP); read when ray
# is first imported, so set here, before any test module imports it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(autouse=True)
def _fresh_contexts():
    """A test never sees another test's active Cluster/Node/Job/TaskGroup/Task."""
    from epochal.execution.task import Cluster, Node, Task, TaskGroup
    from epochal.jobs.job import Job

    classes = (Cluster, Node, Task, TaskGroup, Job)
    saved = {c: list(c._stack()) for c in classes}
    for c in classes:
        c._stack().clear()
    yield
    for c in classes:
        c._stack()[:] = saved[c]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3():
    """An S3-compatible server (moto) on 127.0.0.1 with a bucket ``ckpts``; yields the fsspec
    storage options that reach it. Stopped at the end of the module."""
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    port = _free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    opts = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "test", "secret": "test",
            "client_kwargs": {"region_name": "us-east-1"}}
    import urllib.request

    # create the bucket with a plain PUT (moto does not check signatures)
    urllib.request.urlopen(urllib.request.Request(f"{opts['endpoint_url']}/ckpts", method="PUT")).read()
    yield opts
    server.stop()


@pytest.fixture
def o_direct_refused(monkeypatch) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A context manager: inside it, opening a file with O_DIRECT fails with EINVAL, as on
    filesystems that refuse it (tmpfs, some network filesystems)."""
    from epochal.storage.io import direct

    real = os.open

    def no_direct(path, flags, *a):
        if flags & direct._O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real(path, flags, *a)

    @contextlib.contextmanager
    def refused() -> Iterator[None]:
        with monkeypatch.context() as m:
            m.setattr(direct.os, "open", no_direct)
            yield

    return refused
