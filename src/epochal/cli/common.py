"""What every ``epochal`` command shares: the output object (rich console or JSON), number
formatting, the common options (``--json``, ``--db-type``, ``-o KEY=VALUE``) and the
path-or-URL argument type. Click and rich are imported here and in :mod:`.commands` only."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.text import Text

F = TypeVar("F", bound=Callable[..., Any])

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# ------------------------------------------------------------------ output helpers
class Out:
    """Where a command writes: a rich console on stdout (and one on stderr for notes)."""

    def __init__(self, color: bool | None, quiet: bool = False) -> None:
        #: ``epochal -q``: commands that run a job show no progress (passed on, never put
        #: into the environment)
        self.quiet = quiet
        width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
        no_color = color is False or bool(os.environ.get("NO_COLOR"))
        self.console = Console(width=width, no_color=no_color, highlight=False, soft_wrap=False)
        self.err = Console(stderr=True, no_color=no_color, highlight=False, width=width)

    def json(self, obj: Any) -> None:
        click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))

    def note(self, text: str) -> None:
        self.err.print(Text(text))


def _out(ctx: click.Context) -> Out:
    obj = ctx.find_root().obj
    if not isinstance(obj, Out):
        obj = Out(None)
        ctx.find_root().obj = obj
    return obj


def human_bytes(n: int | float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"-"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"  # pragma: no cover


def human_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def fmt_num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")(f)


def db_type_option(f: F) -> F:
    return click.option(
        "--db-type", default=None, metavar="NAME",
        help="The db_type of the file(s) (default: detected from the file's first bytes).",
    )(f)


def parse_storage_options(options: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``-o KEY=VALUE`` items as fsspec storage options."""
    opts: dict[str, Any] = {}
    for item in options:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="-o/--option")
        opts[key] = value
    return opts


_cli_storage_options: dict[str, Any] = {}


def _remember_options(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> None:
    _cli_storage_options.clear()
    _cli_storage_options.update(parse_storage_options(value))


def storage_options_option(f: F) -> F:
    """``-o KEY=VALUE`` (repeatable): fsspec options for the command's URL arguments."""
    return click.option(
        "-o", "--option", "options", multiple=True, metavar="KEY=VALUE", is_eager=True,
        expose_value=False, callback=_remember_options,
        help="An fsspec storage option for a URL argument (repeatable), e.g. -o endpoint_url=http://127.0.0.1:9000.",
    )(f)


class Location(click.ParamType):
    """A local path that exists (as ``click.Path``), or an fsspec URL (``s3://bucket/run``):
    a URL is taken as it is, with the command's ``-o`` options recorded for it."""

    name = "path|url"

    def __init__(self, file_okay: bool = True) -> None:
        self.path = click.Path(exists=True, dir_okay=True, file_okay=file_okay)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            from ..storage.io.location import location_for
            from ..storage.io.seam import local_path

            where = location_for(value, _cli_storage_options)
            if where.is_url:
                where.remember()  # for this command's whole process (nothing without -o)
                return value
            value = local_path(value)  # file:// is the local disk
        return self.path.convert(value, param, ctx)


PathArg = Location()
FileArg = Location()  # directories refused with a clear line
PrefixArg = Location(file_okay=False)


def held_line(prefix: str, held: dict[str, Any] | None) -> str | None:
    """What ``epochal ls`` says of the bytes a local tier holds (see
    :func:`~.records.held_bytes`): None for a directory neither RAM-backed nor a ranks' tier."""
    if held is None or not (held["ram"] or held["ranks"]):
        return None
    where = "host memory (RAM-backed file system)" if held["ram"] else "a file system not RAM-backed"
    line = (f"{prefix} holds {human_bytes(held['total'])} of {where}: own steps {human_bytes(held['own'])}, "
            f"peers' copies {human_bytes(held['peers'])}, fetched {human_bytes(held['fetched'])} "
            "(expected: local_keep x S own, replicas x local_keep x S peers' copies)")
    if held["ranks"]:
        line += f"; locations: {', '.join(held['ranks'])} (epochal ls {prefix}/{held['ranks'][0]} lists one)"
    return line


def stats_rows(stats: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, shown value) of a blob's stats for ``epochal inspect`` (its leaves and key aside)."""
    return [(k, fmt_num(v) if not isinstance(v, (list, dict)) else json.dumps(v))
            for k, v in stats.items() if k not in ("leaves", "key")]
