"""Lightning through epochal.integrations.lightning: every file ModelCheckpoint writes is an
epochal checkpoint (no pickle, CRC-32C, atomic), holding the whole checkpoint dict Lightning's
own IO holds; resumes end bit for bit where Lightning's own IO's do (after a stop, and after
SIGKILL between and inside saves, with pickle made to raise in the resuming process); top-k
deletions; load_lightning_module; the CLI on the files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
L = pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fresh  # noqa: E402
import _lightning_bits as bits  # noqa: E402

from epochal.cli.main import run as cli  # noqa: E402
from epochal.errors import CheckpointCorruptError, CheckpointError, UnsupportedBlobError  # noqa: E402
from epochal.integrations.lightning import (  # noqa: E402
    EpochalCheckpointIO,
    load_checkpoint,
    load_lightning_module,
)
from epochal.storage.formats.base import get_db_type, sniff_db_type  # noqa: E402
from epochal.storage.formats.native import MAGIC  # noqa: E402
from epochal.storage.io import atomic  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def ckpts(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".ckpt"))


def same(a: Any, b: Any, where: str = "checkpoint") -> None:
    """``a`` and ``b`` equal: tensors bit for bit (dtype, shape, bytes), the rest by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), where
        assert a.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == b.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), where
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
        return
    assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def _relative(value: Any, directory: str) -> Any:
    """``value`` with the run's directory taken out of strings and dict keys (paths in the
    ModelCheckpoint state), so two runs in two directories compare."""
    if isinstance(value, str):
        return value.replace(directory, "<dir>")
    if isinstance(value, dict):
        return type(value)((_relative(k, directory), _relative(v, directory)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_relative(v, directory) for v in value)
    return value


# ------------------------------------------------------------------ what is written
def test_fit_writes_epochal_files_holding_what_torch_io_holds(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "epochal" / "nested", tmp_path / "torch"
    bits.run(bits.Run(str(ours)))           # the parent folders are created by the plugin
    bits.run(bits.Run(str(theirs), io="torch"))
    # every 3 steps for 25 steps: 8 saves, top-2 by train_loss kept, plus last.ckpt
    assert len(ckpts(ours)) == 3 and "last.ckpt" in ckpts(ours)
    assert ckpts(ours) == ckpts(theirs)
    assert [p.name for p in ours.iterdir() if ".tmp." in p.name] == []
    for name in ckpts(ours):
        path = str(ours / name)
        head = (ours / name).read_bytes()[:8]
        assert head.startswith(MAGIC) and not head.startswith((b"PK", b"\x80"))  # not zip, not pickle
        assert sniff_db_type(path) == "native"
        get_db_type("native").verify(path)
        mine = load_checkpoint(path)
        other = torch.load(str(theirs / name), weights_only=False)  # the reference's own format
        assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks",
                "hyper_parameters", "epoch", "global_step"} <= set(mine)
        same(_relative(mine, str(ours)), _relative(dict(other), str(theirs)))


def test_topk_deletions_leave_exactly_k_files(tmp_path: Path) -> None:
    removed: list[str] = []
    saved: list[str] = []

    class Counting(EpochalCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            saved.append(os.path.basename(str(path)))
            super().save_checkpoint(checkpoint, path, storage_options)

        def remove_checkpoint(self, path: Any) -> None:
            removed.append(os.path.basename(str(path)))
            super().remove_checkpoint(path)

    torch.manual_seed(0)
    mc = L.callbacks.ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2, save_top_k=3,
                                     monitor="train_loss", filename="{step}")
    trainer = L.Trainer(max_steps=20, callbacks=[mc], plugins=[Counting()], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(bits.TinyModule(), bits.loader())
    left = ckpts(tmp_path)
    assert len(left) == 3 and len(saved) > 3 and len(removed) == len(saved) - 3
    assert set(left) == {os.path.basename(p) for p in mc.best_k_models} == set(saved) - set(removed)


# ------------------------------------------------------------------ resume
def _ban_pickle(mp: pytest.MonkeyPatch) -> None:
    import pickle

    def refuse(*a: Any, **kw: Any) -> None:
        raise AssertionError("pickle used on the resume path")

    for name in ("load", "loads", "Unpickler"):
        mp.setattr(pickle, name, refuse)
    mp.setattr(torch, "load", refuse)


@pytest.mark.parametrize("stop", [14, 20])
def test_resume_last_is_bit_identical_to_torch_io_resume(tmp_path: Path, stop: int) -> None:
    """Stopped at the same step, resumed with ckpt_path="last": the same final parameters as
    Lightning's own IO, bit for bit (mid-epoch, and at an epoch's end); epochal's resume with
    pickle and torch.load made to raise."""
    final = {}
    for io in ("epochal", "torch"):
        d = str(tmp_path / io)
        bits.run(bits.Run(d, io=io, max_steps=stop))
        r = bits.Run(d, io=io, ckpt_path="last")
        with pytest.MonkeyPatch.context() as mp:
            if io == "epochal":
                _ban_pickle(mp)
            trainer, model = bits.run(r)
        assert r.started_at == stop // 3 * 3 and trainer.global_step == 25
        final[io] = bits.params(model)
    assert final["epochal"] == final["torch"]


def test_a_torch_io_run_converted_once_resumes_as_with_torch_io(tmp_path: Path) -> None:
    """The switch recipe of docs/lightning.md: last.ckpt of a TorchCheckpointIO run converted
    in place, then resumed with the plugin, ends as the same resume with Lightning's own IO."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    final = {}
    for io in ("epochal", "torch"):
        d = tmp_path / io
        bits.run(bits.Run(str(d), io="torch", max_steps=14))
        if io == "epochal":
            ckpt = TorchCheckpointIO().load_checkpoint(str(d / "last.ckpt"), weights_only=True)
            EpochalCheckpointIO().save_checkpoint(ckpt, d / "last.ckpt")
            assert sniff_db_type(str(d / "last.ckpt")) == "native"
        _, model = bits.run(bits.Run(str(d), io=io, ckpt_path="last"))
        final[io] = bits.params(model)
    assert final["epochal"] == final["torch"]


def test_resume_from_a_path_and_mid_epoch_made_exact(tmp_path: Path) -> None:
    """A resume from a top-k file by its path; with a stateful loader (torchdata) and
    RNGStateCallback a mid-epoch resume ends where the uninterrupted run does, dropout
    included (docs/lightning.md); without them it does not."""
    pytest.importorskip("torchdata", reason="torchdata is not installed")
    kw = {"stateful_loader": True, "dropout": 0.2, "rng": True}
    _, full = bits.run(bits.Run(str(tmp_path / "full"), **kw))
    d = tmp_path / "cut"
    bits.run(bits.Run(str(d), max_steps=14, top_k=-1, **kw))
    mid = str(d / "epoch=0-step=9.ckpt")  # the last of 10 batches not yet drawn
    assert load_checkpoint(mid)["global_step"] == 9
    _, resumed = bits.run(bits.Run(str(d), ckpt_path=mid, **kw))
    assert bits.params(resumed) == bits.params(full)
    plain = tmp_path / "plain"
    bits.run(bits.Run(str(plain), max_steps=14, dropout=0.2))
    _, drifted = bits.run(bits.Run(str(plain), ckpt_path="last", dropout=0.2))
    _, plain_full = bits.run(bits.Run(str(tmp_path / "plain_full"), dropout=0.2))
    assert bits.params(drifted) != bits.params(plain_full)


def test_damaged_or_foreign_file_is_refused_by_name(tmp_path: Path) -> None:
    d = tmp_path / "run"
    bits.run(bits.Run(str(d), max_steps=6))
    last = d / "last.ckpt"
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0x10
    last.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="last.ckpt"):
        load_checkpoint(last)
    with pytest.raises(CheckpointCorruptError, match="last.ckpt"):
        bits.run(bits.Run(str(d), ckpt_path="last"))
    data[:4] = b"XXXX"  # its magic too: still read as epochal's, the damage named
    last.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="last.ckpt"):
        load_checkpoint(last)
    foreign = tmp_path / "torch.ckpt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(CheckpointError, match="not an epochal checkpoint.*torch.save"):
        load_checkpoint(foreign)
    with pytest.raises(FileNotFoundError, match="nothing.ckpt"):
        load_checkpoint(tmp_path / "nothing.ckpt")
    with pytest.raises(TypeError, match="map_location"):
        load_checkpoint(d / "epoch=0-step=6.ckpt", map_location=lambda s, loc: s)


# ------------------------------------------------------------------ values
def test_unstorable_values_name_their_key_path_and_write_nothing(tmp_path: Path) -> None:
    io = EpochalCheckpointIO()
    path = tmp_path / "x.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, path)
    before = path.read_bytes()
    with pytest.raises(UnsupportedBlobError, match=r"\['hyper_parameters'\]\['encoder'\]"):
        io.save_checkpoint({"state_dict": {}, "hyper_parameters": {"encoder": torch.nn.Linear(2, 2)}}, path)
    with pytest.raises(UnsupportedBlobError, match=r"hyper_parameters.*\['where'\]"):
        io.save_checkpoint({"state_dict": {}, "hyper_parameters": {"where": Path("/x")}}, path)
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"a": 1}, path, storage_options={"x": 1})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.ckpt"]
    io.remove_checkpoint(path)
    io.remove_checkpoint(path)  # gone already: nothing to do, as Lightning's own IO
    assert not path.exists()


def test_leftover_temp_files_of_dead_saves_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f"last.ckpt.tmp.{atomic.hostname()}.{dead}.0123abcd"
    other = tmp_path / "last.ckpt.tmp.otherhost.1.0123abcd"
    stale.write_bytes(b"half")
    other.write_bytes(b"half")
    EpochalCheckpointIO().save_checkpoint({"global_step": 3}, tmp_path / "last.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", other.name]


def test_load_lightning_module_for_inference(tmp_path: Path) -> None:
    trainer, model = bits.run(bits.Run(str(tmp_path), max_steps=9))
    path = str(tmp_path / "last.ckpt")
    loaded = load_lightning_module(bits.TinyModule, path, map_location="cpu")
    assert isinstance(loaded, bits.TinyModule) and loaded.hparams.lr == 0.05
    assert bits.params(loaded) == bits.params(model)  # saved at step 9, the last one
    relabelled = load_lightning_module(bits.TinyModule, path, label="served")
    assert relabelled.hparams.label == "served"
    x = torch.randn(3, 6)
    assert torch.equal(loaded(x), model(x))


def test_fabric_save_and_load(tmp_path: Path) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[EpochalCheckpointIO()])
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.weight.sum().backward()
    opt.step()
    path = tmp_path / "deep" / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "step": 7})
    assert sniff_db_type(str(path)) == "native"
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    rest = fabric.load(path, {"model": model2, "optimizer": opt2})
    assert rest == {"step": 7}
    same(model2.state_dict(), model.state_dict())
    same(opt2.state_dict(), opt.state_dict())


# ------------------------------------------------------------------ the CLI
def test_cli_verify_inspect_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "run"
    _, model = bits.run(bits.Run(str(d), max_steps=9))
    capsys.readouterr()
    assert cli(["verify", str(d)]) == 0
    out = capsys.readouterr().out
    assert "all 3 db file(s) intact" in out and "last.ckpt" in out
    assert cli(["verify", str(d / "last.ckpt")]) == 0
    capsys.readouterr()
    assert cli(["inspect", "--json", str(d / "last.ckpt")]) == 0
    names = [b["name"] for b in json.loads(capsys.readouterr().out)["blobs"]]
    assert {"state_dict", "optimizer_states", "loops", "callbacks"} <= set(names)
    st = tmp_path / "model.safetensors"
    assert cli(["export", str(d / "last.ckpt"), "--to", "safetensors", "--blob", "state_dict", str(st)]) == 0
    from safetensors.torch import load_file

    same(dict(sorted(load_file(str(st)).items())), dict(sorted(model.state_dict().items())))
    victim = d / "epoch=0-step=3.ckpt"
    if not victim.exists():
        victim = d / ckpts(d)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x01
    victim.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli(["verify", str(d)]) == 1
    assert f"DAMAGED {victim}" in capsys.readouterr().out
    assert cli(["verify", str(victim)]) == 1
    victim.unlink()
    torch.save({"state_dict": {}}, d / "foreign.ckpt")  # not an epochal db: reported, not skipped
    capsys.readouterr()
    assert cli(["verify", str(d)]) == 1
    out = capsys.readouterr().out
    assert "foreign.ckpt" in out and "DAMAGED" in out


# ------------------------------------------------------------------ kills (slow)
class Zygote:
    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_lightning_zygote.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def run(self, spec: dict[str, Any]) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the zygote died"
        return int(json.loads(line)["rc"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def zygote() -> Any:
    z = Zygote()
    yield z
    z.close()


KILLS = {  # name: (what the first run does, the step last.ckpt is left at)
    "between": ({"kill_step": 14}, 12),  # step 14 never starts; saves every 3 steps
    "inside-commit": ({"kill_save": 4, "kill_where": "commit"}, 9),  # step 12's last.ckpt, before its rename
    "inside-write": ({"kill_save": 4, "kill_where": "write"}, 9),    # step 12's last.ckpt, its first bytes written
}


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="needs fork and SIGKILL")
def test_sigkill_then_resume_last_matches_torch_io(tmp_path: Path, zygote: Zygote) -> None:
    """SIGKILL between saves and inside a save, then fit(ckpt_path="last") in a process where
    pickle and torch.load raise: every file left verifies, the rerun resumes from an intact
    last.ckpt, and ends bit for bit where the same kill and resume with Lightning's own
    TorchCheckpointIO ends (a kill inside its save is before its rename: its file is atomic too)."""

    def trial(name: str, io: str) -> dict[str, bytes]:
        d = tmp_path / f"{name}-{io}"
        run = {"directory": str(d), "io": io}
        kill, left_at = dict(KILLS[name][0]), KILLS[name][1]
        spec = {"run": {**run, "kill_step": kill.pop("kill_step", None)}, "out": str(d) + ".1.log", **kill}
        rc = zygote.run(spec)
        assert rc == -9, f"{name}/{io}: the run was not killed (rc {rc}):\n" + Path(spec["out"]).read_text()[-3000:]
        if io == "epochal":
            for f in ckpts(d):  # every file a kill left is whole
                get_db_type("native").verify(str(d / f))
            assert load_checkpoint(d / "last.ckpt")["global_step"] == left_at
            temps = [p.name for p in d.iterdir() if p.name.startswith("last.ckpt.tmp.")]
            assert len(temps) == (0 if name == "between" else 1), temps  # the killed write's
        result = str(d) + ".npz"
        spec = {"run": {**run, "ckpt_path": "last"}, "out": str(d) + ".2.log", "result": result,
                "no_pickle": io == "epochal"}
        rc = zygote.run(spec)
        log = Path(spec["out"]).read_text()
        assert rc == 0, f"{name}/{io}: the resume failed:\n{log[-3000:]}"
        assert f"resumed from {d / 'last.ckpt'} at step {left_at}" in log, log[-3000:]
        if io == "epochal":  # the resumed run's first save removed the dead one's temp file
            assert [p.name for p in d.iterdir() if ".tmp." in p.name] == []
        with np.load(result) as z:
            return {k: z[k].tobytes() for k in z.files}

    ref = {name: trial(name, "torch") for name in ("between", "inside-commit")}
    # the pickle ban bites: Lightning's own IO cannot resume under it
    spec = {"run": {"directory": str(tmp_path / "between-torch"), "io": "torch", "ckpt_path": "last"},
            "out": str(tmp_path / "banned.log"), "no_pickle": True}
    assert zygote.run(spec) == 1
    assert "pickle used on the resume path" in (tmp_path / "banned.log").read_text()
    assert ref["between"] != ref["inside-commit"]  # (the two kills resume from other steps)
    for name in KILLS:
        mine = trial(name, "epochal")
        assert mine == ref["inside-commit" if name == "inside-write" else name], name
    r = subprocess.run([sys.executable, "-m", "epochal.cli.main", "verify", str(tmp_path / "inside-write-epochal")],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src")))
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------ the load promise
RESUME_OTHER = """
import json, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[3])
import torch
import lightning.pytorch as L
import _lightning_bits as bits
from epochal.integrations.lightning import EpochalCheckpointIO
torch.manual_seed(3)
model = bits.TinyModule(hidden=int(sys.argv[2]))
before = {k: v.clone() for k, v in model.state_dict().items()}
trainer = L.Trainer(max_steps=30, plugins=[EpochalCheckpointIO()], logger=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                    enable_checkpointing=False, accelerator="cpu", devices=1)
error = None
try:
    trainer.fit(model, bits.loader(), ckpt_path=sys.argv[1])
except Exception as ex:
    error = f"{type(ex).__name__}: {ex}"
changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
print(json.dumps({"error": error, "changed": changed}))
"""


@pytest.mark.system
def test_a_resume_into_a_module_of_another_shape_changes_nothing(tmp_path: Path) -> None:
    bits.run(bits.Run(str(tmp_path), max_steps=6))
    last = str(tmp_path / "last.ckpt")
    out = _fresh.run("-c:" + RESUME_OTHER, [last, "24", os.path.dirname(os.path.abspath(__file__))], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["error"] is not None and got["error"].startswith("BlobMismatchError"), got
    assert "nothing was restored" in got["error"] and "last.ckpt" in got["error"]
    assert "net.0.weight: checkpoint shape (16, 6), live shape (24, 6)" in got["error"], got["error"]
    assert got["changed"] == []  # Lightning's own load_state_dict copies net.3.bias, then raises
