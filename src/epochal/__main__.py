"""``python -m epochal``: the ``epochal`` command line (see :mod:`epochal.cli`)."""

from epochal.cli.main import main

if __name__ == "__main__":
    main()
