"""`python -m vivace.bench`: the benchmark without the rest of vivace's CLI."""

import sys

from vivace.bench.cli import main

sys.exit(main())
