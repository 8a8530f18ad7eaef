"""``python -m swarmserve``: the same as the ``swarmserve`` console script."""

import sys

from swarmserve.cli import main

sys.exit(main())
