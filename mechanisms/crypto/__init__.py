"""Cryptography: the FPFL secure sum, FedEvalFair's CKKS layer, node identities, noise bits.

* :mod:`.secure_sum`: the double-masking secure sum of FPFL (Bonawitz et al. 2017);
* :mod:`.ckks`: FedEvalFair's CKKS encryption layer (TenSEAL), with its threat model;
* :mod:`.identity`: node signing keys, rosters and transcripts;
* :mod:`.secure_random`: the AES-CTR bit generator for privacy noise.

This package ``__init__`` imports none of its modules (no import cycle, see
``tests/test_layers.py``).
"""
