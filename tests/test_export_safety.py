"""``epochal export`` and ``export_safetensors`` never hang on a FIFO, refuse
names that collide once flattened (naming both), never destroy an earlier output when they
fail, name the file when the disk is full (never "internal error"), and write mode 0644 less
the umask like every other file epochal writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from epochal.cli.main import run as cli_run
from epochal.storage.formats.base import get_db_type

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")


@pytest.fixture
def no_hang():
    """Fail (not hang) when a call blocks for 20 s."""
    def alarm(*_):
        raise TimeoutError("blocked: the export hung")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "n.1")
    get_db_type("native").write(path, {"m": {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2)},
                                       "big": np.arange(300_000, dtype=np.float64)})
    return path


def cli(capsys, *args):
    capsys.readouterr()
    rc = cli_run(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("args", [["--to", "safetensors", "--blob", "m"], ["--to", "safetensors"], ["--to", "npz"]],
                         ids=["blob", "safetensors", "npz"])
def test_a_fifo_output_is_refused_naming_it(tmp_path, db, capsys, no_hang, args):
    fifo = str(tmp_path / ("out.npz" if "npz" in args else "out.st"))
    os.mkfifo(fifo)
    rc, out, err = cli(capsys, "export", db, *args, fifo)
    assert rc == 1 and fifo in err and "FIFO" in err and "internal error" not in err
    assert os.path.exists(fifo) and not os.path.isfile(fifo)  # still the FIFO, untouched


def test_export_safetensors_refuses_a_fifo_output_and_a_fifo_input(tmp_path, db, no_hang):
    from epochal.errors import CheckpointError
    from epochal.integrations.safetensors_export import export_safetensors

    fifo = str(tmp_path / "out.st")
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="FIFO") as info:
        export_safetensors(db, "m", fifo)
    assert info.value.filename == fifo
    fifo_in = str(tmp_path / "in.1")
    os.mkfifo(fifo_in)
    with pytest.raises(CheckpointError, match="in.1"):
        export_safetensors(fifo_in, "m", str(tmp_path / "x.st"))


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
def test_names_colliding_once_flattened_are_refused_naming_both(tmp_path, capsys, fmt):
    path = str(tmp_path / "n.2")
    get_db_type("native").write(path, {"m/x": np.zeros(3), "m": {"x": np.ones(3)}})
    out_path = str(tmp_path / f"o.{fmt}")
    rc, out, err = cli(capsys, "export", path, "--to", fmt, out_path)
    assert rc == 1 and "blob 'm/x'" in err and "key 'x' of blob 'm'" in err, err
    assert not os.path.exists(out_path)


def test_export_safetensors_writes_mode_0644_less_the_umask(tmp_path, db):
    from epochal.integrations.safetensors_export import export_safetensors

    for mask, mode in [(0o022, 0o644), (0o027, 0o640)]:
        old = os.umask(mask)
        try:
            out = str(tmp_path / f"m{mask:o}.st")
            assert sorted(export_safetensors(db, "m", out)) == ["b", "w"]
            rc = cli_run(["export", db, "--to", "safetensors", out + ".all"])
        finally:
            os.umask(old)
        assert rc == 0
        assert os.stat(out).st_mode & 0o777 == mode
        assert os.stat(out + ".all").st_mode & 0o777 == mode


_SMALL_DISK = textwrap.dedent("""
    import resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
    from epochal.cli.main import run
    sys.exit(run(sys.argv[1:]))
""")


@pytest.mark.slow
@pytest.mark.parametrize("args, name", [(["--to", "npz"], "out.npz"), (["--to", "safetensors"], "out.st"),
                                        (["--to", "safetensors", "--blob", "big_sd"], "out.st")],
                         ids=["npz", "safetensors", "blob"])
def test_a_failed_export_names_the_file_and_keeps_the_earlier_output(tmp_path, args, name):
    path = str(tmp_path / "n.3")
    get_db_type("native").write(path, {"big_sd": {"w": torch.arange(100_000, dtype=torch.float64)},
                                       "small": np.ones(2)})
    target = tmp_path / name
    target.write_bytes(b"the earlier export")
    proc = subprocess.run([sys.executable, "-c", _SMALL_DISK, "export", path, *args, str(target)],
                          capture_output=True, text=True, timeout=120, env=os.environ)
    assert proc.returncode == 1, proc.stderr
    assert str(target) in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert target.read_bytes() == b"the earlier export"
    assert sorted(os.listdir(tmp_path)) == sorted(["n.3", name])  # no temp file left
