"""`python -m kvchat` runs the `kvchat` command."""

import sys

from kvchat.tui.cli import main

sys.exit(main())
