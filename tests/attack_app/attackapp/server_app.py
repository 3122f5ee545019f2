"""An active server: honest where the run needs it, hostile in between; writes what each
node answered to ``<output-dir>/attacks.json``."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedparity.clients.config import RunConfig
from fedparity.clients.fpfl_task import build_model_for, get_flat_parameters, statistics_layout
from fedparity.mechanisms.dp_accounting import calibrate_noise
from fedparity.mechanisms.identity import IdentityKey
from fedparity.mechanisms.protocol import (
    FPFL_KEY,
    FPFL_KEYS_MESSAGE_TYPE,
    FPFL_SETUP_MESSAGE_TYPE,
)
from fedparity.mechanisms.secure_sum import MaskingKeyPair, masking_key_transcript
from fedparity.server.orchestration import connect_nodes
from fedparity.strategies.fpfl import FPFLProtocol
from fedparity.strategies.replies import send_and_receive

app = ServerApp()


def _exchange(grid: Grid, message_type: str, contents: dict[int, dict], timeout: float) -> dict:
    """Send each node its record; ``{node: reply record or "refused: <reason>"}``."""
    messages = [
        Message(
            RecordDict({FPFL_KEY: ConfigRecord(content)}),
            dst_node_id=node,
            message_type=message_type,
        )
        for node, content in contents.items()
    ]
    answers: dict[int, object] = {}
    for reply in send_and_receive(grid, messages, timeout):
        node = int(reply.metadata.src_node_id)
        if reply.has_error():
            answers[node] = f"refused: {reply.error.reason}"
        else:
            answers[node] = reply.content.config_records.get(FPFL_KEY)
    return answers


def _outcome(answers: dict) -> dict[str, str]:
    return {
        str(node): answer if isinstance(answer, str) else "accepted"
        for node, answer in answers.items()
    }


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = RunConfig.from_mapping(context.run_config)
    node_ids, nodes = connect_nodes(grid, config, minimum=config.min_nodes)
    timeout = config.reply_timeout
    salt = secrets.token_bytes(16)
    setup = _exchange(
        grid, FPFL_SETUP_MESSAGE_TYPE, {n: {"run-salt": salt} for n in node_ids}, timeout
    )
    keys = {n: bytes(setup[n]["public-key"]) for n in node_ids}
    identities = {n: bytes(setup[n]["identity-key"]) for n in node_ids}
    signatures = {n: bytes(setup[n]["signature"]) for n in node_ids}

    def table(ids: list[int], keys: dict, identities: dict, signatures: dict) -> dict:
        return {
            "run-salt": salt,
            "peer-ids": ids,
            "peer-keys": [keys[n] for n in ids],
            "identity-keys": [identities[n] for n in ids],
            "signatures": [signatures[n] for n in ids],
        }

    report: dict[str, dict[str, str]] = {}
    # 1. A node missing from the roster: a peer the server invents, signed by its own key.
    server_identity, fake = IdentityKey.generate(), MaskingKeyPair.generate()
    invented = max(node_ids) + 1
    with_fake = (
        {**keys, invented: fake.public_bytes()},
        {**identities, invented: server_identity.public_bytes()},
        {
            **signatures,
            invented: server_identity.sign(
                masking_key_transcript(salt, invented, fake.public_bytes())
            ),
        },
    )
    report["node missing from the roster"] = _outcome(
        _exchange(
            grid,
            FPFL_KEYS_MESSAGE_TYPE,
            {n: table([*node_ids, invented], *with_fake) for n in node_ids},
            timeout,
        )
    )
    # 2. A substituted key: the server's own masking key in place of the first node's.
    target = node_ids[0]
    substituted = (
        {**keys, target: fake.public_bytes()},
        {**identities, target: server_identity.public_bytes()},
        {
            **signatures,
            target: server_identity.sign(masking_key_transcript(salt, target, fake.public_bytes())),
        },
    )
    report["substituted key"] = _outcome(
        _exchange(
            grid,
            FPFL_KEYS_MESSAGE_TYPE,
            {n: table(node_ids, *substituted) for n in node_ids if n != target},
            timeout,
        )
    )
    # 3. The honest table (pinned), then one honest round.
    report["honest key table"] = _outcome(
        _exchange(
            grid,
            FPFL_KEYS_MESSAGE_TYPE,
            {n: table(node_ids, keys, identities, signatures) for n in node_ids},
            timeout,
        )
    )
    model = build_model_for(
        config.fpfl_architecture,
        nodes.sample_shape,
        num_classes=nodes.num_classes,
        seed=config.seed,
    )
    population = nodes.num_users
    sigma = calibrate_noise(
        epsilon=config.fpfl_epsilon,
        delta=1.0 / population,
        cohort_size=config.fpfl_cohort_size,
        population_size=population,
        steps=config.fpfl_rounds,
    ).noise_multiplier
    protocol = FPFLProtocol(
        grid,
        node_ids=node_ids,
        vector_size=statistics_layout(model, nodes.num_groups).size,
        population_size=population,
        noise_multiplier=sigma,
        clipping_bound=config.fpfl_clipping_bound,
        masking=True,
        distributed_noise=True,
        dropout_tolerance=config.fpfl_dropout_tolerance,
        reply_timeout=timeout,
    )
    protocol.public_keys = keys
    weights = get_flat_parameters(model)
    honest = protocol.run_round(1, weights)
    report["honest round"] = {
        "total": "recovered" if honest.total is not None else f"lost: {honest.reason}"
    }
    # 4. The same round again (a replay).
    replay = protocol.run_round(1, weights)
    report["replayed round"] = {str(node): reason for node, reason in replay.rejected}
    # 5. A key change after pinning.
    report["key change after pinning"] = _outcome(
        _exchange(
            grid,
            FPFL_KEYS_MESSAGE_TYPE,
            {n: table(node_ids, *substituted) for n in node_ids if n != target},
            timeout,
        )
    )
    folder = Path(config.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "attacks.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
