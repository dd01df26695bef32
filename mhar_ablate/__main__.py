"""``python -m mhar_ablate`` is the same command line as ``mhar-ablate``."""

import sys

from .cli import main

sys.exit(main())
