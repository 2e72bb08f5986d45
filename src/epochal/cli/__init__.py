"""The ``epochal`` command line: look at checkpoints without writing code.

``epochal ls | inspect | verify | diff | stats | export | pull | demo``; see docs/cli.md. The
entry point is :func:`epochal.cli.main.main` (also ``python -m epochal``). What the commands
show is computed by plain modules, one per idea (no click or rich: ``problems``, ``values``,
``names``, ``dbs``, ``records``, ``diff``, ``export``), so it can be used and tested on its own; click and rich (the ``cli``
extra) are only imported by :mod:`epochal.cli.commands`. This package imports none of its
modules, so there is no cycle between it, ``main`` and ``commands``.
"""
