"""The process-wide switches (epochal.knobs): each override puts the old value back, also when
the block raises; the switches reach what they govern; the CLI passes quietness on instead of
writing the environment; one atexit registry flushes live handlers and forgets dead ones."""

from __future__ import annotations

import gc
import os
import sys

import pytest

from epochal import knobs
from epochal.checkpoint.mirroring import sync
from epochal.checkpoint.tasks.background import BackgroundSaver

VALUES = {"zero_copy": [False, True], "switch_interval": [0.002, None], "quiet": [True, False]}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_override_sets_and_restores_each_knob(name):
    old = getattr(knobs.get(), name)
    for value in VALUES[name]:
        with knobs.override(**{name: value}) as k:
            assert getattr(knobs.get(), name) == value == getattr(k, name)
        assert getattr(knobs.get(), name) == old


@pytest.mark.parametrize("name", sorted(VALUES))
def test_override_restores_on_exception(name):
    old = knobs.get()
    with pytest.raises(RuntimeError, match="boom"):
        with knobs.override(**{name: VALUES[name][0]}):
            raise RuntimeError("boom")
    assert knobs.get() == old


def test_overrides_nest_and_unknown_names_are_refused():
    with knobs.override(zero_copy=False):
        with knobs.override(switch_interval=None, zero_copy=True):
            assert (knobs.get().zero_copy, knobs.get().switch_interval) == (True, None)
        assert (knobs.get().zero_copy, knobs.get().switch_interval) == (False, knobs.DEFAULT_SWITCH_INTERVAL)
    assert knobs.get() == knobs.Knobs()
    with pytest.raises(TypeError, match="zero_cpy"):
        with knobs.override(zero_cpy=False):
            pass
    assert knobs.get() == knobs.Knobs()


def test_the_switch_interval_knob_governs_a_saver_built_without_one():
    saver, own = BackgroundSaver(), BackgroundSaver(switch_interval=0.003)
    before = sys.getswitchinterval()
    assert saver.switch_interval == knobs.DEFAULT_SWITCH_INTERVAL and own.switch_interval == 0.003
    try:
        with knobs.override(switch_interval=0.001):
            assert saver.switch_interval == 0.001 and own.switch_interval == 0.003
            saver._switch.enter()  # a write in flight: lowered to the knob's value
            assert sys.getswitchinterval() == pytest.approx(0.001)
            saver._switch.exit()
            assert sys.getswitchinterval() == before
        with knobs.override(switch_interval=None):  # None: left alone
            saver._switch.enter()
            assert sys.getswitchinterval() == before
            saver._switch.exit()
    finally:
        sys.setswitchinterval(before)


def test_quiet_knob_over_the_environment(monkeypatch):
    from epochal.progress import display_wanted

    monkeypatch.delenv("EPOCHAL_QUIET", raising=False)
    assert not knobs.is_quiet()
    with knobs.override(quiet=True):
        assert knobs.is_quiet() and not display_wanted()
    monkeypatch.setenv("EPOCHAL_QUIET", "1")
    assert knobs.is_quiet()
    with knobs.override(quiet=False):
        assert not knobs.is_quiet()


def test_cli_quiet_is_passed_on_not_written_to_the_environment(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from epochal.cli.commands import cli

    monkeypatch.delenv("EPOCHAL_QUIET", raising=False)
    env_before = dict(os.environ)
    loud = CliRunner().invoke(cli, ["demo", "--dir", str(tmp_path / "a"), "--epochs", "1", "--points", "3000"])
    assert loud.exit_code == 0, loud.output
    assert "done: epoch" in loud.output
    quiet = CliRunner().invoke(cli, ["-q", "demo", "--dir", str(tmp_path / "b"), "--epochs", "1", "--points", "3000"])
    assert quiet.exit_code == 0, quiet.output
    assert "done: epoch" not in quiet.output and "epoch" not in quiet.output
    assert (tmp_path / "b" / ".epochal").is_dir()  # it did train and checkpoint
    assert dict(os.environ) == env_before and "EPOCHAL_QUIET" not in os.environ


class _Flushable:
    def __init__(self, log: list[str], name: str, fail: bool = False) -> None:
        self.log, self.name, self.fail = log, name, fail

    def flush(self) -> None:
        self.log.append(self.name)
        if self.fail:
            raise OSError("mirror gone")


def test_exit_registry_flushes_live_handlers_and_forgets_collected_ones(monkeypatch):
    hooks: list[object] = []
    monkeypatch.setattr(sync.atexit, "register", hooks.append)
    registry, log = sync.ExitFlush(), []
    live, failing, dead = _Flushable(log, "live"), _Flushable(log, "failing", fail=True), _Flushable(log, "dead")
    for h in (failing, live, dead):
        registry.add(h)
    assert hooks == [registry.flush_all]  # one hook for the process, however many handlers
    del dead, h  # the loop variable held it too
    gc.collect()
    assert sorted(h.name for h in registry.live()) == ["failing", "live"]
    registry.flush_all()  # the failing one does not stop the other
    assert sorted(log) == ["failing", "live"]


def test_a_background_mirror_registers_its_handler_weakly(tmp_path):
    from epochal import DirectoryMetadataHandler

    handler = DirectoryMetadataHandler(mirror=str(tmp_path / "mirror"))
    ran: list[int] = []
    handler._mirror_call(ran.append, 1)
    handler.flush()
    assert ran == [1] and handler in sync.EXIT_FLUSH.live()
    ident = id(handler)
    del handler
    gc.collect()
    assert ident not in {id(h) for h in sync.EXIT_FLUSH.live()}
