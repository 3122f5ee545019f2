"""FPFL: fairness-constrained training with user-level DP.

* :mod:`.mmdm`: the sufficient statistics, constraints, the modified method of differential
  multipliers update and model selection (FPFL Eq. 9-11 and 17);
* :mod:`.fedfb`: FedFB's group reweighting, another update rule on the same released sums;
* :mod:`.fairfed`: FairFed's node weights, from each node's own noisy release beside the sum;
* :mod:`.training_state`: what a training keeps on disk, the durable release ledger and
  the checkpoint.

Import the names from :mod:`fedparity.mechanisms` (the public surface) or from the module
that defines them; this package ``__init__`` imports none of its modules (no import cycle, see
``tests/test_layers.py``).
"""
