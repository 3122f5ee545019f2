"""fedparity: privacy-preserving group fairness for federated learning on Flower.

Four packages, layered bottom to top (``docs/contributing.md`` draws the rooms):

- :mod:`fedparity.mechanisms`: the math, with no Flower import (LDP mechanisms and estimators,
  the FedEvalFair tests, privacy accounting, cryptography, FPFL's multipliers);
- :mod:`fedparity.clients`: the node side (Flower ``ClientApp`` handlers, the node's privacy
  policy and ledger, the project app's task);
- :mod:`fedparity.strategies`: the server side of each protocol (``start(grid, ...)`` loops);
- :mod:`fedparity.server`: the ``ServerApp`` jobs, reports and the ``fedparity`` CLI.

In a checkout the four folders live at the top of the repository; ``fedparity/`` holds this
file and a symbolic link to each of them, so that editors and type checkers opened on the
checkout resolve ``fedparity.*`` the way the installed distribution does.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    #: The installed distribution's version (written once, in ``pyproject.toml``).
    __version__: str = version("fedparity")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

del PackageNotFoundError, version

__all__ = ["__version__"]
