"""``python -m reference``: run the in-process reference loops (``reference.cli.main``)."""
import sys

from reference.cli import main

sys.exit(main())
