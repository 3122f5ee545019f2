"""ClientApp: answer a ``query`` with the node's partition-id in a MetricRecord."""

from __future__ import annotations

import os

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Reply with ``partition-id``/``num-partitions`` and echo the greeting."""
    greeting = str(msg.content["cfg"]["greeting"])
    metrics = MetricRecord(
        {
            "partition-id": int(context.node_config["partition-id"]),
            "num-partitions": int(context.node_config["num-partitions"]),
            "pid": os.getpid(),
        }
    )
    print(f"LABCLIENT partition-id={context.node_config['partition-id']}", flush=True)
    return Message(
        RecordDict({"metrics": metrics, "echo": ConfigRecord({"greeting": greeting})}),
        reply_to=msg,
    )
