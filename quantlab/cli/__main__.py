"""`python -m quantlab.cli ...`, the same as the `quantlab` command."""

import sys

from quantlab.cli.main import main

sys.exit(main())
