"""Send one query to every node; write ``{node id: "answered: ..." | "refused: <reason>"}`` to
``<output-dir>/replies.json``."""

import json
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    deadline = time.monotonic() + 60
    nodes = list(grid.get_node_ids())
    while len(nodes) < int(config["min-nodes"]) and time.monotonic() < deadline:
        time.sleep(0.5)
        nodes = list(grid.get_node_ids())
    messages = [
        Message(
            RecordDict({"gate": ConfigRecord({"ask": "ran"})}),
            dst_node_id=node,
            message_type="query",
        )
        for node in nodes
    ]
    replies = {}
    for reply in grid.send_and_receive(messages, timeout=float(config["reply-timeout"])):
        node = str(reply.metadata.src_node_id)
        if reply.has_error():
            replies[node] = f"refused: {reply.error.reason}"
        else:
            replies[node] = f"answered: {reply.content.config_records['gate']['ran']}"
    out = Path(str(config["output-dir"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "replies.json").write_text(json.dumps(replies, indent=1), encoding="utf-8")
