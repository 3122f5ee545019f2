"""A Flower app with its own model and data, audited and tested with fedparity."""
