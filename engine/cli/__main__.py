"""`python -m engine.cli`: the same as `pdo`."""

import sys

from engine.cli import main

sys.exit(main())
