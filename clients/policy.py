"""The node's own privacy policy: the limits a node holds to, whatever the server asks.

In Flower the run config and every message come from whoever runs ``flwr run``: to a node
they are hostile input. Every privacy parameter a node relies on therefore comes from its
:class:`NodePrivacyPolicy`, set by whoever starts the SuperNode, and a request beyond it is
refused with a fixed sentence (:class:`PolicyRefusal`) before anything is released.

Where a node finds its policy (:func:`node_policy`), first match wins:

1. node config ``privacy-policy``: the path of a TOML file with the keys below
   (``flower-supernode --node-config "privacy-policy=/etc/fedparity/policy.toml"``); policy
   keys given directly in the node config override the file's;
2. policy keys directly in the node config, over the built-in defaults;
3. the environment variable ``FEDPARITY_PRIVACY_POLICY`` (a file path) of the process that
   hosts the node -- how a simulation's operator (or a test) sets the simulated nodes' policy;
4. inside Flower's simulation engine (a node-side fact: the ClientApp runs in a Ray actor,
   which no server message can cause), :meth:`NodePrivacyPolicy.simulation`: the research
   knobs (seeded noise, non-private baselines, central noise, masking without a roster) are
   allowed because the users are simulated;
5. otherwise the safe built-in defaults, :class:`NodePrivacyPolicy` ``()``.

A policy file or node config starts from the built-in defaults: a key it does not set keeps
the safe default (``require-roster = true`` included, in a simulation too).

Keys (kebab-case in files and node config) and built-in defaults:

==============================  ==========  ===============================================
key                             default     meaning
==============================  ==========  ===============================================
``ldp-max-epsilon``             8.0         largest true epsilon of one LDP audit report
``user-epsilon-budget``         10.0        each user's lifetime epsilon over every DP
                                            release the node's ledger records (LDP audits,
                                            FPFL trainings), at ``user-delta`` (kept in the
                                            ledger; a later, lower policy lowers it, a
                                            higher one never raises it). The old name
                                            ``ldp-user-budget`` is still read (deprecated)
``user-delta``                  1e-6        the delta at which each user's total is stated
                                            and checked (kept in the ledger; only lowered)
``fpfl-max-epsilon``            8.0         largest user-level epsilon of an FPFL training
``fpfl-max-delta``              1e-3        largest delta of an FPFL training
``require-masking``             true        FPFL sums only under the masked secure sum
``require-distributed-noise``   true        FPFL noise only from the nodes' own shares
``allow-seeded-noise``          false       a server-sent seed for cohort and noise
``allow-non-private``           false       FPFL baselines without noise (FL, FFL, ...)
``allow-node-release``          false       FairFed's per-node release: the node's own noisy
                                            statistics, outside the secure sum (within the
                                            training's epsilon)
``min-survivors``               2           fewest survivors for which masks are revealed
``tolerated-colluders``         0           nodes that may collude with the server (noise
                                            shares are sized for ``n_min - t`` honest ones)
``max-nodes``                   1000        most nodes a round may claim (noise shares
                                            shrink with the node count)
``max-population``              10000000    most users K a run may claim (a larger K is
                                            refused at setup)
``min-holders``                 2           fewest holders in a CKKS sum a key holder opens
``min-users-for-counts``        10          below this many users a node sends no counts
                                            (of reports, samples, refusals, spent budget)
                                            in clear
``allow-ephemeral-ledger``      false       LDP audits with a ledger kept only for the run
                                            (forgotten after it; logged at every audit)
``require-roster``              true        FPFL masking only with peers whose masking keys
                                            are signed by members of the node's roster
                                            (node config ``roster``, ``identity-key``);
                                            without both, a masked FPFL run is refused at
                                            setup. ``false`` (the simulation's default)
                                            accepts that the server may invent peers
                                            (sybils) whose masks it knows: the node's
                                            vector is then hidden by its own noise share
                                            only (cross-device)
``fpfl-min-noise-multiplier``   0.5         smallest noise multiplier sigma of an FPFL
                                            training (a floor under any population size)
``fpfl-max-dropout-tolerance``  0.3         largest dropout tolerance rho of an FPFL run,
                                            below 0.5 (split views of the survivors)
``fpfl-max-weight``             10000       largest absolute model weight a round may carry
``fpfl-max-rounds``             10000       most rounds T of an FPFL training
``max-groups``                  256         most protected groups a run may claim
``max-users-per-node``          10000000    most simulated users per node (embedded data)
``max-resamples``               10000       most bootstrap resamples (``fef-resamples``)
``fef-max-releases-per-key``    200         most FedEvalFair releases a key holder makes
                                            with one secret key (its flooding margin)
``fef-dp-max-epsilon``          8.0         largest epsilon of a FedEvalFair release in the
                                            holder-level DP mode (its delta must be below
                                            ``user-delta``); each user is charged it
``fef-require-dp``              false       FedEvalFair only in the holder-level DP mode: a
                                            run without it is refused (round 1 before any
                                            data is read; the key holder releases nothing)
``fef-min-cell-floor``          5           smallest ``fef-min-cell`` a FedEvalFair holder
                                            applies: a run below it is refused in round 1,
                                            before any data is read (simulation: 0)
``allowed-apps``                (none)      SHA-256 hashes of the app bundles (FABs) this
                                            node's gated ClientApp process may run
==============================  ==========  ===============================================
"""

from __future__ import annotations

import functools
import math
import os
import sys
import tomllib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..mechanisms.validation import parse_int

if TYPE_CHECKING:  # the policy module imports no CKKS code
    from ..mechanisms.crypto.ckks.holder_dp import HolderDP

__all__ = [
    "DEPRECATED_KEYS",
    "POLICY_ENV",
    "POLICY_NODE_KEY",
    "NodePrivacyPolicy",
    "PolicyRefusal",
    "in_flower_simulation",
    "node_policy",
]

#: Node config key naming a policy file.
POLICY_NODE_KEY = "privacy-policy"
#: Environment variable naming a policy file (the node host's environment).
POLICY_ENV = "FEDPARITY_PRIVACY_POLICY"


class PolicyRefusal(Exception):
    """A request beyond the node's privacy policy. The message is a fixed sentence naming
    the rule (never a value), so it is safe to reach the server."""

    fixed_text = True

    def __init__(self, rule: str) -> None:
        super().__init__(f"refused by this node's privacy policy: {rule}")
        self.rule = rule


def _number(
    minimum: float,
    maximum: float = math.inf,
    *,
    integer: bool = False,
    closed_low: bool = False,
    open_high: bool = False,
) -> dict:
    """A numeric key's rule: ``(minimum, maximum]`` by default; ``closed_low`` includes the
    minimum, ``open_high`` excludes the maximum (integers: ``>= minimum``)."""
    return {
        "kind": "integer" if integer else "number",
        "minimum": minimum,
        "maximum": maximum,
        "closed_low": closed_low,
        "open_high": open_high,
    }


_BOOLEAN: dict = {"kind": "boolean"}
#: ``allowed-apps``: SHA-256 hex digests (64 lowercase hex characters each).
_HASHES: dict = {"kind": "hashes"}


@dataclass(frozen=True)
class NodePrivacyPolicy:
    """A node's privacy limits (see the module docstring for each key and its default)."""

    ldp_max_epsilon: float = field(default=8.0, metadata=_number(0.0))
    user_epsilon_budget: float = field(default=10.0, metadata=_number(0.0))
    user_delta: float = field(default=1e-6, metadata=_number(0.0, 0.01))
    fpfl_max_epsilon: float = field(default=8.0, metadata=_number(0.0))
    fpfl_max_delta: float = field(default=1e-3, metadata=_number(0.0, 1.0))
    require_masking: bool = field(default=True, metadata=_BOOLEAN)
    require_distributed_noise: bool = field(default=True, metadata=_BOOLEAN)
    allow_seeded_noise: bool = field(default=False, metadata=_BOOLEAN)
    allow_non_private: bool = field(default=False, metadata=_BOOLEAN)
    allow_node_release: bool = field(default=False, metadata=_BOOLEAN)
    min_survivors: int = field(default=2, metadata=_number(2, integer=True))
    tolerated_colluders: int = field(default=0, metadata=_number(0, integer=True))
    max_nodes: int = field(default=1000, metadata=_number(2, integer=True))
    max_population: int = field(default=10_000_000, metadata=_number(1, integer=True))
    min_holders: int = field(default=2, metadata=_number(2, integer=True))
    min_users_for_counts: int = field(default=10, metadata=_number(1, integer=True))
    allow_ephemeral_ledger: bool = field(default=False, metadata=_BOOLEAN)
    require_roster: bool = field(default=True, metadata=_BOOLEAN)
    fpfl_min_noise_multiplier: float = field(default=0.5, metadata=_number(0.0, closed_low=True))
    fpfl_max_dropout_tolerance: float = field(
        default=0.3, metadata=_number(0.0, 0.5, closed_low=True, open_high=True)
    )
    fpfl_max_weight: float = field(default=1e4, metadata=_number(0.0))
    fpfl_max_rounds: int = field(default=10_000, metadata=_number(1, integer=True))
    max_groups: int = field(default=256, metadata=_number(2, integer=True))
    max_users_per_node: int = field(default=10_000_000, metadata=_number(1, integer=True))
    max_resamples: int = field(default=10_000, metadata=_number(1, integer=True))
    fef_max_releases_per_key: int = field(default=200, metadata=_number(1, integer=True))
    fef_dp_max_epsilon: float = field(default=8.0, metadata=_number(0.0))
    fef_require_dp: bool = field(default=False, metadata=_BOOLEAN)
    fef_min_cell_floor: int = field(default=5, metadata=_number(0, integer=True))
    allowed_apps: tuple[str, ...] = field(default=(), metadata=_HASHES)
    #: Where the policy came from (reported in the node's logs; not a policy key).
    source: str = field(default="built-in defaults", compare=False)

    def __post_init__(self) -> None:
        for item in fields(self):
            if item.name == "source":
                continue
            value = getattr(self, item.name)
            object.__setattr__(self, item.name, _check(_key(item.name), value, item.metadata))

    @property
    def ldp_user_budget(self) -> float:
        """Deprecated name of :attr:`user_epsilon_budget`."""
        return self.user_epsilon_budget

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The policy keys, kebab-case."""
        return tuple(_key(item.name) for item in fields(cls) if item.name != "source")

    @classmethod
    def from_mapping(
        cls, mapping: Mapping[str, Any], *, base: NodePrivacyPolicy | None = None, source: str
    ) -> NodePrivacyPolicy:
        """``base`` (default: the built-in defaults) with the policy keys of ``mapping``;
        ``ValueError`` naming the key for an unknown key or a value out of range. The
        deprecated ``ldp-user-budget`` is read as ``user-epsilon-budget`` (with a warning)."""
        mapping = _renamed_keys(mapping, source)
        unknown = sorted(set(mapping) - set(cls.keys()))
        if unknown:
            raise ValueError(
                f"unknown privacy-policy key(s) {', '.join(unknown)} in {source}; known keys: "
                f"{', '.join(cls.keys())}"
            )
        values = {key.replace("-", "_"): value for key, value in mapping.items()}
        return replace(base or cls(), **values, source=source)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> NodePrivacyPolicy:
        """A policy from a TOML file of policy keys (unset keys keep the built-in defaults)."""
        file = Path(path).expanduser()
        try:
            with file.open("rb") as handle:
                table = tomllib.load(handle)
        except FileNotFoundError:
            raise ValueError(f"privacy policy {file}: no such file") from None
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"privacy policy {file}: not valid TOML ({error})") from None
        return cls.from_mapping(table, source=str(file))

    @classmethod
    @functools.cache
    def simulation(cls) -> NodePrivacyPolicy:
        """The policy of a node in Flower's simulation engine: its users are simulated, so the
        research settings (seeded noise, the non-private baselines, central noise, no masking,
        masking without a roster, FairFed's per-node release,
        larger budgets, a ledger that lives as long as the simulation) are allowed; every
        limit is still finite and enforced."""
        return cls(
            ldp_max_epsilon=16.0,
            user_epsilon_budget=32.0,
            fpfl_max_epsilon=16.0,
            fpfl_max_delta=0.1,
            require_masking=False,
            require_distributed_noise=False,
            allow_seeded_noise=True,
            allow_non_private=True,
            allow_node_release=True,
            allow_ephemeral_ledger=True,
            require_roster=False,
            fpfl_min_noise_multiplier=0.25,
            fpfl_max_dropout_tolerance=0.45,
            fef_min_cell_floor=0,
            source="simulation defaults",
        )

    # -- checks -----------------------------------------------------------------------------

    def check_ldp(self, epsilon: float) -> None:
        """Refuse an LDP report whose true epsilon is above ``ldp-max-epsilon``."""
        if not epsilon <= self.ldp_max_epsilon:
            raise PolicyRefusal("the audit's epsilon is above ldp-max-epsilon")

    def check_fpfl(
        self,
        *,
        epsilon: float | None,
        delta: float | None,
        masking: bool,
        distributed_noise: bool,
        seeded: bool,
    ) -> None:
        """Refuse FPFL settings the policy does not allow (``delta`` None: checked later, once
        the node knows the ``1 / K`` it stands for)."""
        if epsilon is None:
            if not self.allow_non_private:
                raise PolicyRefusal("training without noise needs allow-non-private")
        elif not epsilon <= self.fpfl_max_epsilon:
            raise PolicyRefusal("the training's epsilon is above fpfl-max-epsilon")
        if epsilon is not None and delta is not None and not delta <= self.fpfl_max_delta:
            raise PolicyRefusal("the training's delta is above fpfl-max-delta")
        if self.require_masking and not masking:
            raise PolicyRefusal("require-masking forbids an unmasked sum")
        if self.require_distributed_noise and epsilon is not None and not distributed_noise:
            raise PolicyRefusal("require-distributed-noise forbids central noise")
        if seeded and not self.allow_seeded_noise:
            raise PolicyRefusal("seeded noise needs allow-seeded-noise")

    def check_roster(self, *, identity_key: bool, roster: bool) -> None:
        """Refuse FPFL masking when ``require-roster`` is set and this node has no identity
        key or no roster (``identity_key``, ``roster``: whether it has each): without a roster
        the server may invent peers (sybils) whose masks it knows. The sentence names what is
        missing, the node config keys and the policy key that accepts the risk."""
        if not self.require_roster or (identity_key and roster):
            return
        missing = " and ".join(
            name
            for name, present in (("roster", roster), ("identity-key", identity_key))
            if not present
        )
        raise PolicyRefusal(
            f"FPFL masking needs this node's {missing} (node config roster and identity-key, "
            "made by fedparity identity), or require-roster = false to accept peers the "
            "server may invent"
        )

    def check_node_release(self, fairfed: bool) -> None:
        """Refuse FairFed's per-node release (a run with a release share) unless
        ``allow-node-release``."""
        if fairfed and not self.allow_node_release:
            raise PolicyRefusal("FairFed's per-node release needs allow-node-release")

    def bounded_population(self, population_size: int) -> int:
        """The population size K the node uses: the server's, at most ``max-population``."""
        if population_size < 1:
            raise PolicyRefusal("the population size must be at least 1")
        return min(int(population_size), self.max_population)

    def check_population(self, population_size: int) -> None:
        """Refuse a population size ``K`` outside ``[1, max-population]`` (a run agrees on one
        ``K`` at setup; a node never calibrates with another ``K`` than the run's)."""
        if not 1 <= population_size <= self.max_population:
            raise PolicyRefusal("the run's population size is outside [1, max-population]")

    def check_sizes(
        self,
        *,
        num_groups: int | None = None,
        users_per_node: int | None = None,
        resamples: int | None = None,
        rounds: int | None = None,
    ) -> None:
        """Refuse sizes beyond the policy's caps (``max-groups``, ``max-users-per-node``,
        ``max-resamples``, ``fpfl-max-rounds``), before any work: a node never allocates what
        a server-chosen number asks for (None: not checked)."""
        if num_groups is not None and not 2 <= num_groups <= self.max_groups:
            raise PolicyRefusal("the run's number of groups is outside [2, max-groups]")
        if users_per_node is not None and not 1 <= users_per_node <= self.max_users_per_node:
            raise PolicyRefusal("the run's users per node are outside [1, max-users-per-node]")
        if resamples is not None and not 1 <= resamples <= self.max_resamples:
            raise PolicyRefusal("the run's bootstrap resamples are outside [1, max-resamples]")
        if rounds is not None and not 1 <= rounds <= self.fpfl_max_rounds:
            raise PolicyRefusal("the training's rounds are outside [1, fpfl-max-rounds]")

    def check_fpfl_noise(self, noise_multiplier: float, dropout_tolerance: float) -> None:
        """Refuse a noisy FPFL run whose noise multiplier is below ``fpfl-min-noise-multiplier``
        or whose dropout tolerance is above ``fpfl-max-dropout-tolerance``."""
        if not noise_multiplier >= self.fpfl_min_noise_multiplier:
            raise PolicyRefusal(
                "the training's noise multiplier is below fpfl-min-noise-multiplier"
            )
        self.check_dropout_tolerance(dropout_tolerance)

    def check_dropout_tolerance(self, dropout_tolerance: float) -> None:
        """Refuse a dropout tolerance above ``fpfl-max-dropout-tolerance`` (with or without
        noise: it sets how few survivors a node reveals masks for)."""
        if not 0.0 <= dropout_tolerance <= self.fpfl_max_dropout_tolerance:
            raise PolicyRefusal("the run's dropout tolerance is above fpfl-max-dropout-tolerance")

    def check_weights(self, largest_magnitude: float) -> None:
        """Refuse model weights whose largest magnitude is above ``fpfl-max-weight`` (checked
        before any data is read: overflowing weights would make a reply depend on the data)."""
        if not largest_magnitude <= self.fpfl_max_weight:
            raise PolicyRefusal("the round's model weights are above fpfl-max-weight")

    def check_fef_mode(self, dp: HolderDP | None) -> None:
        """Refuse a FedEvalFair run outside the holder-level DP mode (``dp`` None) when
        ``fef-require-dp`` is set, and one in the mode that :meth:`check_fef_dp` refuses."""
        if dp is None:
            if self.fef_require_dp:
                raise PolicyRefusal(
                    "fef-require-dp forbids a FedEvalFair release without holder-level DP"
                )
            return
        self.check_fef_dp(dp.epsilon, dp.delta)

    def check_fef_dp(self, epsilon: float, delta: float) -> None:
        """Refuse a FedEvalFair release in the holder-level DP mode whose epsilon is above
        ``fef-dp-max-epsilon``, or whose delta is not below ``user-delta`` (no user could
        afford it: each user's total is stated at ``user-delta``)."""
        if not epsilon <= self.fef_dp_max_epsilon:
            raise PolicyRefusal("the FedEvalFair release's epsilon is above fef-dp-max-epsilon")
        if not delta < self.user_delta:
            raise PolicyRefusal("the FedEvalFair release's delta is not below user-delta")

    def check_fef_min_cell(self, min_cell: int, *, source: str = "the run config") -> None:
        """Refuse a FedEvalFair ``fef-min-cell`` below ``fef-min-cell-floor`` (before any data
        is read), in one line naming both values and which side to change.

        Refused, not raised to the floor: every holder of a test then applies the rule the
        run states, so the report's ``fef-min-cell`` is the one its holders used (a silently
        raised threshold would differ between holders with different floors, unseen by the
        server). The decision depends on the run's setting and the policy only.

        Parameters
        ----------
        min_cell : int
            The ``fef-min-cell`` asked for.
        source : str
            Where it comes from, for the sentence (default: the run config).
        """
        if not min_cell >= self.fef_min_cell_floor:
            raise PolicyRefusal(
                f"fef-min-cell = {min_cell} ({source}) is below this node's fef-min-cell-floor "
                f"= {self.fef_min_cell_floor}: raise fef-min-cell to at least "
                f"{self.fef_min_cell_floor}, or lower fef-min-cell-floor in the node's policy"
            )

    def check_app(self, app_hash: str) -> None:
        """Refuse an app bundle whose SHA-256 hash is not in ``allowed-apps``."""
        if app_hash.lower() not in self.allowed_apps:
            raise PolicyRefusal("the run's app bundle is not in allowed-apps")

    def check_nodes(self, num_nodes: int) -> None:
        """Refuse a round that claims more nodes than ``max-nodes`` (or fewer than two)."""
        if not 2 <= num_nodes <= self.max_nodes:
            raise PolicyRefusal("the round's node count is outside [2, max-nodes]")


def _key(name: str) -> str:
    return name.replace("_", "-")


#: Old policy key -> its current name (still read, with a deprecation warning).
DEPRECATED_KEYS = {"ldp-user-budget": "user-epsilon-budget"}


def _renamed_keys(mapping: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``mapping`` with the deprecated keys under their current names (``ValueError`` when
    both names are given)."""
    renamed = dict(mapping)
    for old, new in DEPRECATED_KEYS.items():
        if old not in renamed:
            continue
        if new in renamed:
            raise ValueError(
                f"privacy-policy keys {old} (deprecated) and {new} are both in {source}: keep "
                f"only {new}"
            )
        warnings.warn(
            f"privacy-policy key {old} in {source} is deprecated: it is now {new}, each user's "
            "budget over every release the node's ledger records (LDP audits and FPFL)",
            FutureWarning,  # shown by default: meant for the node's operator
            stacklevel=3,
        )
        renamed[new] = renamed.pop(old)
    return renamed


_HEX = frozenset("0123456789abcdef")


def _check_hashes(key: str, value: Any) -> tuple[str, ...]:
    """A list of SHA-256 hex digests: a TOML list, or one string of comma- or space-separated
    digests (node config values are strings)."""
    items = value.replace(",", " ").split() if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(item, str) for item in items):
        raise ValueError(
            f"privacy-policy key {key} must be a list of SHA-256 hex digests, got {value!r}"
        )
    digests = tuple(item.strip().lower() for item in items)
    for digest in digests:
        if len(digest) != 64 or not set(digest) <= _HEX:
            raise ValueError(
                f"privacy-policy key {key} must hold SHA-256 hex digests (64 hex characters), "
                f"got {digest!r}"
            )
    return digests


def _check(key: str, value: Any, rule: Mapping[str, Any]) -> Any:
    if rule["kind"] == "boolean":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError(f"privacy-policy key {key} must be true or false, got {value!r}")
    if rule["kind"] == "hashes":
        return _check_hashes(key, value)
    low, high = rule["minimum"], rule["maximum"]
    closed_low, open_high = rule["closed_low"], rule["open_high"]
    if rule["kind"] == "integer":
        # TOML's 3 or 3.0, or the text "3" of an environment variable (one rule: parse_int)
        return parse_int(f"privacy-policy key {key}", value, minimum=low)
    span = f"a number in {'[' if closed_low else '('}{low:g}, " + (
        "inf)" if math.isinf(high) else f"{high:g}{')' if open_high else ']'}"
    )
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    above_low = number >= low if closed_low else number > low
    below_high = number < high if open_high else number <= high
    if not (math.isfinite(number) and above_low and below_high):
        raise ValueError(f"privacy-policy key {key} must be {span}, got {value!r}")
    return number


def in_flower_simulation() -> bool:
    """Whether this code runs inside Flower's simulation engine (a Ray actor hosts the
    ClientApp). Ray is only looked at if the process has already imported it."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return bool(ray.is_initialized()) and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - any doubt means "not simulation" (the strict policy)
        return False


@functools.lru_cache(maxsize=32)
def _cached_file(path: str, modified: float) -> NodePrivacyPolicy:
    return NodePrivacyPolicy.from_file(path)


def _policy_file(path: str | os.PathLike[str]) -> NodePrivacyPolicy:
    file = Path(path).expanduser()
    try:
        modified = file.stat().st_mtime
    except OSError:
        raise ValueError(f"privacy policy {file}: no such file") from None
    return _cached_file(str(file), modified)


def node_policy(
    node_config: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> NodePrivacyPolicy:
    """This node's policy, from its node config, its environment, the simulation engine or the
    built-in defaults (module docstring; first match wins). Raises ``ValueError`` naming the
    file or key for a policy that cannot be read."""
    environ = os.environ if environ is None else environ
    known = (*NodePrivacyPolicy.keys(), *DEPRECATED_KEYS)
    overrides = {key: value for key, value in node_config.items() if key in known}
    named = node_config.get(POLICY_NODE_KEY)
    if named:
        base = _policy_file(str(named))
        if overrides:
            return NodePrivacyPolicy.from_mapping(
                overrides, base=base, source=f"{base.source} + node config"
            )
        return base
    if overrides:
        return NodePrivacyPolicy.from_mapping(overrides, source="node config")
    if environ.get(POLICY_ENV):
        return _policy_file(environ[POLICY_ENV])
    if in_flower_simulation():
        return NodePrivacyPolicy.simulation()
    return _built_in_policy()


@functools.cache
def _built_in_policy() -> NodePrivacyPolicy:
    """The built-in defaults (one frozen object: a node builds no policy per message)."""
    return NodePrivacyPolicy()
