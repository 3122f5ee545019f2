"""``fedparity federations``: add the app's ``local-simulation`` / ``local-deployment``
connections to Flower's ``$FLWR_HOME/config.toml``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TextIO

from ._common import (
    UsageError,
    _emit,
)

LOCAL_SIMULATION = "local-simulation"
LOCAL_DEPLOYMENT = "local-deployment"


def flower_config_path(flwr_home: str | None) -> Path:
    """``$FLWR_HOME/config.toml`` (Flower's default home is ~/.flwr)."""
    import os

    home = flwr_home or os.environ.get("FLWR_HOME") or str(Path.home() / ".flwr")
    return Path(home).expanduser() / "config.toml"


def run_federations(args: argparse.Namespace, out: TextIO) -> int:
    """Add the ``local-simulation`` (default) and ``local-deployment`` connections.

    Flower 1.41 keeps connections in ``$FLWR_HOME/config.toml``; a ``[tool.flwr.federations]``
    table in pyproject.toml would be migrated there and commented out of the project file, so
    the project ships this command instead. Other entries of the file are kept.
    """
    import tomllib

    import tomli_w  # a Flower dependency (Flower writes this file with it too)

    address = args.deployment_address
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--deployment-address must be HOST:PORT, got {address!r}")
    path = flower_config_path(args.flwr_home)
    config: dict[str, Any] = {}
    if path.exists():
        try:
            config = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as error:
            raise UsageError(f"--flwr-home: {path} is not valid TOML: {error}") from None
    superlink = config.setdefault("superlink", {})
    superlink[LOCAL_SIMULATION] = {"address": ":local:"}
    superlink[LOCAL_DEPLOYMENT] = {"address": address, "insecure": True}
    superlink.setdefault("default", LOCAL_SIMULATION)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(config), encoding="utf-8")
    payload = {
        "config_file": str(path),
        "default": superlink["default"],
        LOCAL_SIMULATION: superlink[LOCAL_SIMULATION],
        LOCAL_DEPLOYMENT: superlink[LOCAL_DEPLOYMENT],
    }
    text = (
        f"wrote {path}:\n"
        f"  {LOCAL_SIMULATION}: local simulation engine"
        + (" (default)" if superlink["default"] == LOCAL_SIMULATION else "")
        + f"\n  {LOCAL_DEPLOYMENT}: SuperLink at {address} (insecure, loopback)\n"
        f"then: flwr run . {LOCAL_DEPLOYMENT} --stream"
    )
    _emit(payload, text, args.json, out)
    return 0


# --- keys ---------------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``fedparity federations`` and its options."""
    federations = commands.add_parser(
        "federations",
        help="add the local-simulation and local-deployment connections to Flower's config",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Add Flower connections named local-simulation and local-deployment to Flower's "
            "config\n(its other entries are kept).\n\n"
            "examples:\n"
            "  fedparity federations\n"
            "      then: flwr run . local-deployment --stream\n"
            "  fedparity federations --deployment-address 127.0.0.1:9193 --json"
        ),
    )
    federations.add_argument("--flwr-home", default=None, help="default: $FLWR_HOME or ~/.flwr")
    federations.add_argument(
        "--deployment-address",
        default="127.0.0.1:9093",
        help="the SuperLink of local-deployment (its --port)",
    )
    federations.add_argument("--json", action="store_true", help="print one JSON object")
