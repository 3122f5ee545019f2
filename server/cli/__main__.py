"""``python -m fedparity.server.cli``."""

from .commands import main

raise SystemExit(main())
