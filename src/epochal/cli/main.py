"""Entry point of the ``epochal`` command (``epochal = epochal.cli.main:main``).

Turns every outcome into an exit code scripts can rely on: 0 ok, 1 a problem was found,
2 a usage error. Problems and usage errors are one line on stderr, never a traceback (set
``EPOCHAL_DEBUG=1`` to see one for an unexpected error).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import NoReturn

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2


def _fail(message: str, code: int) -> NoReturn:
    sys.stderr.write(f"epochal: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def _missing_extra() -> str | None:
    """The first missing package of the ``cli`` extra, or None."""
    for mod in ("click", "rich"):
        try:
            __import__(mod)
        except ImportError:
            return mod
    return None


def run(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    missing = _missing_extra()
    if missing is not None:
        _fail(f"the command line needs the {missing!r} package: pip install 'epochal[cli]'", EXIT_PROBLEM)

    import click

    from ..errors import CheckpointError
    from .commands import cli
    from .problems import Problem

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        rv = cli.main(args=args, prog_name="epochal", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:  # pragma: no cover - click >= 8.2
        click.echo(e.ctx.get_help() if e.ctx else str(e), err=True)
        return EXIT_USAGE
    except click.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "epochal"
        hint = f" (see '{where} --help')"
        sys.stderr.write(f"{where}: {e.format_message()}{hint}\n")
        return EXIT_USAGE
    except click.ClickException as e:
        sys.stderr.write(f"epochal: {e.format_message()}\n")
        return e.exit_code
    except click.exceptions.Exit as e:
        return int(e.exit_code or 0)
    except click.exceptions.Abort:
        sys.stderr.write("epochal: aborted\n")
        return EXIT_PROBLEM
    except Problem as e:
        sys.stderr.write(f"epochal: {e}\n")
        return EXIT_PROBLEM
    except (CheckpointError, OSError) as e:
        if os.environ.get("EPOCHAL_DEBUG"):
            traceback.print_exc()
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, OSError) and not isinstance(e, CheckpointError) and e.strerror:
            text = f"{e.filename + ': ' if e.filename else ''}{e.strerror}"
        sys.stderr.write(f"epochal: {text}\n")
        return EXIT_PROBLEM
    except KeyboardInterrupt:
        sys.stderr.write("epochal: interrupted\n")
        return 130
    except Exception as e:  # noqa: BLE001 - one line, never a traceback, for the user
        if os.environ.get("EPOCHAL_DEBUG"):
            traceback.print_exc()
        first = str(e).splitlines()[0] if str(e) else ""
        sys.stderr.write(f"epochal: internal error: {type(e).__name__}: {first} (EPOCHAL_DEBUG=1 shows the traceback)\n")
        return EXIT_PROBLEM
    return rv if isinstance(rv, int) else EXIT_OK


def main(argv: list[str] | None = None) -> None:
    """The console script: run the command line and exit with its code."""
    code = run(argv)
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):  # `epochal ls x | head`
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        except OSError:
            pass
    raise SystemExit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
