"""`python -m ddpgraph`: the `ddpgraph` command."""

import sys

from .app.cli import main

sys.exit(main())
