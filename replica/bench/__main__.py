"""``python -m replica.bench``: the same as ``prefixmesh bench``."""

import sys

from replica.bench import main

sys.exit(main())
