"""The load promise, door by door: a worker run as a fresh process (as a user resumes).

``python _promise.py save DIR``: writes, in a process of its own, the checkpoints every case
starts from: ``DIR/ck`` (a Checkpointer, steps 1-3), ``DIR/job`` (a one-node JobRunner,
epochs 0-3) and ``DIR/multi`` (a two-node JobRunner, epochs 0-3). Each holds a 2-layer MLP,
its Adam optimizer (stepped), a tensor ``t`` and ``sd``, a 2-layer model's state dict.

``python _promise.py load DOOR CASE DIR``: builds the live objects of CASE (each differs
from the checkpoint in one way, or the checkpoint is damaged), loads through DOOR in this
fresh process, and prints one JSON line: the error's type and message (None when the load
succeeded), whether every live tensor is bit for bit what it was before the load, and
``restored``: whether every live tensor now holds the checkpoint's values. No pickle: JSON
on stdout.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import _live
import torch

import epochal
from epochal import CheckpointDirectory

DOORS = ("checkpointer", "train", "load_blobs")
CASES = ("fits", "deeper", "shallower", "groups", "shape", "dtype", "sd_keys", "older_db", "flipped")
STEP = 3  # the step (epoch) every door loads


def mlp(layers: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(8, 8), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def stepped(model: torch.nn.Module, groups: int = 1) -> torch.optim.Optimizer:
    if groups == 1:
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
    else:  # weights and biases in groups of their own
        named = list(model.named_parameters())
        opt = torch.optim.Adam([{"params": [p for n, p in named if n.endswith("weight")]},
                                {"params": [p for n, p in named if n.endswith("bias")]}], lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return opt


def state(case: str = "fits", seed: int = 0) -> dict[str, Any]:
    """The live objects of ``case`` (``fits``: what was saved, with other values)."""
    layers = {"deeper": 3, "shallower": 1}.get(case, 2)
    model = mlp(layers, seed)
    opt = stepped(model, 2 if case == "groups" else 1)
    t = torch.arange(6 if case == "shape" else 5, dtype=torch.float64 if case == "dtype" else torch.float32)
    sd = mlp(3 if case == "sd_keys" else 2, seed + 100).state_dict()
    return {"model": model, "opt": opt, "t": t + seed, "sd": sd}


def tensors(s: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of a case's live objects."""
    return _live.tensors(s["model"], s["opt"], s["t"], s["sd"])


same = _live.bit_equal


class Train:
    """One epoch: every live tensor moves (so each epoch's checkpoint differs)."""

    def __call__(self, ws: Any) -> None:
        with torch.no_grad():
            for p in ws["model"].parameters():
                p.add_(0.5)
            ws["t"].add_(1.0)
            for v in ws["sd"].values():
                v.add_(0.25)
        ws["done"] = ws["done"] + 1
        ws["stop"] = ws["done"] >= STEP


def job(nodes: list[str]) -> epochal.Job:
    with epochal.Job(nodes_to_checkpoint=nodes) as j:
        for n in nodes:
            epochal.Task(step=Train(), outputs=["stop"], node=n)
    j.add_stop_condition(j.epoch_group.tasks()[0].outputs()[0])
    return j


PerNode = _live.PerNode


def workspace(case: str, seed: int) -> epochal.Workspace:
    ws = epochal.Workspace()
    for k, v in state(case, seed).items():
        ws[k] = v
    ws["done"] = 0
    return ws


def save(root: str) -> None:
    s = state("fits", 0)
    with epochal.Checkpointer(os.path.join(root, "ck")) as ck:
        for step in range(1, STEP + 1):
            Train()({**s, "done": 0})
            ck.save(step, s)
    for name, nodes in (("job", ["a"]), ("multi", ["a", "b"])):
        manager: Any
        if len(nodes) == 1:
            manager = epochal.CheckpointManager(os.path.join(root, name), "a",
                                                metadata_handler=epochal.DirectoryMetadataHandler())
        else:
            manager = epochal.MultiNodeCheckpointManager(os.path.join(root, name),
                                                         metadata_handler=epochal.DirectoryMetadataHandler())
        epochal.JobRunner(job(nodes), manager, progress=False).train(
            PerNode({n: workspace("fits", i) for i, n in enumerate(nodes)}))


def damage(where: str, case: str) -> None:
    """``older_db``: step 3's db replaced by step 2's (same shapes, internally intact);
    ``flipped``: one byte of the model's data in step 3's dbs flipped."""
    d = CheckpointDirectory(where)
    for node, entry in d.read_manifest(STEP).nodes.items():
        path = os.path.join(where, entry.file)
        if case == "older_db":
            shutil.copyfile(os.path.join(where, d.read_manifest(STEP - 1).nodes[node].file), path)
        else:  # a byte of the model's first weight, found by its saved bytes
            saved = epochal.get_db_type("native").read(path, ["model"])["model"]
            raw = next(iter(saved.values())).numpy().tobytes()
            with open(path, "r+b") as f:
                at = f.read().find(raw) + 3
                assert at > 3, path
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 0x40]))


def _through(door: str, where: str, live: dict[str, Any]) -> None:
    """Load step ``STEP`` of ``where`` into ``live`` ({node: state}) through ``door``."""
    nodes = sorted(live)
    if door == "checkpointer":
        with epochal.Checkpointer(where) as ck:
            ck.restore(live["a"], step=STEP)
    elif door == "train":  # the job's last epoch: train() loads it and runs no epoch
        manager = epochal.CheckpointManager(where, "a", metadata_handler=epochal.DirectoryMetadataHandler())
        epochal.JobRunner(job(nodes), manager, progress=False, resume_from_epoch=STEP).train(PerNode(live))
    else:
        manager = epochal.MultiNodeCheckpointManager(where, metadata_handler=epochal.DirectoryMetadataHandler())
        runner = epochal.JobRunner(job(nodes), manager, progress=False)
        runner.load_blobs_from_checkpoints(["model", "opt", "t", "sd"], STEP, PerNode(live))


def live_objects(door: str, case: str, seed: int) -> dict[str, Any]:
    if door == "checkpointer":
        return {"a": state(case, seed)}
    nodes = ["a"] if door == "train" else ["a", "b"]
    return {n: workspace(case, seed + i) for i, n in enumerate(nodes)}


def load(door: str, case: str, root: str) -> dict[str, Any]:
    where = os.path.join(root, {"checkpointer": "ck", "train": "job", "load_blobs": "multi"}[door])
    if case in ("older_db", "flipped"):
        damage(where, case)
    live = live_objects(door, case, 7)
    before = {n: tensors(s) for n, s in live.items()}
    error = None
    try:
        _through(door, where, live)
    except Exception as ex:  # noqa: BLE001 - the worker reports whatever the door raised
        error = ex
    untouched = all(same(tensors(s), before[n]) for n, s in live.items())
    restored = False
    if error is None:  # a second load into other values gives the same tensors: the checkpoint's
        other = live_objects(door, case, 9)
        _through(door, where, other)
        restored = all(same(tensors(live[n]), tensors(other[n])) for n in live)
    return {"error": None if error is None else type(error).__name__,
            "message": None if error is None else str(error),
            "bases": [] if error is None else [c.__name__ for c in type(error).__mro__],
            "untouched": untouched, "restored": restored}


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(sys.argv[2])
    else:
        print(json.dumps(load(sys.argv[2], sys.argv[3], sys.argv[4])))
