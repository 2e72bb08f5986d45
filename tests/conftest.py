"""Shared fixtures: every test gets fresh context stacks and a quiet runner."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("EPOCHAL_QUIET", "1")


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
