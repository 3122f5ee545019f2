"""fedparity server side: the ServerApp, run orchestration and the command line."""
