"""Run a fedparity job from Python on Flower's simulation engine.

    from fedparity.server.api import run_simulation_job
    results = run_simulation_job({"task": "fedevalfair", ...}, num_supernodes=4)

The same ServerApp and ClientApp as ``flwr run .``; the run config given here is merged over
the defaults of pyproject.toml and validated before anything starts. Node-side settings
that Flower's simulation cannot set per node (e.g. FedEvalFair's secret-context path and the
holders' identity keys) are passed as environment variables of the simulation
(``environment=``); :func:`fedevalfair_simulation_keys` makes both for a FedEvalFair run::

    keys = fedevalfair_simulation_keys(folder, num_supernodes=4)
    run_simulation_job(
        {"task": "fedevalfair", "fef-public-context": str(keys.public_context)},
        num_supernodes=4,
        environment=keys.environment,
    )
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..clients.project.config import RunConfig
from .app import build_server_app

__all__ = ["SimulationKeys", "fedevalfair_simulation_keys", "run_simulation_job"]


@contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass(frozen=True)
class SimulationKeys:
    """Key material of a simulated FedEvalFair run (:func:`fedevalfair_simulation_keys`)."""

    #: The public TenSEAL context, for run config ``fef-public-context`` (the server's).
    public_context: Path
    #: The nodes' environment: ``FEDPARITY_SECRET_CONTEXT`` (the shared secret context) and
    #: ``FEDPARITY_IDENTITY_DIR`` (``node-<i>.key`` per partition and ``roster.toml``).
    environment: dict[str, str]


def fedevalfair_simulation_keys(
    folder: str | os.PathLike[str], num_supernodes: int
) -> SimulationKeys:
    """Write, under ``folder``, a CKKS key pair (``ckks/``, the public context apart in
    ``public/``) and an identity key per simulated node with their roster (``identity/``):
    what every FedEvalFair holder needs (docs/threat-model.md). For simulations and tests;
    real holders get theirs from ``fedparity keys --holders N``."""
    from ..clients.identity import IDENTITY_DIR_ENV
    from ..mechanisms.crypto.ckks import SECRET_CONTEXT_ENV, generate_keys
    from .cli.identity import write_node_identities

    base = Path(folder).expanduser()
    paths = generate_keys(base / "ckks", public_directory=base / "public")
    identities = write_node_identities(base / "identity", num_supernodes)
    return SimulationKeys(
        public_context=paths.public,
        environment={SECRET_CONTEXT_ENV: str(paths.secret), IDENTITY_DIR_ENV: str(identities)},
    )


def run_simulation_job(
    run_config: Mapping[str, Any],
    *,
    num_supernodes: int = 2,
    client_cpus: int = 1,
    environment: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run the job described by ``run_config`` and return its results.json content.

    Parameters
    ----------
    run_config : mapping
        Run-config keys (kebab-case, as in pyproject.toml); unknown keys or bad values raise
        :class:`fedparity.clients.project.config.ConfigError` before the simulation starts. Without
        ``output-dir`` the results go to a temporary folder (returned under ``output_dir``).
    num_supernodes : int
        Simulated nodes (partition-id 0..n-1).
    client_cpus : int
        CPUs per ClientApp (1 lets two run at once on two cores).
    environment : mapping, optional
        Environment variables for the run, e.g. ``{"FEDPARITY_SECRET_CONTEXT": path,
        "FEDPARITY_IDENTITY_DIR": folder}`` (:func:`fedevalfair_simulation_keys`).
    """
    from flwr.simulation import run_simulation

    # The one place the server side builds the ClientApp: a simulation runs both apps, as
    # ``flwr run`` does from pyproject.toml. Loaded here, not with the module.
    from ..clients.app import build_client_app

    if num_supernodes < 1:
        raise ValueError(f"num_supernodes must be >= 1, got {num_supernodes}")
    overrides = dict(run_config)
    RunConfig.from_mapping(overrides)  # fail before any work (e.g. a resume without output-dir)
    if not overrides.get("output-dir"):
        overrides["output-dir"] = tempfile.mkdtemp(prefix="fedparity-")
    config = RunConfig.from_mapping(overrides)
    output_dir = Path(config.output_dir).expanduser().resolve()
    with _environment(environment or {}):
        run_simulation(
            server_app=build_server_app(overrides),
            client_app=build_client_app(overrides),
            num_supernodes=num_supernodes,
            backend_config={"client_resources": {"num_cpus": client_cpus, "num_gpus": 0.0}},
        )
    results_file = output_dir / "results.json"
    if not results_file.exists():
        raise RuntimeError(f"the run wrote no {results_file}; see the log above")
    results = json.loads(results_file.read_text())
    results["output_dir"] = str(output_dir)
    return results
