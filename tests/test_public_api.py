"""Every name shared/API.md makes public imports from the top-level package."""

from __future__ import annotations

import importlib

import pytest

import epochal

#: the names shared/API.md lists as imported from ``epochal``
API_NAMES = [
    "Workspace", "WorkspaceType", "Cluster", "Node", "TaskGroup", "Task", "TaskOutput",
    "final_output", "LocalSession", "Session", "Job", "epoch_limiter", "get_ckpt_filename",
    "db_name", "CheckpointManager", "MultiNodeCheckpointManager", "UploadTaskGroupBuilder",
    "JobRunner", "DirectoryMetadataHandler", "Checkpointer", "export_safetensors",
    "NodeLostError", "CheckpointLockedError", "BaseMetadataHandler", "CheckpointDirectory",
    "Preempted", "RNGState",
]


@pytest.mark.parametrize("name", API_NAMES)
def test_api_name_imports_from_epochal(name: str) -> None:
    value = getattr(epochal, name)
    assert value is not None
    assert name in epochal.__all__


def test_documented_integration_modules_import() -> None:
    sampler = importlib.import_module("epochal.integrations.torch").ResumableSampler
    assert sampler.__name__ == "ResumableSampler"
    assert epochal.CheckpointDirectory.__name__ == "CheckpointDirectory"
