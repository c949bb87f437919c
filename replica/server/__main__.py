"""``python -m replica.server``: the same as ``prefixmesh replica``."""

import sys

from replica.server import main

sys.exit(main())
