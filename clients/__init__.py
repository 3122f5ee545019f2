"""Client side of fedparity: user populations (``data``) and the model task (``task``)."""
