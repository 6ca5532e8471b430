"""``python -m minedraft ...``: the same command line as the ``minedraft`` script."""

import sys

from minedraft.cli import main

if __name__ == "__main__":
    sys.exit(main())
