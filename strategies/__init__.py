"""fedparity Flower strategies: thin adapters around mechanisms/."""
