"""The approved ClientApp: answers a query with the name of its app."""

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

#: What this ClientApp answers (a modified bundle answers something else).
ANSWER = "gateapp 1.0.0"

app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"gate": ConfigRecord({"ran": ANSWER})}), reply_to=msg)
