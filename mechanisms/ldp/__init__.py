"""LDP: the local-differential-privacy mechanisms of the gap audit and their estimators.

Randomized response (:mod:`.randomized_response`), Laplace and discrete Laplace noise
(:mod:`.laplace`, :mod:`.discrete_laplace`), the Piecewise mechanism (:mod:`.piecewise`),
NPRR on a grid (:mod:`.nprr`), the budget split and true epsilon (:mod:`.calibration`),
unbiased gap estimates (:mod:`.estimators`), the planner (:mod:`.planner`), streaming
summaries (:mod:`.streaming`), report moments (:mod:`.reports`), the metric names
(:mod:`.metrics`), frequency oracles (:mod:`.frequency_oracle`), per-group rate metrics
(:mod:`.group_rates`), the joint report against the gap audit (:mod:`.rate_design`), the power
of the gap and fairness tests (:mod:`.power`) and the sequential audit with confidence
sequences (:mod:`.sequential`).

Import the names from :mod:`fedparity.mechanisms` (the public surface) or from the module
that defines them; this package ``__init__`` imports none of its modules (no import cycle, see
``tests/test_layers.py``).
"""
