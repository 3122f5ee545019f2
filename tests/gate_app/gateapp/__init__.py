"""An app for the app-gate tests (tests/test_app_gate.py)."""
