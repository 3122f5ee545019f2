"""An active server: honest where the run needs it, hostile in between; writes what each
node answered to ``<output-dir>/attacks.json``.

The run config's ``seed`` picks the attack (the real ClientApp accepts only fedparity's keys):

* ``seed = 1`` (or any other) -- the key table: an invented peer, a substituted key, a replayed
  round and a key change after pinning (security review of 2026-11-24, H2/H3);
* ``seed = 2`` -- a split view on the run parameters: the first node is told the true
  population size ``K``, the others ``K = 10^7`` (review of 2026-11-26, C1);
* ``seed = 3`` -- split views of the survivors: node a is told "b survived, c dropped", node b
  "c survived, a dropped", node c "nobody dropped" (review of 2026-11-26, H1).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedparity.clients.fpfl_task import build_model_for, get_flat_parameters, statistics_layout
from fedparity.clients.project.config import RunConfig
from fedparity.mechanisms.crypto.identity import IdentityKey
from fedparity.mechanisms.crypto.secure_sum import MaskingKeyPair, masking_key_transcript
from fedparity.mechanisms.protocol import (
    FPFL_CONFIRM_MESSAGE_TYPE,
    FPFL_KEY,
    FPFL_KEYS_MESSAGE_TYPE,
    FPFL_REVEAL_MESSAGE_TYPE,
    FPFL_ROUND_MESSAGE_TYPE,
    FPFL_SETUP_MESSAGE_TYPE,
)
from fedparity.mechanisms.protocol.fpfl import (
    WEIGHTS_ARRAY,
    FPFLConfirmReply,
    FPFLConfirmRequest,
    FPFLKeyTable,
    FPFLRevealRequest,
    FPFLRoundReply,
    FPFLRoundRequest,
    FPFLRunParameters,
    FPFLSetupReply,
    FPFLSetupRequest,
)
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
    answers: dict[int, Any] = {}
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


def _setup(
    grid: Grid, salt: bytes, views: dict[int, FPFLRunParameters], timeout: float
) -> dict[int, FPFLSetupReply]:
    answers = _exchange(
        grid,
        FPFL_SETUP_MESSAGE_TYPE,
        {node: FPFLSetupRequest(salt, view).to_fields() for node, view in views.items()},
        timeout,
    )
    return {node: FPFLSetupReply.from_fields(answer) for node, answer in answers.items()}


def _table(
    salt: bytes,
    parameters: FPFLRunParameters,
    members: list[int],
    replies: dict[int, Any],
    protocol: FPFLProtocol,
) -> FPFLKeyTable:
    codec = protocol._codec(len(members))  # noqa: SLF001 - the server's own derivation
    return FPFLKeyTable(
        run_salt=salt,
        parameters_digest=parameters.digest(),
        members=tuple(members),
        public_keys=tuple(replies[n]["public-key"] for n in members),
        identity_keys=tuple(replies[n]["identity-key"] for n in members),
        signatures=tuple(replies[n]["signature"] for n in members),
        codec_clip_range=codec.clip_range,
        codec_scale=codec.scale,
    )


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = RunConfig.from_mapping(context.run_config)
    node_ids, nodes = connect_nodes(grid, config, minimum=config.min_nodes)
    timeout = config.reply_timeout
    model = build_model_for(
        config.fpfl_architecture, nodes.sample_shape, num_classes=nodes.num_classes, seed=0
    )
    honest = FPFLRunParameters.for_training(
        population_size=nodes.num_users,
        cohort_size=config.fpfl_cohort_size,
        rounds=config.fpfl_rounds,
        clipping_bound=config.fpfl_clipping_bound,
        epsilon=config.fpfl_epsilon,
        delta=config.fpfl_delta,
        constraint=config.fpfl_constraint,
        num_groups=nodes.num_groups,  # type: ignore[arg-type]
        vector_size=statistics_layout(model, nodes.num_groups).size,  # type: ignore[arg-type]
        dropout_tolerance=config.fpfl_dropout_tolerance,
    )
    protocol = FPFLProtocol(grid, node_ids=node_ids, parameters=honest, reply_timeout=timeout)
    salt = secrets.token_bytes(16)
    attack = {2: _split_parameters, 3: _split_survivors}.get(config.seed, _keys)
    report = attack(grid, protocol, salt, honest, node_ids, get_flat_parameters(model), timeout)
    folder = Path(config.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "attacks.json").write_text(json.dumps(report, indent=2), encoding="utf-8")


def _keys(
    grid: Grid,
    protocol: FPFLProtocol,
    salt: bytes,
    honest: FPFLRunParameters,
    node_ids: list[int],
    weights: Any,
    timeout: float,
) -> dict[str, Any]:
    setup = _setup(grid, salt, dict.fromkeys(node_ids, honest), timeout)
    replies = {n: setup[n].to_fields() for n in node_ids}
    digest = honest.digest()
    report: dict[str, Any] = {}
    # 1. A node missing from the roster: a peer the server invents, signed by its own key.
    server_identity, fake = IdentityKey.generate(), MaskingKeyPair.generate()
    invented = max(node_ids) + 1
    forged = {
        "public-key": fake.public_bytes(),
        "identity-key": server_identity.public_bytes(),
        "signature": server_identity.sign(
            masking_key_transcript(salt, invented, fake.public_bytes(), digest)
        ),
    }
    with_fake = _table(salt, honest, [*node_ids, invented], {**replies, invented: forged}, protocol)
    report["node missing from the roster"] = _outcome(
        _exchange(
            grid, FPFL_KEYS_MESSAGE_TYPE, dict.fromkeys(node_ids, with_fake.to_fields()), timeout
        )
    )
    # 2. A substituted key: the server's own masking key in place of the first node's.
    target = node_ids[0]
    forged_target = {
        **forged,
        "signature": server_identity.sign(
            masking_key_transcript(salt, target, fake.public_bytes(), digest)
        ),
    }
    substituted = _table(salt, honest, node_ids, {**replies, target: forged_target}, protocol)
    others = [n for n in node_ids if n != target]
    report["substituted key"] = _outcome(
        _exchange(
            grid, FPFL_KEYS_MESSAGE_TYPE, dict.fromkeys(others, substituted.to_fields()), timeout
        )
    )
    # 3. The honest table (pinned), then one honest round.
    table = _table(salt, honest, node_ids, replies, protocol)
    report["honest key table"] = _outcome(
        _exchange(grid, FPFL_KEYS_MESSAGE_TYPE, dict.fromkeys(node_ids, table.to_fields()), timeout)
    )
    protocol.run_salt, protocol.table = salt, table
    outcome = protocol.run_round(1, weights)
    report["honest round"] = {
        "total": "recovered" if outcome.total is not None else f"lost: {outcome.reason}"
    }
    # 4. The same round again (a replay).
    replay = protocol.run_round(1, weights)
    report["replayed round"] = {str(node): reason for node, reason in replay.rejected}
    # 5. A key change after pinning.
    report["key change after pinning"] = _outcome(
        _exchange(
            grid, FPFL_KEYS_MESSAGE_TYPE, dict.fromkeys(others, substituted.to_fields()), timeout
        )
    )
    return report


def _split_parameters(
    grid: Grid,
    protocol: FPFLProtocol,
    salt: bytes,
    honest: FPFLRunParameters,
    node_ids: list[int],
    weights: Any,
    timeout: float,
) -> dict[str, Any]:
    target, others = node_ids[0], node_ids[1:]
    inflated = FPFLRunParameters.for_training(
        **{
            key: getattr(honest, key)
            for key in (
                "cohort_size",
                "rounds",
                "clipping_bound",
                "epsilon",
                "constraint",
                "num_groups",
                "vector_size",
                "dropout_tolerance",
            )
        },
        population_size=10**7,
    )
    views = {target: honest, **dict.fromkeys(others, inflated)}
    setup = _setup(grid, salt, views, timeout)
    report: dict[str, Any] = {
        "setup": {str(n): "accepted" for n in setup},
        "sigma": {"true": honest.noise_multiplier, "inflated": inflated.noise_multiplier},
    }
    replies = {n: setup[n].to_fields() for n in node_ids}
    # Each node gets the table of its own view (a node refuses a table for other parameters),
    # with every node's key and signature as they came.
    contents = {}
    for node, view in views.items():
        inflated_protocol = FPFLProtocol(
            grid, node_ids=node_ids, parameters=view, reply_timeout=timeout
        )
        contents[node] = _table(salt, view, node_ids, replies, inflated_protocol).to_fields()
    report["split key tables"] = _outcome(
        _exchange(grid, FPFL_KEYS_MESSAGE_TYPE, contents, timeout)
    )
    return report


def _split_survivors(
    grid: Grid,
    protocol: FPFLProtocol,
    salt: bytes,
    honest: FPFLRunParameters,
    node_ids: list[int],
    weights: Any,
    timeout: float,
) -> dict[str, Any]:
    protocol.run_salt = salt
    protocol.setup()
    report: dict[str, Any] = {"setup failed": [list(map(str, f)) for f in protocol.setup_failed]}
    a, b, c = node_ids
    # One honest round's masked replies, kept by the server (not unmasked).
    request = FPFLRoundRequest(1, protocol.run_digest, weights)
    messages = [
        Message(
            RecordDict(
                {
                    FPFL_KEY: ArrayRecord({WEIGHTS_ARRAY: Array(request.weights)}),
                    "config": ConfigRecord(request.to_fields()),
                }
            ),
            dst_node_id=node,
            message_type=FPFL_ROUND_MESSAGE_TYPE,
        )
        for node in node_ids
    ]
    sealed: dict[int, dict[int, bytes]] = {}
    thresholds: dict[int, int] = {}
    for reply in send_and_receive(grid, messages, timeout):
        node = int(reply.metadata.src_node_id)
        answer = FPFLRoundReply.from_fields(
            reply.content.config_records["shares"],
            {"masked": reply.content.array_records[FPFL_KEY]["masked"].numpy()},
            masked=True,
            vector_size=honest.vector_size,
        )
        sealed[node] = dict(zip(answer.recipients, answer.sealed, strict=True))
        thresholds[node] = answer.threshold
    report["thresholds"] = {str(n): t for n, t in thresholds.items()}
    view_a = ([a, b], [c])  # a is told: b survived, c dropped
    view_b = ([b, c], [a])  # b is told: c survived, a dropped
    attestations: dict[int, dict[int, bytes]] = {}
    report["attest a's view"] = {}
    report["attest b's view"] = {}
    for label, view, asked in (
        ("attest a's view", view_a, [a, b]),
        ("attest b's view", view_b, [b, c]),
    ):
        request = FPFLConfirmRequest(1, tuple(view[0]), tuple(view[1]))
        answers = _exchange(
            grid, FPFL_CONFIRM_MESSAGE_TYPE, dict.fromkeys(asked, request.to_fields()), timeout
        )
        report[label] = _outcome(answers)
        for node, answer in answers.items():
            if not isinstance(answer, str):
                reply = FPFLConfirmReply.from_fields(answer)
                attestations.setdefault(node, {}).update(
                    {
                        (label, r): m
                        for r, m in zip(reply.recipients, reply.attestations, strict=True)
                    }  # type: ignore[misc]
                )
    reveals = {}
    for node, view, label in (
        (a, view_a, "attest a's view"),
        (b, view_b, "attest b's view"),
        (c, (node_ids, []), ""),
    ):
        survivors, dropped = view
        senders = tuple(p for p in survivors if p != node)
        attesters = tuple(
            p for p in sorted(attestations) if p != node and (label, node) in attestations[p]
        )
        reveals[node] = FPFLRevealRequest(
            round=1,
            survivors=tuple(survivors),
            dropped=tuple(dropped),
            share_senders=senders,
            shares=tuple(sealed[p][node] for p in senders),
            attesters=attesters,
            attestations=tuple(attestations[p][(label, node)] for p in attesters),  # type: ignore[index]
        ).to_fields()
    answers = _exchange(grid, FPFL_REVEAL_MESSAGE_TYPE, reveals, timeout)
    report["reveal"] = _outcome(answers)
    # What the server holds of a's self-mask: the shares of a's seed it was given.
    shares_of_a = sum(
        1
        for answer in answers.values()
        if not isinstance(answer, str) and a in list(answer["share-owners"])
    )
    seeds_of_a = sorted(
        f"{node}-{peer}"
        for node, answer in answers.items()
        if not isinstance(answer, str)
        for peer in answer["dropped"]
        if a in (node, peer)
    )
    report["what the server holds of a"] = {
        "shares": shares_of_a,
        "threshold": thresholds[a],
        "pair seeds": seeds_of_a,
    }
    return report
