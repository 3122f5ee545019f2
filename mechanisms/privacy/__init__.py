"""Privacy accounting: what a release costs and what each user has spent.

* :mod:`.basic_ledger`: basic composition per shard (``PrivacyLedger``, ``ShardLedger``) and
  the ledger files' markers;
* :mod:`.user_ledger`: the per-user ledger over heterogeneous releases (``UserLedger``,
  ``compose``), composed with the privacy-loss-distribution accountant of Google's
  ``dp-accounting`` beside basic composition;
* :mod:`.opacus_accounting`: the FPFL run's epsilon and noise calibration through Opacus's RDP
  accountant (it was ``fedparity.mechanisms.dp_accounting``, a name that belongs to Google's
  package, which this module does not use).

Import the names from :mod:`fedparity.mechanisms` (the public surface) or from the module
that defines them; this package ``__init__`` imports none of its modules (no import cycle, see
``tests/test_layers.py``).
"""
