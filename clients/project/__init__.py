"""The project app's own task: what fedparity's ClientApp (:mod:`fedparity.clients.app`) and
ServerApp jobs read from the run config.

* :mod:`~fedparity.clients.project.config` -- the run config (``RunConfig``, every key checked);
* :mod:`~fedparity.clients.project.data` -- the embedded populations (synthetic, UCI Adult);
* :mod:`~fedparity.clients.project.fpfl_data` -- FPFL's populations (Adult, unfair digits);
* :mod:`~fedparity.clients.project.fpfl_node` -- FPFL node settings and shards from the config;
* :mod:`~fedparity.clients.project.own_data` -- a node's own data file;
* :mod:`~fedparity.clients.project.task` -- the FedAvg logistic model, its training and metrics;
* :mod:`~fedparity.clients.project.evaluation` -- a partition's users, the received model and a
  FedEvalFair holder's statistics, shared by the ClientApp and the simulation harness.

The library (the rest of :mod:`fedparity.clients`) never imports this package: a user's own
ClientApp is built from the library's handlers without the project's run config or data.
"""
