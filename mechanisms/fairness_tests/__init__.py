"""Fairness tests: FedEvalFair's two-stage test (:mod:`.fedevalfair`) and the layout of its
runs (which metrics and groups one run tests, :mod:`.fedevalfair_layout`).

The module was ``fedparity.mechanisms.fairtest``. The room is ``fairness_tests`` and the module
is named after the paper it implements (FedEvalFair, ACM Multimedia 2024 submission), as its
protocol messages (:mod:`fedparity.mechanisms.protocol.fedevalfair`) and its node handlers
(``fedparity.clients.fedevalfair``) are. A package named ``fairtest`` would have taken the old
module's path, so that path could not have stayed a deprecation shim for the module: the old
``fedparity.mechanisms.fairtest`` still imports, warning, and forwards to the new module. A
second test would sit beside it as its own module.

Import the names from :mod:`fedparity.mechanisms` (the public surface) or from
:mod:`.fedevalfair`; this package ``__init__`` imports none of its modules (no import cycle,
see ``tests/test_layers.py``).
"""
