"""A ClientApp with faults, for tests: it wraps the real handlers of ``fedparity.clients.app``.

Partition 1 crashes in the audit (an error reply), partition 2 never answers the audit in
time (a missing reply), partition 3 sends NaN values, outside either mechanism's output domain (a
malformed reply); every other partition behaves. Training is never faulty.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict

from fedparity.clients import app as real
from fedparity.clients.project.config import RunConfig


def faulty_audit(msg: Message, context: Context, config: RunConfig) -> Message:
    partition = int(context.node_config["partition-id"])
    if partition == 1:
        raise RuntimeError("simulated crash during the audit")
    if partition == 2:
        time.sleep(config.reply_timeout + 10.0)
    if partition == 3:
        reports = ArrayRecord(
            {"groups": Array(np.zeros(5, dtype=np.int64)), "values": Array(np.full(5, np.nan))}
        )
        metrics = MetricRecord({"num-reports": 5})
        return Message(content=RecordDict({"reports": reports, "metrics": metrics}), reply_to=msg)
    return real.ldp_audit(msg, context, config)


app = real.build_client_app(handlers={"query.ldp_audit": faulty_audit})
