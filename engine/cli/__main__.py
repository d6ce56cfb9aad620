"""`python -m engine.cli`: the same as `pdo`."""

import sys

from . import main

sys.exit(main())
