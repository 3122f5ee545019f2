"""fedparity.mechanisms: the math, usable alone (pure numpy/scipy; no Flower import).

LDP gap measurement (Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You Can't
Measure': Privately Measuring Demographic Performance Disparities in Federated Learning", AFCP
workshop, PMLR, 2022, and its Appendix A):

* :class:`RandomizedResponseMechanism` (M_R) and :class:`LaplaceMechanism` (M_L, k = 2),
  with their *true* epsilon (:func:`true_epsilon`; the paper's Theorem 5, and its Theorem 6
  for k != 2, are false), and :class:`PiecewiseMechanism` (M_P: the Piecewise mechanism of
  Wang et al., "Collecting and Analyzing Multidimensional Data with Local Differential
  Privacy", ICDE 2019, on the value) and :class:`NPRRMechanism` (M_N: NPRR of Waudby-Smith, Wu
  and Ramdas, "Nonparametric extensions of randomized response for private confidence sets",
  ICML 2023, on the value over a grid);
* :func:`mechanism_for_budget` / :func:`optimal_split`: the (eps1, eps2) split within a budget;
* :func:`estimate_gap`: unbiased group means, gaps, standard errors, intervals and bounds;
* :func:`summarize_stream`: mechanism + summary over chunks, in bounded memory;
* :mod:`fedparity.mechanisms.ldp.planner`: minimum budget for an error target, error at a budget,
  Table 1;
* :class:`PrivacyLedger` / :class:`ShardLedger`: per-user budgets over repeated audits.
* :func:`frequency_oracle` (GRR, optimal unary encoding, subset selection, or ``"best"`` by
  variance) and :func:`group_rates`: one joint (group, confusion cell) report per user, every
  rate metric per group in fairlearn's vocabulary (:class:`GroupRates`), with intervals.
* :class:`UserLedger` / :func:`compose`: per-user totals over heterogeneous releases (LDP
  reports, FPFL rounds, any (epsilon, delta) release), composed with a privacy-loss-distribution
  accountant (Google's dp-accounting) beside basic composition.

FedEvalFair two-stage fairness test ("FedEvalFair: A Privacy-Preserving and Statistically
Grounded Federated Fairness Evaluation Framework", anonymous authors, ACM Multimedia 2024
submission), with a calibrated default mode where the paper's test is miscalibrated (see
:mod:`fedparity.mechanisms.fairness_tests.fedevalfair`):

* :func:`bootstrap_disparity`: a client's B bootstrap disparities (any rate metric: dp, eo,
  fnr, fpr, tnr, accuracy, precision, npv; any two of d groups) and its
  :class:`ClientSummary` in mode "paper" or "calibrated"; :class:`FedEvalFairLayout`: which
  metrics and groups one run tests (:func:`reference_comparisons`: each group against a
  reference);
* :func:`fedevalfair`: stage 1 (T1 or Cochran's Q), stage 2 (W*) and TOST in a
  :class:`FairnessReport`; :func:`client_contribution`, :func:`stage1_term`,
  :func:`stage1_statistic` and :func:`report_from_sums` are the same computation as sums over
  clients (encrypted protocol); :func:`stage_statistics` vectorises it for simulations;
  :func:`disparity_variance` gives the calibrated weights from a holder's margins; a
  calibrated report also holds the :class:`PooledDisparity` of all holders' rows and, from
  :func:`random_effects_release`, the :class:`RandomEffects` summary (tau^2 and its Q-profile
  interval, the random-effects mean) to read after stage 1 rejects.

FPFL: fairness-constrained training with user-level DP (Borja Rodriguez-Galvez, Filip
Granqvist, Rogier van Dalen and Matt Seigel, "Enforcing fairness in private federated learning
via the modified method of differential multipliers", NeurIPS 2021 Workshop on Privacy in
Machine Learning, arXiv:2109.08604, 2021):

* :class:`StatisticsLayout` / :class:`AggregateStatistics`: the sufficient-statistic vector
  (FPFL Eq. 17) and its cohort sum; :func:`evaluate_constraints`, :func:`mmdm_update`
  (FPFL Eq. 9-11), :func:`sgd_update`, :func:`fedfb_update` (FedFB's group reweighting on the
  same sums: Zeng, Chen and Lee, "Improving Fairness via Federated Learning", 2021),
  :func:`fairfed_step` / :func:`node_scales` / :func:`release_noise_multipliers` (FairFed's
  node weights from per-node releases under the same epsilon: Ezzeldin et al., "FairFed:
  Enabling Group Fairness in Federated Learning", AAAI 2023);
  :func:`privatize_sum` (Gaussian noise on a clipped sum);
* :func:`cohort_metrics` / :class:`ModelSelector`: model selection on cohort statistics;
* :func:`fairness_gaps`: accuracy and FNR / EO / DemP / PP gaps of hard predictions.

Argument checks (:mod:`fedparity.mechanisms.validation`, the package's one validation module):

* :func:`check_int`: the one integer rule (an ``int``, a numpy integer or an integral float
  such as ``3.0``; never a ``bool``, ``3.5``, NaN or a string), with an error naming the
  parameter and the allowed range;
* :func:`parse_int`: the same rule for text (a TOML value, an environment variable, a command
  line option: ``"3"``, ``" 3 "``, ``"1e6"``).
"""

import lazy_loader as _lazy

# The names below load on first use (lazy_loader; the stub next to this file lists them for
# type checkers). Importing one submodule never runs the others, so two threads that import
# different submodules at once cannot deadlock on the import locks: Flower's simulation loads
# the ServerApp and the ClientApp in two threads.
__getattr__, __dir__, __all__ = _lazy.attach_stub(__name__, __file__)
