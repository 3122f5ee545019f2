"""``python -m fedparity.server.cli``."""

from . import main

raise SystemExit(main())
