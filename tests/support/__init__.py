"""Support code of the tests (no tests here): real Flower processes
(:mod:`tests.support.flower_processes`), TLS material, FPFL nodes, the in-process FedEvalFair CKKS
protocol, import probes, and the pytest fixtures shared by the test files
(:mod:`tests.support.fixtures`, a plugin registered in ``tests/conftest.py``)."""
