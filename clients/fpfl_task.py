"""FPFL client-side math in torch: models, surrogates and per-user statistic vectors.

FPFL: Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt Seigel, "Enforcing
fairness in private federated learning via the modified method of differential multipliers",
NeurIPS 2021 Workshop on Privacy in Machine Learning, arXiv:2109.08604, 2021
(Rodriguez-Galvez et al. 2021; section, equation and algorithm numbers below are the paper's).

What a client computes per round (Algorithm 1, ``UserStatistics``): for every user
``k`` of its cohort, the vector of Eq. (17) plus the model-selection counts, in the layout of
:class:`fedparity.mechanisms.fpfl.mmdm.StatisticsLayout`::

    [ grad L(d^k) | F(d'^k_a) | grad F(d'^k_a) | n'^k_a | n^k | errors^k | e^k_a | L(d^k) ]

clipped to L2 norm ``C``. :func:`shard_contribution` returns the sum over the cohort users
a node hosts; the strategy sums the nodes' contributions (secure aggregation), adds
``N(0, C^2 sigma^2)`` noise and applies :func:`fedparity.mechanisms.fpfl.mmdm.mmdm_update`.

Models (Section 4.1-4.2): :func:`build_fpfl_model` (``"shallow"``: one hidden layer of 10 ReLU
units; ``"deep"``: 16-8-8 ReLU) and :func:`build_cnn` (32/64 filters + FC 100), all ending in
``nn.Sigmoid`` (binary, one output) or ``nn.Softmax(dim=-1)`` (multi-class).

Surrogates (Eq. 13-14) with ``psi`` the model output:

* ``"fnr"`` (FNR parity, binary): ``d'`` = samples with ``y = 1``, ``f = 1 - psi(x)``
  (``psi`` = probability of class 1);
* ``"accuracy"`` (accuracy parity): ``d' = d``, ``f = psi(x)^T onehot(y)``.

Output check (decision): the surrogate needs probabilities, so the model must be an
``nn.Sequential`` whose *last module* is ``nn.Sigmoid`` or ``nn.Softmax`` over the last
dimension; anything else raises ``ValueError`` naming ``model``. The last module is used
instead of an output-range check because a range check on some inputs cannot prove the
output is a probability for others. The loss is computed from the logits before that module
(binary cross-entropy / cross-entropy with logits), which is exact and numerically stable.

Per-user vectors are computed for all users at once (:func:`user_statistics`): every sample's
gradients of its loss and surrogate terms (``torch.func`` ``vmap`` over samples of ``jacrev``),
summed per user and group; :func:`user_statistics_loop` is the per-user Python-loop reference
used only by tests and benchmarks.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn
from torch.func import functional_call, jacrev, vmap

from ..mechanisms.fpfl.mmdm import CONSTRAINTS, Constraint, StatisticsLayout
from ..mechanisms.validation import check_int_at_least
from .fpfl_data import FPFLShard

ModuleT = TypeVar("ModuleT", bound=nn.Module)

__all__ = [
    "ARCHITECTURES",
    "CONSTRAINTS",
    "ClippedStatistics",
    "ShardContribution",
    "build_cnn",
    "build_fpfl_model",
    "build_mlp",
    "build_model_for",
    "clip_statistics",
    "constraint_mask",
    "get_flat_parameters",
    "init_uniform",
    "logit_model",
    "num_parameters",
    "output_activation",
    "pooled_statistics",
    "predict",
    "set_flat_parameters",
    "shard_contribution",
    "statistics_layout",
    "unflatten_parameters",
    "uninitialized",
    "user_statistics",
    "user_statistics_loop",
]

Architecture = Literal["shallow", "deep"]
#: Hidden layer widths of the paper's fully connected networks (Section 4.1).
ARCHITECTURES: dict[str, tuple[int, ...]] = {"shallow": (10,), "deep": (16, 8, 8)}
Activation = Literal["sigmoid", "softmax"]


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def uninitialized(module_cls: type[ModuleT], *args: Any, **kwargs: Any) -> ModuleT:
    """``module_cls(*args, **kwargs)`` with its parameters allocated on the CPU but not
    initialised, like :func:`torch.nn.utils.skip_init`, for modules whose state is their own
    parameters (``Linear``, ``Conv2d``).

    ``skip_init`` moves the module off the meta device with ``Module.to_empty``, whose first call
    in a process imports SymPy (about 0.6 CPU-s, measured 2026-11-28 in a Ray actor); this gives
    the meta module new empty CPU parameters instead.
    """
    module = module_cls(*args, device="meta", **kwargs)
    if any(True for _ in module.children()) or any(True for _ in module.buffers()):
        raise ValueError(f"{module_cls.__name__} has submodules or buffers; use skip_init")
    for name, parameter in list(module.named_parameters()):
        setattr(
            module,
            name,
            nn.Parameter(
                torch.empty(parameter.shape, dtype=parameter.dtype),
                requires_grad=parameter.requires_grad,
            ),
        )
    return module


def init_uniform(layers: Sequence[nn.Module], seed: int) -> None:
    """PyTorch's default ``Linear``/``Conv2d`` init, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``,
    from a seeded ``torch.Generator`` (the global RNG is neither used nor touched)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in layers:
            if isinstance(layer, (nn.Linear, nn.Conv2d)):
                fan_in = layer.weight[0].numel()
                bound = 1.0 / math.sqrt(fan_in)
                nn.init.uniform_(layer.weight, -bound, bound, generator=generator)
                if layer.bias is not None:
                    nn.init.uniform_(layer.bias, -bound, bound, generator=generator)


def _output_layers(width: int, num_classes: int) -> list[nn.Module]:
    if num_classes == 2:
        return [uninitialized(nn.Linear, width, 1), nn.Sigmoid()]
    return [uninitialized(nn.Linear, width, num_classes), nn.Softmax(dim=-1)]


def build_mlp(
    num_features: int, hidden: Sequence[int], *, num_classes: int = 2, seed: int = 0
) -> nn.Sequential:
    """A fully connected ReLU network ending in ``Sigmoid`` (one output, ``num_classes = 2``)
    or ``Softmax(dim=-1)`` (``num_classes > 2`` outputs)."""
    num_features = check_int_at_least("num_features", num_features, 1)
    num_classes = check_int_at_least("num_classes", num_classes, 2)
    seed = check_int_at_least("seed", seed, 0)
    widths = [check_int_at_least("hidden", width, 1) for width in hidden]
    layers: list[nn.Module] = []
    previous = num_features
    for width in widths:
        layers += [uninitialized(nn.Linear, previous, width), nn.ReLU()]
        previous = width
    layers += _output_layers(previous, num_classes)
    init_uniform(layers, seed)
    return nn.Sequential(*layers)


def build_fpfl_model(
    architecture: Architecture, num_features: int, *, num_classes: int = 2, seed: int = 0
) -> nn.Sequential:
    """The paper's ``"shallow"`` (10) or ``"deep"`` (16-8-8) ReLU network (Section 4.1)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"architecture must be one of {', '.join(map(repr, ARCHITECTURES))}; "
            f"got {architecture!r}"
        )
    return build_mlp(num_features, ARCHITECTURES[architecture], num_classes=num_classes, seed=seed)


def build_cnn(
    *, in_channels: int, image_size: int, num_classes: int = 10, seed: int = 0
) -> nn.Sequential:
    """The paper's convolutional network (Section 4.2): two 5x5 convolutions with stride 2
    (32 and 64 filters, ReLU), a fully connected layer of 100 ReLU units and a softmax output.

    Padding 2 keeps small images usable: a 28-px image becomes 14 then 7 px, an 8-px one 4
    then 2 px.
    """
    in_channels = check_int_at_least("in_channels", in_channels, 1)
    image_size = check_int_at_least("image_size", image_size, 4)
    num_classes = check_int_at_least("num_classes", num_classes, 2)
    seed = check_int_at_least("seed", seed, 0)
    side = (image_size + 4 - 5) // 2 + 1
    side = (side + 4 - 5) // 2 + 1
    layers: list[nn.Module] = [
        uninitialized(nn.Conv2d, in_channels, 32, 5, stride=2, padding=2),
        nn.ReLU(),
        uninitialized(nn.Conv2d, 32, 64, 5, stride=2, padding=2),
        nn.ReLU(),
        nn.Flatten(start_dim=-3),
        uninitialized(nn.Linear, 64 * side * side, 100),
        nn.ReLU(),
        *_output_layers(100, num_classes),
    ]
    init_uniform(layers, seed)
    return nn.Sequential(*layers)


def build_model_for(
    architecture: str, feature_shape: Sequence[int], *, num_classes: int, seed: int = 0
) -> nn.Sequential:
    """The network ``architecture`` (``"shallow"``, ``"deep"`` or ``"cnn"``) for samples of
    shape ``feature_shape`` (``(features,)`` or ``(channels, side, side)``)."""
    shape = tuple(int(size) for size in feature_shape)
    if architecture == "cnn":
        if len(shape) != 3 or shape[1] != shape[2]:
            raise ValueError(
                f"architecture 'cnn' needs samples of shape (channels, side, side), got {shape}"
            )
        return build_cnn(
            in_channels=shape[0], image_size=shape[1], num_classes=num_classes, seed=seed
        )
    if len(shape) != 1:
        raise ValueError(
            f"architecture {architecture!r} needs feature vectors (features,), got {shape}; "
            "use architecture 'cnn' for images"
        )
    return build_fpfl_model(
        architecture,  # type: ignore[arg-type]
        shape[0],
        num_classes=num_classes,
        seed=seed,
    )


def output_activation(model: nn.Module) -> Activation:
    """``"sigmoid"`` or ``"softmax"``: the model's last module, which the surrogates need.

    Raises ``ValueError`` naming ``model`` unless ``model`` is an ``nn.Sequential`` whose last
    module is ``nn.Sigmoid`` or ``nn.Softmax`` with ``dim`` -1 (see the module docstring).
    """
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise ValueError(
            "model must be an nn.Sequential ending in nn.Sigmoid (binary) or "
            f"nn.Softmax(dim=-1) (multi-class); got {type(model).__name__}"
        )
    last = model[-1]
    if isinstance(last, nn.Sigmoid):
        return "sigmoid"
    if isinstance(last, nn.Softmax) and last.dim == -1:
        return "softmax"
    raise ValueError(
        "model must end in nn.Sigmoid (binary) or nn.Softmax(dim=-1) (multi-class): the "
        f"fairness surrogates need probabilities, but its last module is {last!r}"
    )


def _body(model: nn.Module) -> nn.Sequential:
    """The model without its output activation (returns logits); shares the parameters and
    their names with ``model``."""
    return nn.Sequential(*list(model.children())[:-1])


def predict(
    model: nn.Module, features: NDArray[np.float32], *, batch_size: int = 8192
) -> NDArray[np.int64]:
    """Hard predictions: class 1 when ``sigmoid >= 0.5`` (binary), else the argmax."""
    activation = output_activation(model)
    batch_size = check_int_at_least("batch_size", batch_size, 1)
    body = _body(model)
    outputs: list[NDArray[np.int64]] = []
    with torch.no_grad():
        tensor = torch.as_tensor(features).to(_dtype(model))
        for start in range(0, tensor.shape[0], batch_size):
            logits = body(tensor[start : start + batch_size])
            outputs.append(_hard_predictions(logits, activation).numpy())
    return np.concatenate(outputs) if outputs else np.zeros(0, dtype=np.int64)


def logit_model(model: nn.Module) -> nn.Module:
    """A binary model (ending in ``nn.Sigmoid``) as a float32 module that returns its logit,
    the form the LDP audit and FedEvalFair evaluate (``sigmoid(logit) >= 0.5`` is class 1, as
    :func:`predict`). A copy: ``model`` is left as it is."""
    if output_activation(model) != "sigmoid":
        raise ValueError("model must be binary (end in nn.Sigmoid) to give one logit")
    return copy.deepcopy(_body(model)).to(torch.float32).eval()


def _dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's parameters (inputs are cast to it; float64 models give
    float64-exact statistics, used by the tests)."""
    return next(model.parameters()).dtype


def _hard_predictions(logits: torch.Tensor, activation: Activation) -> torch.Tensor:
    if activation == "sigmoid":
        return (logits.reshape(-1) >= 0).to(torch.int64)
    return logits.argmax(dim=-1).to(torch.int64)


# --------------------------------------------------------------------------------------------
# Flattening between a statistic vector and the model's parameters
# --------------------------------------------------------------------------------------------


def num_parameters(model: nn.Module) -> int:
    """Number of scalar parameters ``p`` (``named_parameters`` order defines the vector)."""
    return int(sum(parameter.numel() for parameter in model.parameters()))


def statistics_layout(model: nn.Module, num_groups: int) -> StatisticsLayout:
    """The vector layout for ``model`` and ``num_groups`` groups."""
    return StatisticsLayout(num_params=num_parameters(model), num_groups=num_groups)


def get_flat_parameters(model: nn.Module) -> NDArray[np.float64]:
    """All parameters concatenated in ``named_parameters`` order, as a float64 copy."""
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]).numpy()


def unflatten_parameters(model: nn.Module, vector: torch.Tensor) -> dict[str, torch.Tensor]:
    """Split a flat vector into ``{name: tensor}`` with the shapes and dtypes of ``model``."""
    expected = num_parameters(model)
    if vector.ndim != 1 or vector.shape[0] != expected:
        raise ValueError(f"vector must have shape ({expected},), got {tuple(vector.shape)}")
    out: dict[str, torch.Tensor] = {}
    start = 0
    for name, parameter in model.named_parameters():
        count = parameter.numel()
        out[name] = vector[start : start + count].reshape(parameter.shape).to(parameter.dtype)
        start += count
    return out


def set_flat_parameters(model: nn.Module, vector: NDArray[np.floating]) -> None:
    """Load a flat vector (as from :func:`get_flat_parameters`) into ``model`` in place."""
    array = np.asarray(vector, dtype=np.float64)
    if not np.all(np.isfinite(array)):
        raise ValueError("vector must be finite (found NaN or infinity)")
    values = unflatten_parameters(model, torch.from_numpy(array))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(values[name])


# --------------------------------------------------------------------------------------------
# Surrogates and per-sample terms
# --------------------------------------------------------------------------------------------


def _check_constraint(constraint: str, activation: Activation, num_classes: int) -> None:
    if constraint not in CONSTRAINTS:
        raise ValueError(
            f"constraint must be one of {', '.join(map(repr, CONSTRAINTS))}; got {constraint!r}"
        )
    if constraint == "fnr" and num_classes != 2:
        raise ValueError(
            f"constraint 'fnr' (FNR parity) needs binary labels, got num_classes={num_classes}"
        )
    if activation == "sigmoid" and num_classes != 2:
        raise ValueError(
            f"model ends in nn.Sigmoid (binary) but the data has num_classes={num_classes}"
        )


def constraint_mask(labels: NDArray[np.int64], constraint: Constraint) -> NDArray[np.bool_]:
    """Membership in the constraint's sample set ``d'``: ``y = 1`` for FNR parity, every
    sample for accuracy parity (Section 3.1)."""
    if constraint not in CONSTRAINTS:
        raise ValueError(
            f"constraint must be one of {', '.join(map(repr, CONSTRAINTS))}; got {constraint!r}"
        )
    labels = np.asarray(labels)
    return labels == 1 if constraint == "fnr" else np.ones(labels.shape, dtype=bool)


def _loss_and_surrogate(
    logits: torch.Tensor,
    labels: torch.Tensor,
    activation: Activation,
    constraint: Constraint,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample loss and surrogate ``f`` from logits ``(batch, outputs)``."""
    if activation == "sigmoid":
        z = logits.reshape(labels.shape)
        y = labels.to(z.dtype)
        loss = nn.functional.softplus(z) - y * z  # binary cross-entropy with logits
        positive = torch.sigmoid(z)
        true_class = torch.where(labels == 1, positive, 1.0 - positive)
    else:
        log_probs = torch.log_softmax(logits, dim=-1)
        log_true = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        loss = -log_true
        true_class = log_true.exp()
        positive = log_probs[..., 1].exp() if constraint == "fnr" else true_class
    surrogate = 1.0 - positive if constraint == "fnr" else true_class
    return loss, surrogate


def _prepare(
    model: nn.Module, shard: FPFLShard, constraint: Constraint
) -> tuple[nn.Sequential, Activation]:
    activation = output_activation(model)
    _check_constraint(constraint, activation, shard.num_classes)
    assert isinstance(model, nn.Sequential)  # checked by output_activation
    return _body(model), activation


# --------------------------------------------------------------------------------------------
# Per-user statistic vectors (vectorised)
# --------------------------------------------------------------------------------------------


#: Default memory budget of one chunk: the per-sample Jacobians of ``2 * samples * p``
#: numbers (2^24 floats = 64 MB in float32).
GRADIENT_BUDGET = 1 << 24


def user_statistics(
    model: nn.Module,
    shard: FPFLShard,
    *,
    constraint: Constraint,
    users: Sequence[int] | NDArray[np.integer] | None = None,
    chunk_samples: int | None = None,
) -> torch.Tensor:
    """Unclipped statistic vectors of the users of ``shard``, vectorised (Eq. 17 + counts).

    A user's objectives are sums over its samples, ``L(d^k) = sum_i l_i`` and ``F(d'^k_a) =
    sum_{i in d'^k_a} f_i``, so their gradients are sums of per-sample gradients: one
    ``torch.func`` call (``vmap`` over samples of ``jacrev`` of the sample's ``[l_i, f_i]``,
    evaluated with ``functional_call``) gives every sample's two gradients, and an
    ``index_add`` sums them per user and group; the counts are summed the same way. No Python
    loop over users; the only loop is over chunks of samples (memory bound). ``torch.func``
    is part of torch: a node's process that handles one message (a deployed SuperNode) loads
    nothing more for it. A model with buffers (batch norm) is refused: its output for one
    sample depends on the others.

    Parameters
    ----------
    model : nn.Sequential
        Ends in ``nn.Sigmoid`` / ``nn.Softmax(dim=-1)`` (see :func:`output_activation`).
    shard : FPFLShard
        The node's users.
    constraint : ``"fnr"`` | ``"accuracy"``
        The fairness surrogate (Eq. 13 / 14).
    users : local user indices, optional
        The cohort (rows in this order); default all users of the shard.
    chunk_samples : int, optional
        Samples per ``vmap`` call; default ``GRADIENT_BUDGET / (2 p)``.

    Returns
    -------
    torch.Tensor, float64, shape (num_users, layout.size)
        One row per user in :class:`fedparity.mechanisms.fpfl.mmdm.StatisticsLayout` order
        (gradients are computed in the model's dtype). A user without samples gets a zero row.
    """
    body, activation = _prepare(model, shard, constraint)
    if any(True for _ in model.buffers()):
        raise ValueError(
            "model: layers with buffers (batch norm) are not supported: a sample's output, and "
            "so its user's statistics, would depend on the other samples"
        )
    cohort = shard if users is None else shard.select_users(users)
    layout = statistics_layout(model, shard.num_groups)
    p, num_groups, num_users = layout.num_params, layout.num_groups, cohort.num_users
    if chunk_samples is None:
        chunk_samples = max(1, GRADIENT_BUDGET // (2 * p))
    chunk_samples = check_int_at_least("chunk_samples", chunk_samples, 1)
    params = {name: value.detach() for name, value in model.named_parameters()}
    dtype = next(iter(params.values())).dtype

    def sample_terms(
        weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """One sample's ``[l_i, f_i]``."""
        logits = functional_call(body, weights, (x[None],))
        loss, surrogate = _loss_and_surrogate(logits, y[None], activation, constraint)
        return torch.cat([loss, surrogate])

    per_sample = vmap(jacrev(sample_terms), in_dims=(None, 0, 0))
    # The row of a sample's gradient: user k's loss gradient is row k (G + 1), its surrogate
    # gradient for group a is row k (G + 1) + 1 + a (zero outside d').
    grads = torch.zeros(num_users * (num_groups + 1), p, dtype=dtype)
    # Per-sample counts and values summed per user: [l, f 1{a, d'} (G), 1{a, d'} (G), 1,
    # error, error 1{a, d'} (G)].
    sums = torch.zeros(num_users, 3 * num_groups + 3, dtype=torch.float64)
    member = constraint_mask(cohort.labels, constraint)
    for start in range(0, cohort.labels.shape[0], chunk_samples):
        rows = slice(start, start + chunk_samples)
        x = torch.from_numpy(cohort.features[rows]).to(dtype)
        y = torch.from_numpy(cohort.labels[rows])
        group = torch.from_numpy(cohort.groups[rows])
        user = torch.from_numpy(cohort.user_index[rows])
        weight = torch.from_numpy(member[rows]).to(dtype)
        n = y.shape[0]
        jacobians = per_sample(params, x, y)
        sample_grads = torch.cat([jacobians[name].reshape(n, 2, -1) for name in params], dim=2)
        sample_grads[:, 1] *= weight[:, None]
        target = torch.stack([user * (num_groups + 1), user * (num_groups + 1) + 1 + group], 1)
        grads.index_add_(0, target.reshape(-1), sample_grads.reshape(2 * n, p))
        with torch.no_grad():
            logits = body(x)
            loss, surrogate = _loss_and_surrogate(logits, y, activation, constraint)
            wrong = (_hard_predictions(logits, activation) != y).to(torch.float64)
            in_set = torch.zeros(n, num_groups, dtype=torch.float64)
            in_set[torch.arange(n), group] = weight.to(torch.float64)
            terms = torch.cat(
                [
                    loss.to(torch.float64)[:, None],
                    in_set * surrogate.to(torch.float64)[:, None],
                    in_set,
                    torch.ones(n, 1, dtype=torch.float64),
                    wrong[:, None],
                    in_set * wrong[:, None],
                ],
                dim=1,
            )
        sums.index_add_(0, user, terms)
    out = torch.empty(num_users, layout.size, dtype=torch.float64)
    by_user = grads.view(num_users, num_groups + 1, p)
    out[:, layout.block("loss_grad")] = by_user[:, 0]
    out[:, layout.block("surrogate_grads")] = by_user[:, 1:].reshape(num_users, num_groups * p)
    g = num_groups
    out[:, layout.block("loss_sum")] = sums[:, :1]
    out[:, layout.block("surrogate_sums")] = sums[:, 1 : 1 + g]
    out[:, layout.block("constraint_counts")] = sums[:, 1 + g : 1 + 2 * g]
    out[:, layout.block("num_samples")] = sums[:, 1 + 2 * g : 2 + 2 * g]
    out[:, layout.block("num_errors")] = sums[:, 2 + 2 * g : 3 + 2 * g]
    out[:, layout.block("group_errors")] = sums[:, 3 + 2 * g :]
    return out


# --------------------------------------------------------------------------------------------
# Reference implementations (autograd on summed objectives)
# --------------------------------------------------------------------------------------------


def _autograd_statistics(
    model: nn.Sequential,
    body: nn.Sequential,
    activation: Activation,
    features: torch.Tensor,
    labels: torch.Tensor,
    groups: torch.Tensor,
    member: torch.Tensor,
    constraint: Constraint,
    num_groups: int,
) -> torch.Tensor:
    """The statistic vector of one set of samples by plain autograd on summed objectives
    (one backward pass for ``L`` and one per group for ``F_a``); float64 result."""
    parameters = list(model.parameters())

    def flat_grad(objective: torch.Tensor) -> torch.Tensor:
        if not objective.requires_grad:  # empty selection: the gradient is zero
            return torch.zeros(sum(p.numel() for p in parameters), dtype=torch.float64)
        grads = torch.autograd.grad(objective, parameters, retain_graph=True, allow_unused=True)
        return torch.cat(
            [
                (g if g is not None else torch.zeros_like(p)).reshape(-1).double()
                for g, p in zip(grads, parameters, strict=True)
            ]
        )

    logits = body(features)
    if activation == "sigmoid":
        loss = nn.functional.binary_cross_entropy_with_logits(
            logits.reshape(-1), labels.to(logits.dtype), reduction="sum"
        )
    else:
        loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
    _, surrogate = _loss_and_surrogate(logits, labels, activation, constraint)
    in_group = [(groups == a) & member for a in range(num_groups)]
    sums = [surrogate[mask].sum() for mask in in_group]
    with torch.no_grad():
        errors = _hard_predictions(logits, activation) != labels
    parts = [flat_grad(loss)]
    parts.append(torch.stack([s.detach().double() for s in sums]))
    parts.extend(flat_grad(s) for s in sums)
    parts.append(torch.tensor([float(mask.sum()) for mask in in_group], dtype=torch.float64))
    parts.append(torch.tensor([float(labels.shape[0]), float(errors.sum())], dtype=torch.float64))
    parts.append(
        torch.tensor([float((errors & mask).sum()) for mask in in_group], dtype=torch.float64)
    )
    parts.append(loss.detach().double().reshape(1))
    return torch.cat(parts)


def user_statistics_loop(
    model: nn.Module,
    shard: FPFLShard,
    *,
    constraint: Constraint,
    users: Sequence[int] | NDArray[np.integer] | None = None,
) -> torch.Tensor:
    """Reference for :func:`user_statistics`: a Python loop over users, each with autograd on
    its summed loss and per-group surrogate sums. Slow; tests and benchmarks only."""
    body, activation = _prepare(model, shard, constraint)
    assert isinstance(model, nn.Sequential)
    cohort = shard if users is None else shard.select_users(users)
    member = constraint_mask(cohort.labels, constraint)
    rows: list[torch.Tensor] = []
    for user in range(cohort.num_users):
        mine = cohort.user_index == user
        rows.append(
            _autograd_statistics(
                model,
                body,
                activation,
                torch.from_numpy(cohort.features[mine]).to(_dtype(model)),
                torch.from_numpy(cohort.labels[mine]),
                torch.from_numpy(cohort.groups[mine]),
                torch.from_numpy(member[mine]),
                constraint,
                shard.num_groups,
            )
        )
    size = statistics_layout(model, shard.num_groups).size
    return torch.stack(rows) if rows else torch.zeros(0, size, dtype=torch.float64)


def pooled_statistics(
    model: nn.Module, shard: FPFLShard, *, constraint: Constraint
) -> NDArray[np.float64]:
    """The statistic vector of all samples of ``shard`` pooled (central computation): what
    the server recovers from the noiseless sum of the users' unclipped vectors (Eq. 18)."""
    body, activation = _prepare(model, shard, constraint)
    assert isinstance(model, nn.Sequential)
    vector = _autograd_statistics(
        model,
        body,
        activation,
        torch.from_numpy(shard.features).to(_dtype(model)),
        torch.from_numpy(shard.labels),
        torch.from_numpy(shard.groups),
        torch.from_numpy(constraint_mask(shard.labels, constraint)),
        constraint,
        shard.num_groups,
    )
    return vector.numpy()


# --------------------------------------------------------------------------------------------
# Clipping and a node's contribution
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ClippedStatistics:
    """Per-user vectors clipped to L2 norm ``clipping_bound`` (Algorithm 1).

    Attributes
    ----------
    vectors : torch.Tensor, float64, (num_users, size)
        ``v_k * min(1, C / ||v_k||)``.
    norms : torch.Tensor, float64, (num_users,)
        ``||v_k||`` before clipping.
    clipping_bound : float
        ``C``.
    """

    vectors: torch.Tensor
    norms: torch.Tensor
    clipping_bound: float

    @property
    def clipped(self) -> torch.Tensor:
        """Which users' vectors were scaled down (``||v_k|| > C``)."""
        return self.norms > self.clipping_bound

    @property
    def clipped_fraction(self) -> float:
        """Fraction of users whose vector was scaled down (NaN for no user)."""
        return float(self.clipped.double().mean()) if self.norms.numel() else math.nan


def zero_nonfinite_rows(vectors: torch.Tensor) -> torch.Tensor:
    """``vectors`` with every row whose L2 norm is not finite (a NaN or an infinity in it, or
    an overflowing norm) replaced by zeros.

    A user whose statistics overflow (huge but finite model weights make ``exp`` or a product
    overflow) contributes nothing, the same as a user outside the cohort, instead of making
    the node's reply fail: whether a node replies must not depend on its users' data
    (security review of 2026-11-26, H2). :func:`clip_statistics` does the same."""
    finite = torch.isfinite(torch.linalg.vector_norm(vectors, dim=1))
    if bool(finite.all()):
        return vectors
    return torch.where(finite[:, None], vectors, torch.zeros((), dtype=vectors.dtype))


def clip_statistics(vectors: torch.Tensor, clipping_bound: float) -> ClippedStatistics:
    """Scale every row to L2 norm at most ``clipping_bound``: ``v min(1, C / ||v||)``; rows
    already within the bound are returned unchanged (bit for bit), rows whose norm is not
    finite become zeros (:func:`zero_nonfinite_rows`)."""
    bound = float(clipping_bound)
    if not math.isfinite(bound) or bound <= 0:
        raise ValueError(f"clipping_bound must be a finite number > 0, got {clipping_bound!r}")
    if vectors.ndim != 2:
        raise ValueError(f"vectors must be 2-D (users, size), got shape {tuple(vectors.shape)}")
    norms = torch.linalg.vector_norm(vectors, dim=1)
    finite = torch.isfinite(norms)
    if not bool(finite.all()):  # a row with a NaN or an infinity: zeros (zero_nonfinite_rows)
        vectors = torch.where(finite[:, None], vectors, torch.zeros((), dtype=vectors.dtype))
        norms = torch.where(finite, norms, torch.zeros((), dtype=norms.dtype))
    # A scale of exactly 1.0 leaves a row bit for bit (x * 1.0 == x in IEEE arithmetic).
    scale = torch.where(norms > bound, bound / norms, torch.ones_like(norms))
    return ClippedStatistics(vectors=vectors * scale[:, None], norms=norms, clipping_bound=bound)


@dataclass(frozen=True, eq=False)
class ShardContribution:
    """What a node sends for one round: the sum of its cohort users' clipped vectors.

    Attributes
    ----------
    total : float64 (size,)
        ``sum_k clip(v_k, C)`` over the node's cohort users.
    num_users : int
        Cohort users on this node.
    norms : float64 (num_users,)
        Pre-clip norms (diagnostics; never released in a private deployment).
    clipping_bound : float
        ``C``.
    """

    total: NDArray[np.float64]
    num_users: int
    norms: NDArray[np.float64]
    clipping_bound: float

    @property
    def clipped_fraction(self) -> float:
        """Fraction of the node's cohort users whose vector was clipped."""
        return float(np.mean(self.norms > self.clipping_bound)) if self.num_users else math.nan


def shard_contribution(
    model: nn.Module,
    shard: FPFLShard,
    *,
    constraint: Constraint,
    clipping_bound: float,
    users: Sequence[int] | NDArray[np.integer] | None = None,
    chunk_samples: int | None = None,
    statistics: Callable[..., torch.Tensor] = user_statistics,
) -> ShardContribution:
    """Per-user vectors of the cohort users on this node, clipped and summed (client side of
    Algorithm 1). ``statistics`` selects the implementation (tests pass the loop)."""
    if statistics is user_statistics:
        vectors = user_statistics(
            model, shard, constraint=constraint, users=users, chunk_samples=chunk_samples
        )
    else:
        vectors = statistics(model, shard, constraint=constraint, users=users)
    clipped = clip_statistics(vectors, clipping_bound)  # non-finite rows become zeros
    return ShardContribution(
        total=clipped.vectors.sum(dim=0).numpy(),
        num_users=int(vectors.shape[0]),
        norms=clipped.norms.numpy(),
        clipping_bound=clipped.clipping_bound,
    )
