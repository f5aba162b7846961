"""`python -m quantlab ...`, the same as the `quantlab` command (and what `torchrun -m quantlab` starts)."""

import sys

from quantlab.cli.main import main

sys.exit(main())
