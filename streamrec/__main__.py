"""``python -m streamrec``: the console script where it is not on PATH (a venv not activated, a bare checkout)."""

import sys

from streamrec.cli import main

if __name__ == "__main__":  # imported (a walk over the package's modules), it runs nothing
    sys.exit(main())
