"""ServerApp: wait for the nodes, send one ``query`` to each, report the replies."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import cast

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Query every node once and print/write ``(partition-id, greeting)`` per reply."""
    cfg = context.run_config
    print(f"LAB cwd={os.getcwd()}", flush=True)
    print(f"LAB serverapp-file={__file__}", flush=True)
    if bool(cfg["fail"]):
        raise RuntimeError("LAB deliberate ServerApp failure")

    expected = int(cfg["expected-nodes"])
    deadline = time.monotonic() + float(cfg["node-wait-timeout"])
    while len(list(grid.get_node_ids())) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    node_ids = sorted(grid.get_node_ids())
    print(f"LAB nodes={len(node_ids)}", flush=True)

    greeting = str(cfg["greeting"])
    messages = [
        Message(
            RecordDict({"cfg": ConfigRecord({"greeting": greeting})}),
            dst_node_id=node_id,
            message_type="query",
        )
        for node_id in node_ids
    ]
    replies = list(grid.send_and_receive(messages, timeout=float(cfg["reply-timeout"])))

    results: list[dict[str, object]] = []
    for reply in replies:
        if reply.has_error():
            print(f"LAB reply-error {reply.error}", flush=True)
            continue
        metrics = reply.content["metrics"]
        echo = reply.content["echo"]
        results.append(
            {
                "partition-id": int(cast(int, metrics["partition-id"])),
                "num-partitions": int(cast(int, metrics["num-partitions"])),
                "pid": int(cast(int, metrics["pid"])),
                "greeting": str(echo["greeting"]),
            }
        )
    results.sort(key=lambda r: int(str(r["partition-id"])))
    for r in results:
        print(
            f"LAB reply partition-id={r['partition-id']} "
            f"num-partitions={r['num-partitions']} greeting={r['greeting']}",
            flush=True,
        )

    if str(cfg["output-dir"]):
        out_dir = Path(str(cfg["output-dir"]))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "replies.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
        print(f"LAB wrote {(out_dir / 'replies.json').resolve()}", flush=True)
