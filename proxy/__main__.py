"""``python -m proxy`` is the same as ``phasewatch``."""

from .tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
