"""The ``epochal`` command line: look at checkpoints without writing code.

``epochal ls | inspect | verify | diff | stats | export | demo``; see docs/cli.md. The
entry point is :func:`epochal.cli.main.main` (also ``python -m epochal``). The logic that the
commands show lives in :mod:`epochal.cli.data` (plain dicts, no click or rich), so it can be
used and tested on its own; click and rich (the ``cli`` extra) are only imported by
:mod:`epochal.cli.commands`.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """Run the ``epochal`` command (see :func:`epochal.cli.main.main`)."""
    from .main import main as _main

    _main(argv)
