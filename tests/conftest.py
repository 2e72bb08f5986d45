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


#: the test tiers (``make test-fast`` runs ``unit`` and ``conformance``; ``make test`` runs all).
#: A file may set its own tier with ``pytestmark = pytest.mark.system``; otherwise it is taken
#: from here, and any file not named is ``unit``. ``system``: real processes, clusters, servers,
#: kills and benchmarks (most of the suite's time); ``conformance``: suites every backend or
#: store passes, and property/forgery sweeps.
SYSTEM_FILES = {
    "test_ray_session", "test_ray_url", "test_cluster", "test_torch_lm_kill", "test_torch_resume",
    "test_kill", "test_bench_smoke", "test_bench_quick", "test_fuzz_quick", "test_cli",
    "test_cli_urls", "test_cli_loop", "test_url_checkpoints", "test_remote", "test_mirror",
    "test_preemption", "test_demo", "test_lightning", "test_hf_trainer", "test_dcp_blocks",
}
CONFORMANCE_FILES = {
    "test_db_conformance", "test_fsspec_store", "test_forged_dbs", "test_native_props",
    "test_format_doc_reader",
}
TIERS = ("unit", "conformance", "system")


@pytest.fixture(autouse=True)
def _torch_not_deterministic():
    """A test that turns torch's deterministic mode on (Lightning's Trainer(deterministic=True)
    does, for the whole process) does not leave it on for the next test."""
    yield
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test exactly one tier marker (see SYSTEM_FILES); ``slow`` tests are
    ``system`` whatever their file."""
    for item in items:
        if any(item.get_closest_marker(t) for t in TIERS):
            continue
        stem = item.path.stem
        if item.get_closest_marker("slow") or stem in SYSTEM_FILES:
            item.add_marker(pytest.mark.system)
        elif stem in CONFORMANCE_FILES:
            item.add_marker(pytest.mark.conformance)
        else:
            item.add_marker(pytest.mark.unit)


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
