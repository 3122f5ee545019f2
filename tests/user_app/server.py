"""The user's ServerApp: fedparity's LDP audit and FedEvalFair test on the user's model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from task import build_model, trained_arrays

from fedparity.clients.fpfl_task import get_flat_parameters, statistics_layout
from fedparity.mechanisms import mechanism_for_budget, nprr_for_budget
from fedparity.mechanisms.crypto.ckks import load_public_context
from fedparity.mechanisms.fpfl.mmdm import MMDMConfig
from fedparity.strategies import (
    FedEvalFairProtocol,
    FPFLProtocol,
    FPFLRunParameters,
    FPFLTraining,
    LdpGapAudit,
    SequentialLdpAudit,
)

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
    # The sequential audit: fresh users in batches until the gap is answered.
    sequential = SequentialLdpAudit(
        nprr_for_budget(epsilon, num_groups=2),
        budget=epsilon,
        batch_size=150,
        max_users=int(config["fpfl-population"]),
        target_width=0.3,
        audit_id="sequential",
        timeout=120,
        seed=0,
    ).start(grid, arrays, node_ids=node_ids)

    protocol = FedEvalFairProtocol(
        load_public_context(str(config["public-context"])), key_holders=2, timeout=120
    )
    test = protocol.start(grid, arrays, node_ids)

    # FPFL: train the user's model under the FNR-parity constraint with user-level DP.
    population = int(config["fpfl-population"])
    cohort, rounds, epsilon_fpfl = 300, 3, 2.0
    model = build_model()
    layout = statistics_layout(model, num_groups=2)
    # What every node checks against its own FPFLNodeSettings (client.py) at setup.
    parameters = FPFLRunParameters.for_training(
        population_size=population,
        cohort_size=cohort,
        rounds=rounds,
        clipping_bound=1.0,
        epsilon=epsilon_fpfl,
        constraint="fnr",
        num_groups=2,
        vector_size=layout.size,
        dropout_tolerance=0.25,
    )
    protocol = FPFLProtocol(grid, node_ids=node_ids, parameters=parameters, reply_timeout=120.0)
    training = FPFLTraining(
        layout, get_flat_parameters(model), mmdm=MMDMConfig(alpha=0.05), use_mmdm=True
    )
    # Durable: the release ledger is on disk before each round is sent, with checkpoints; the
    # same folder again resumes the training with every earlier release counted.
    output = Path(str(config["output-dir"]))
    trained = training.start(protocol, rounds, folder=output / "fpfl-training")

    results = {
        "ldp": {
            "nodes_replied": gap.nodes_replied,
            "rejected": len(gap.rejected),
            "difference": float(gap.estimate.differences[0]),
            "stderr": float(gap.estimate.difference_stderrs[0]),
        },
        "fpfl": {
            "rounds": [entry["round"] for entry in trained.history],
            "replied": [entry["replied"] for entry in trained.history],
            "lost": sum("lost" in entry for entry in trained.history),
            "weights_moved": float(abs(trained.weights - get_flat_parameters(model)).max()),
            "weights_finite": bool(np.isfinite(trained.weights).all()),
            # the accountant's epsilon over every round the release ledger counts
            "epsilon": trained.history[-1]["epsilon_spent"],
            "rounds_released": trained.history[-1]["rounds_released_total"],
            "noise_multiplier": parameters.noise_multiplier,
            "population": population,
        },
        "sequential": {
            **sequential.to_dict(),
            "summary": sequential.summary(),
        },
        "fedevalfair": {
            "error": test.error,
            "participants": [list(p) for p in test.round_participants],
            "rejected": [item.reason for _, item in test.rejected],
            "blocks": [block.to_dict() for block in test.blocks],
        },
    }
    output.mkdir(parents=True, exist_ok=True)
    (output / "results.json").write_text(json.dumps(results, indent=2))
    print(f"USERAPP gap {results['ldp']['difference']:.4f} fedevalfair error {test.error}")
