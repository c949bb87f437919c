"""``python -m prefixmesh.cli``: the same as the ``prefixmesh`` console script."""

import sys

from prefixmesh.cli import main

sys.exit(main())
