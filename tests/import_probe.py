"""What importing a module loads, seen from a fresh interpreter (the tests' own process has
imported everything already)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Collection


def modules_loaded_by(module: str, roots: Collection[str]) -> list[str]:
    """The sorted modules under the top-level packages ``roots`` that ``import module`` loads
    in a new Python process."""
    probe = (
        f"import json, sys; import {module}; "
        f"print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] in {set(roots)!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])
