"""``python -m smallbatch ...``: the CLI without the installed ``smallbatch`` script."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
