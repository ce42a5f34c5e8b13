"""`python -m gcmoe_lab ...` = `gcmoe-lab ...` (the shell runners in tools/gpu use it: no console script needed)."""

import sys

from .cli import main

sys.exit(main())
