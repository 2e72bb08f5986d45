"""A PyTorch job killed mid-training resumes bit for bit; loads restore live objects in place."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")

import _fresh  # noqa: E402

import epochal  # noqa: E402
from epochal import (  # noqa: E402
    CheckpointManager,
    Job,
    JobRunner,
    LocalSession,
    Task,
    Workspace,
)
from epochal.errors import BlobMismatchError  # noqa: E402
from epochal.storage.formats.base import get_db_type  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torch_mlp.py"
EPOCHS = 8


def run_example(ckpt: Path, *extra: str) -> Any:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
    return _fresh.start(str(EXAMPLE), ["--ckpt-dir", str(ckpt), "--epochs", str(EPOCHS), *extra], env=env)


def finish(p: Any) -> str:
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    return out


def digest_of(out: str) -> str:
    lines = [ln for ln in out.splitlines() if "final state sha256" in ln]
    assert lines, out
    return lines[-1].rsplit(" ", 1)[1]


def raw(t: Any) -> bytes:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_bit_equal(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_bit_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert raw(a) == raw(b), f"{path}: bytes differ"
    elif hasattr(a, "tobytes"):
        assert a.tobytes() == b.tobytes(), path
    else:
        assert a == b or (a != a and b != b), path


@pytest.mark.timeout(120)
def test_killed_example_resumes_bit_identical(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    killed = tmp_path / "killed"
    ref = run_example(straight)  # runs while the other one is being killed
    victim = run_example(killed, "--epoch-sleep", "0.4")
    deadline = time.monotonic() + 60
    # wait until epoch 3 is checkpointed, then kill -9 in the middle of epoch 4 or 5
    while not (killed / "local.3").exists():
        assert victim.poll() is None, victim.communicate()[0]
        assert time.monotonic() < deadline, "the example never reached epoch 3"
        time.sleep(0.05)
    time.sleep(0.5)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL
    assert not (killed / f"local.{EPOCHS}").exists(), "killed too late to test a resume"
    out_resumed = finish(run_example(killed))
    out_straight = finish(ref)
    assert "epoch   1 " not in out_resumed  # it resumed, it did not start over
    assert digest_of(out_resumed) == digest_of(out_straight)

    backend = get_db_type("native")
    names = ["model", "opt", "sched", "rng", "epochs_done"]
    a = backend.read(str(straight / f"local.{EPOCHS}"), names)
    b = backend.read(str(killed / f"local.{EPOCHS}"), names)
    assert a["epochs_done"] == b["epochs_done"] == EPOCHS
    for name in names:
        assert_bit_equal(a[name], b[name], name)


# --------------------------------------------------------------- in-process resume
def build(ckpt: Path, seed: int, epochs: int) -> tuple[Any, ...]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Dropout(0.3), torch.nn.Linear(5, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ws = Workspace()
    ws["model"], ws["opt"], ws["rng"] = model, opt, epochal.RNGState()
    ws["w0"] = model[0].weight  # a tensor blob shared with the model
    ws["done"] = 0

    def step(ws: Workspace) -> None:
        x = torch.randn(8, 3)
        loss = ws["model"](x).square().mean()
        ws["opt"].zero_grad()
        loss.backward()
        ws["opt"].step()
        ws["done"] += 1
        ws["stop"] = ws["done"] >= epochs

    # (a stop condition on a blob of ours: epoch_limiter's blob names are numbered per
    # process, so a job rebuilt in the same process would not find its counter)
    with Job(nodes_to_checkpoint=["local"]) as job:
        Task(step=step, outputs=["stop"])
    job.add_stop_condition("stop")
    ckpt.mkdir(exist_ok=True)
    manager = CheckpointManager(str(ckpt), "local", db_type="native")
    return job, manager, LocalSession(ws), ws, model, opt


def test_resume_restores_live_objects_in_place(tmp_path: Path) -> None:
    job, manager, session, ws, model, opt = build(tmp_path / "a", 0, 4)
    JobRunner(job, manager).train(session)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}

    ckpt = tmp_path / "b"
    job, manager, session, ws, _, _ = build(ckpt, 0, 4)
    JobRunner(job, manager).train(session)  # then "kill" and rerun from epoch 2:
    job, manager, session, ws, model2, opt2 = build(ckpt, 123, 4)
    weight = model2[0].weight
    JobRunner(job, manager, resume_from_epoch=2).train(session)
    assert ws["model"] is model2 and ws["opt"] is opt2 and model2[0].weight is weight
    assert ws["w0"] is weight
    for k, v in model2.state_dict().items():
        assert raw(v) == raw(expected[k]), k
    assert opt2.state[weight]["exp_avg"].shape == weight.shape


def _mismatch_message(tmp_path: Path) -> str:
    path = str(tmp_path / "db")
    backend = get_db_type("native")
    backend.write(path, {"model": torch.nn.Linear(4, 3)})
    live = torch.nn.Linear(4, 5)
    before = live.weight.detach().clone()
    with pytest.raises(BlobMismatchError) as ei:
        backend.read(path, ["model"], existing={"model": live})
    assert torch.equal(live.weight.detach(), before)  # nothing restored
    return str(ei.value)


def test_state_dict_shape_mismatch_names_entry_and_both_shapes(tmp_path: Path) -> None:
    msg = _mismatch_message(tmp_path)
    assert "(3, 4)" in msg and "(5, 4)" in msg and "weight" in msg


def test_state_dict_shape_mismatch_names_blob(tmp_path: Path) -> None:
    msg = _mismatch_message(tmp_path)
    assert "'model'" in msg, f"the error does not name the blob: {msg}"


def test_a_model_with_an_empty_buffer_is_still_shape_checked_before_any_write(tmp_path: Path) -> None:
    """Empty tensors are placeholders only in user objects; a model's shapes are fixed."""
    saved = torch.nn.Linear(4, 3)
    saved.register_buffer("extra", torch.ones(5))
    path = str(tmp_path / "db")
    get_db_type("native").write(path, {"model": saved})
    live = torch.nn.Linear(4, 3)
    live.register_buffer("extra", torch.empty(0))
    before = live.weight.detach().clone()
    with pytest.raises(BlobMismatchError, match=r"extra: checkpoint shape \(5,\), live object shape \(0,\)"):
        get_db_type("native").read(path, ["model"], existing={"model": live})
    assert torch.equal(live.weight.detach(), before)
