"""``python -m hybrid.plan``: see :mod:`hybrid.plan.cli`."""

import sys

from hybrid.plan.cli import main

sys.exit(main())
