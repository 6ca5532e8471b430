"""``python -m distill``: the same as ``minedraft distill`` (``distill.run.main``)."""
import sys

from distill.run import main

sys.exit(main())
