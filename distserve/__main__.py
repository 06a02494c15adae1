"""``python -m distserve``: the ``distserve`` command."""

import sys

from distserve.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
