"""``python -m smallbatch ...``: the CLI without the installed ``smallbatch`` script."""

from .pipeline.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
