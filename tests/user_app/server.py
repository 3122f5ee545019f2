"""The user's ServerApp: fedparity's LDP audit and FedEvalFair test on the user's model."""

from __future__ import annotations

import json
import time
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from task import trained_arrays

from fedparity.mechanisms import mechanism_for_budget
from fedparity.mechanisms.ckks import load_public_context
from fedparity.strategies import FedEvalFairProtocol, LdpGapAudit

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    expected = int(config["num-nodes"])
    deadline = time.monotonic() + 60
    while len(list(grid.get_node_ids())) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    node_ids = sorted(grid.get_node_ids())
    arrays = trained_arrays()

    epsilon = float(config["audit-epsilon"])
    audit = LdpGapAudit(mechanism_for_budget("R", epsilon), budget=epsilon, metric="accuracy")
    gap = audit.start(grid, arrays, timeout=120)

    protocol = FedEvalFairProtocol(
        load_public_context(str(config["public-context"])), key_holders=2, timeout=120
    )
    test = protocol.start(grid, arrays, node_ids)

    results = {
        "ldp": {
            "nodes_replied": gap.nodes_replied,
            "rejected": len(gap.rejected),
            "difference": float(gap.estimate.differences[0]),
            "stderr": float(gap.estimate.difference_stderrs[0]),
        },
        "fedevalfair": {
            "error": test.error,
            "participants": [list(p) for p in test.round_participants],
            "blocks": [block.to_dict() for block in test.blocks],
        },
    }
    output = Path(str(config["output-dir"]))
    output.mkdir(parents=True, exist_ok=True)
    (output / "results.json").write_text(json.dumps(results, indent=2))
    print(f"USERAPP gap {results['ldp']['difference']:.4f} fedevalfair error {test.error}")
