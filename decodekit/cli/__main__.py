"""`python -m decodekit.cli`: the `decodekit` command (what a helper process of `decodekit serve` is started as)."""

import sys

from . import main

sys.exit(main())
