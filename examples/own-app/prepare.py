"""Write what the example needs on this machine, then print the command that runs it.

* every simulated node's data: ``~/.fedparity/examples/own-app/data/node-<i>.npz``;
* the FedEvalFair keys: a CKKS key pair in ``~/.fedparity/keys`` (the server's public context
  and the holders' secret one), as ``fedparity keys`` writes it;
* an identity key per node and their roster in ``~/.fedparity/identity``, as
  ``fedparity identity --nodes N`` writes it.

Existing keys are kept. Run from this folder: ``python prepare.py [--nodes 4]``.
"""

from __future__ import annotations

import argparse

from ownapp.task import DEFAULT_DATA_DIR, write_population

from fedparity.mechanisms.crypto.ckks import DEFAULT_KEY_DIR
from fedparity.server.cli import main as fedparity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes (default 4)")
    nodes = parser.parse_args().nodes
    if nodes < 2:
        parser.error(f"--nodes must be an integer >= 2 (FedEvalFair needs 2 holders), got {nodes}")
    write_population(DEFAULT_DATA_DIR, nodes)
    print(f"data of {nodes} nodes: {DEFAULT_DATA_DIR}")
    if (DEFAULT_KEY_DIR / "public_context.tenseal").is_file():
        print(f"keys: kept those in {DEFAULT_KEY_DIR}")
    elif fedparity(["keys"]) != 0:  # the same as the command `fedparity keys`
        raise SystemExit("fedparity keys failed")
    if fedparity(["identity", "--nodes", str(nodes), "--overwrite"]) != 0:
        raise SystemExit("fedparity identity failed")
    print("now run:")
    print(
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 flwr run . --stream "
        f'--federation-config "num-supernodes={nodes} client-resources-num-cpus=1"'
    )


if __name__ == "__main__":
    main()
