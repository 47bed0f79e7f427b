"""``python -m advisor``: the command line."""

import sys

from advisor.cli import main

sys.exit(main())
