"""The FPFL protocol's messages, typed: what the server and the nodes send each other.

FPFL is Algorithm 1 of Rodriguez-Galvez, Granqvist, van Dalen and Seigel, "Enforcing fairness
in private federated learning via the modified method of differential multipliers", 2021; its
sums travel through the double-masking secure sum of Bonawitz et al., "Practical Secure
Aggregation for Privacy-Preserving Machine Learning", CCS 2017
(:mod:`fedparity.mechanisms.crypto.secure_sum`).

Each message is a frozen dataclass used by both ends (the Flower adapters
:mod:`fedparity.clients.fpfl_handlers` and :mod:`fedparity.strategies.fpfl`). ``to_fields()``
gives the values of a Flower ``ConfigRecord`` (numbers, strings, bytes, booleans and lists of
them) and ``from_fields(record)`` reads them back, raising
:class:`~fedparity.mechanisms.protocol.MessageError` naming the field for anything missing or
malformed; a message's arrays (model weights, the masked vector) travel beside it in an
``ArrayRecord`` under the names given here.

**Agreed run parameters.** Everything a node's privacy depends on is fixed once per run, in
:class:`FPFLRunParameters` (``K``, ``m``, ``T``, epsilon, delta, sigma, ``C``, rho, the
constraint, the number of groups and the statistic vector's size, the session): the setup
message proposes them, every node checks them against its own settings and policy and signs
their digest with its masking key, the key table binds the digest and the member list into
:meth:`FPFLKeyTable.run_digest`, from which every pair secret is derived; a round request
names that digest and a node refuses any other. Nodes given different views derive pair masks
that do not cancel.

Message flow of a run (``query.<action>``)::

    fpfl_setup   FPFLSetupRequest  -> FPFLSetupReply     once: parameters, masking key
    fpfl_keys    FPFLKeyTable      -> FPFLKeysReply      once: members and keys pinned
    fpfl_round   FPFLRoundRequest  -> FPFLRoundReply     per round: the masked sum
    fpfl_confirm FPFLConfirmRequest-> FPFLConfirmReply   rounds with dropped nodes only
    fpfl_reveal  FPFLRevealRequest -> FPFLRevealReply    per round: the unmask
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..validation import check_int, integer_range
from . import MessageError, message_int

__all__ = [
    "FPFLConfirmReply",
    "FPFLConfirmRequest",
    "FPFLKeyTable",
    "FPFLKeysReply",
    "FPFLRevealReply",
    "FPFLRevealRequest",
    "FPFLRoundReply",
    "FPFLRoundRequest",
    "FPFLRunParameters",
    "FPFLSetupReply",
    "FPFLSetupRequest",
    "MASKED_ARRAY",
    "RELEASE_ARRAY",
    "SUM_ARRAY",
    "WEIGHTS_ARRAY",
]

#: Array names in the messages' ``ArrayRecord`` (record key ``FPFL_KEY``).
WEIGHTS_ARRAY = "weights"
MASKED_ARRAY = "masked"
SUM_ARRAY = "sum"
#: A FairFed node's own noisy statistics (float64, ``3 G + 3``), beside its share of the sum.
RELEASE_ARRAY = "fairness-release"

_PARAMETERS_LABEL = b"fedparity/fpfl/v1/run-parameters"
_RUN_LABEL = b"fedparity/fpfl/v1/run"
DIGEST_BYTES = 32

ConfigValue = int | float | str | bytes | bool | list


# -- reading fields -------------------------------------------------------------------------


def _get(record: Mapping[str, Any], key: str) -> Any:
    try:
        return record[key]
    except (KeyError, TypeError):
        raise MessageError(f"message field {key!r} is missing") from None


def _int(record: Mapping[str, Any], key: str, minimum: int | None = None) -> int:
    """An integer field by the one rule (:func:`message_int`), except that a float is refused:
    both ends write these fields as ints from the same types, and the run parameters are
    pinned by a digest that encodes an int by its decimal text (:meth:`FPFLRunParameters.digest`),
    so a float here is a malformed message, never a count to round."""
    value = _get(record, key)
    if isinstance(value, float | np.floating):
        raise MessageError(f"message field {key!r} must be {integer_range(minimum)}")
    return message_int(key, value, minimum=minimum)


def _float(record: Mapping[str, Any], key: str) -> float:
    value = _get(record, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise MessageError(f"message field {key!r} must be a finite number")
    return float(value)


def _optional_float(record: Mapping[str, Any], key: str) -> float | None:
    return _float(record, key) if key in record else None


def _bool(record: Mapping[str, Any], key: str) -> bool:
    value = _get(record, key)
    if not isinstance(value, bool):
        raise MessageError(f"message field {key!r} must be true or false")
    return value


def _str(record: Mapping[str, Any], key: str) -> str:
    value = _get(record, key)
    if not isinstance(value, str):
        raise MessageError(f"message field {key!r} must be a string")
    return value


def _bytes(record: Mapping[str, Any], key: str, size: int | None = None) -> bytes:
    value = _get(record, key)
    if not isinstance(value, bytes) or (size is not None and len(value) != size):
        raise MessageError(
            f"message field {key!r} must be bytes" + (f" ({size} of them)" if size else "")
        )
    return value


def _optional_bytes(record: Mapping[str, Any], key: str) -> bytes | None:
    return _bytes(record, key) if key in record else None


def _ints(record: Mapping[str, Any], key: str, *, distinct: bool = False) -> tuple[int, ...]:
    values = _get(record, key)
    # Node ids are 64-bit: a float cannot carry them exactly (above 2^53), so floats are
    # refused outright; the rest is the one integer rule (check_int).
    if not isinstance(values, list) or any(isinstance(v, float | np.floating) for v in values):
        raise MessageError(f"message field {key!r} must be a list of integers >= 0")
    try:
        values = [check_int(key, v, minimum=0) for v in values]
    except ValueError:
        raise MessageError(f"message field {key!r} must be a list of integers >= 0") from None
    if distinct and len(set(values)) != len(values):
        raise MessageError(f"message field {key!r} must list distinct integers")
    return tuple(values)


def _bytes_list(
    record: Mapping[str, Any], key: str, length: int | None = None
) -> tuple[bytes, ...]:
    values = _get(record, key)
    if not isinstance(values, list) or not all(isinstance(v, bytes) for v in values):
        raise MessageError(f"message field {key!r} must be a list of byte strings")
    if length is not None and len(values) != length:
        raise MessageError(f"message field {key!r} must hold {length} byte strings")
    return tuple(values)


def _digest(*parts: bytes) -> bytes:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(len(part).to_bytes(8, "big") + part)
    return hasher.digest()


def _number_bytes(value: float | None) -> bytes:
    """A float (or None) as bytes that are equal exactly when the values are: its hex form."""
    return b"none" if value is None else float(value).hex().encode()


def _ids_bytes(ids: Sequence[int]) -> bytes:
    return b"".join(int(node).to_bytes(8, "big") for node in ids)


# -- the run's parameters --------------------------------------------------------------------


@dataclass(frozen=True)
class FPFLRunParameters:
    """What every node of an FPFL run agrees on at setup (Rodriguez-Galvez et al. 2021,
    Algorithm 1), pinned for the run.

    Attributes
    ----------
    population_size : int
        ``K``: users over all nodes; every user joins a round with ``q = m / K``.
    cohort_size, rounds : int
        ``m`` and ``T``.
    clipping_bound : float or None
        ``C`` (None: the unclipped baselines FL and FFL).
    epsilon : float or None
        The user-level epsilon the noise is calibrated for (None: no noise).
    delta : float or None
        The training's delta (None without noise).
    noise_multiplier : float
        ``sigma`` (0 without noise).
    accountant : str
        The accountant sigma was calibrated with (``"rdp"`` or ``"prv"``).
    constraint : str
        The fairness constraint whose terms the statistic vector carries.
    num_groups, vector_size : int
        Protected groups, and the statistic vector's length (``StatisticsLayout.size``).
    distributed_noise, masking : bool
        Noise shares from the nodes (or central noise); the masked secure sum (or sums in the
        clear).
    dropout_tolerance : float
        ``rho`` in [0, 1).
    session : str
        The training's label when a run trains more than once (``""``: the only one).
    fairfed_release_share : float
        ``phi`` in [0, 1): FairFed's per-node releases take this share of ``1 / sigma^2``
        (:func:`~fedparity.mechanisms.fpfl.fairfed.release_noise_multipliers`); 0: no per-node
        release and every node scale is 1 (FPFL, FedFB and the baselines).
    """

    population_size: int
    cohort_size: int
    rounds: int
    clipping_bound: float | None
    epsilon: float | None
    delta: float | None
    noise_multiplier: float
    accountant: str
    constraint: str
    num_groups: int
    vector_size: int
    distributed_noise: bool
    masking: bool
    dropout_tolerance: float
    session: str = ""
    fairfed_release_share: float = 0.0

    def __post_init__(self) -> None:
        for name, minimum in (
            ("population_size", 1),
            ("cohort_size", 1),
            ("rounds", 1),
            ("num_groups", 2),
            ("vector_size", 1),
        ):
            # stored as a Python int: the digest encodes an int by its decimal text
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=minimum))
        if self.clipping_bound is not None and not (
            math.isfinite(self.clipping_bound) and self.clipping_bound > 0
        ):
            raise ValueError(f"clipping_bound must be > 0 or None, got {self.clipping_bound!r}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be >= 0, got {self.noise_multiplier!r}")
        if self.epsilon is None:
            if self.noise_multiplier or self.delta is not None:
                raise ValueError("a run without epsilon has noise_multiplier 0 and no delta")
        else:
            if not (math.isfinite(self.epsilon) and self.epsilon > 0):
                raise ValueError(f"epsilon must be > 0 or None, got {self.epsilon!r}")
            if self.delta is None or not 0.0 < self.delta < 1.0:
                raise ValueError(f"delta must be in (0, 1) with epsilon, got {self.delta!r}")
            if not self.noise_multiplier > 0 or self.clipping_bound is None:
                raise ValueError(
                    "a run with epsilon needs noise_multiplier > 0 and a clipping_bound"
                )
        if not 0.0 <= self.dropout_tolerance < 1.0:
            raise ValueError(f"dropout_tolerance must be in [0, 1), got {self.dropout_tolerance!r}")
        if not 0.0 <= self.fairfed_release_share < 1.0:  # NaN fails too
            raise ValueError(
                f"fairfed_release_share must be in [0, 1), got {self.fairfed_release_share!r}"
            )
        for name in ("accountant", "constraint", "session"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")

    @classmethod
    def for_training(
        cls,
        *,
        population_size: int,
        cohort_size: int,
        rounds: int,
        clipping_bound: float | None,
        epsilon: float | None,
        constraint: str,
        num_groups: int,
        vector_size: int,
        delta: float | None = None,
        accountant: str = "rdp",
        distributed_noise: bool = True,
        masking: bool = True,
        dropout_tolerance: float = 0.2,
        session: str = "",
        fairfed_release_share: float = 0.0,
    ) -> FPFLRunParameters:
        """The parameters of a training, with sigma calibrated for ``(epsilon, delta)`` after
        ``rounds`` rounds at ``q = m / K``
        (:func:`~fedparity.mechanisms.privacy.opacus_accounting.calibrate_noise`, Opacus; ``delta``
        None: ``1 / K``) or 0 without ``epsilon``: what a node with the same settings accepts."""
        sigma = 0.0
        if epsilon is not None:
            from ..privacy.opacus_accounting import calibrate_noise  # Opacus: only when calibrating

            delta = 1.0 / population_size if delta is None else delta
            sigma = calibrate_noise(
                epsilon=epsilon,
                delta=delta,
                cohort_size=cohort_size,
                population_size=population_size,
                steps=rounds,
                accountant=accountant,  # type: ignore[arg-type]
            ).noise_multiplier
        return cls(
            population_size=population_size,
            cohort_size=cohort_size,
            rounds=rounds,
            clipping_bound=clipping_bound,
            epsilon=epsilon,
            delta=delta if epsilon is not None else None,
            noise_multiplier=sigma,
            accountant=accountant,
            constraint=constraint,
            num_groups=num_groups,
            vector_size=vector_size,
            distributed_noise=distributed_noise,
            masking=masking,
            dropout_tolerance=dropout_tolerance,
            session=session,
            fairfed_release_share=fairfed_release_share,
        )

    @property
    def sample_rate(self) -> float:
        """``q = min(1, m / K)``: each user's chance of joining a round."""
        return min(1.0, self.cohort_size / self.population_size)

    @property
    def fairfed(self) -> bool:
        """Whether the nodes release their own noisy statistics and take node scales
        (FairFed)."""
        return self.fairfed_release_share > 0

    @property
    def sum_noise_multiplier(self) -> float:
        """The noise multiplier of the secure sum: ``sigma``, or in a FairFed run with noise
        ``sigma / sqrt(1 - phi)`` (the per-node releases take the rest)."""
        if not (self.fairfed and self.noise_multiplier):
            return self.noise_multiplier
        from ..fpfl.fairfed import release_noise_multipliers

        return release_noise_multipliers(self.noise_multiplier, self.fairfed_release_share)[0]

    @property
    def release_noise_multiplier(self) -> float:
        """The noise multiplier of a FairFed node's own release: ``sigma / sqrt(phi)`` (0
        without noise or outside FairFed)."""
        if not (self.fairfed and self.noise_multiplier):
            return 0.0
        from ..fpfl.fairfed import release_noise_multipliers

        return release_noise_multipliers(self.noise_multiplier, self.fairfed_release_share)[1]

    @property
    def noisy_shares(self) -> bool:
        """Whether the nodes add noise shares (distributed noise of a noisy run)."""
        return self.distributed_noise and self.noise_multiplier > 0

    def digest(self) -> bytes:
        """SHA-256 of the parameters' canonical encoding: equal exactly when every parameter
        is (floats by their exact binary value)."""
        return _digest(
            _PARAMETERS_LABEL,
            *(
                str(value).encode() if isinstance(value, int | str) else _number_bytes(value)
                for value in (
                    self.population_size,
                    self.cohort_size,
                    self.rounds,
                    self.clipping_bound,
                    self.epsilon,
                    self.delta,
                    self.noise_multiplier,
                    self.accountant,
                    self.constraint,
                    self.num_groups,
                    self.vector_size,
                    str(self.distributed_noise),
                    str(self.masking),
                    self.dropout_tolerance,
                    self.session,
                    # only in a FairFed run: the other runs' digests stay what they were
                    *((self.fairfed_release_share,) if self.fairfed else ()),
                )
            ),
        )

    def to_fields(self) -> dict[str, ConfigValue]:
        fields: dict[str, ConfigValue] = {
            "population-size": self.population_size,
            "cohort-size": self.cohort_size,
            "rounds": self.rounds,
            "noise-multiplier": float(self.noise_multiplier),
            "accountant": self.accountant,
            "constraint": self.constraint,
            "num-groups": self.num_groups,
            "vector-size": self.vector_size,
            "distributed-noise": self.distributed_noise,
            "masking": self.masking,
            "dropout-tolerance": float(self.dropout_tolerance),
            "session": self.session,
        }
        if self.fairfed:
            fields["fairfed-release-share"] = float(self.fairfed_release_share)
        for key, value in (
            ("clipping-bound", self.clipping_bound),
            ("epsilon", self.epsilon),
            ("delta", self.delta),
        ):
            if value is not None:
                fields[key] = float(value)
        return fields

    @classmethod
    def from_fields(cls, record: Mapping[str, Any]) -> FPFLRunParameters:
        try:
            return cls(
                population_size=_int(record, "population-size", 1),
                cohort_size=_int(record, "cohort-size", 1),
                rounds=_int(record, "rounds", 1),
                clipping_bound=_optional_float(record, "clipping-bound"),
                epsilon=_optional_float(record, "epsilon"),
                delta=_optional_float(record, "delta"),
                noise_multiplier=_float(record, "noise-multiplier"),
                accountant=_str(record, "accountant"),
                constraint=_str(record, "constraint"),
                num_groups=_int(record, "num-groups", 2),
                vector_size=_int(record, "vector-size", 1),
                distributed_noise=_bool(record, "distributed-noise"),
                masking=_bool(record, "masking"),
                dropout_tolerance=_float(record, "dropout-tolerance"),
                session=_str(record, "session"),
                fairfed_release_share=_optional_float(record, "fairfed-release-share") or 0.0,
            )
        except ValueError as error:
            if isinstance(error, MessageError):
                raise
            raise MessageError(
                "message fields of the run parameters are inconsistent (a run's epsilon, "
                "delta, noise multiplier and clipping bound go together; sizes must be "
                "positive; the dropout tolerance must be in [0, 1))"
            ) from None


# -- setup -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FPFLSetupRequest:
    """``query.fpfl_setup``: the run's salt and its proposed parameters."""

    run_salt: bytes
    parameters: FPFLRunParameters

    def to_fields(self) -> dict[str, ConfigValue]:
        return {"run-salt": self.run_salt, **self.parameters.to_fields()}

    @classmethod
    def from_fields(cls, record: Mapping[str, Any]) -> FPFLSetupRequest:
        salt = _bytes(record, "run-salt")
        if len(salt) < 16:
            raise MessageError("message field 'run-salt' must hold at least 16 bytes")
        return cls(salt, FPFLRunParameters.from_fields(record))


@dataclass(frozen=True)
class FPFLSetupReply:
    """The node accepted the parameters (their digest); with masking, its masking public key,
    signed (over the salt, its id, the key and the parameters' digest) when it has an identity
    key."""

    parameters_digest: bytes
    public_key: bytes | None = None
    identity_key: bytes | None = None
    signature: bytes | None = None

    def to_fields(self) -> dict[str, ConfigValue]:
        fields: dict[str, ConfigValue] = {"parameters-digest": self.parameters_digest}
        for key, value in (
            ("public-key", self.public_key),
            ("identity-key", self.identity_key),
            ("signature", self.signature),
        ):
            if value is not None:
                fields[key] = value
        return fields

    @classmethod
    def from_fields(cls, record: Mapping[str, Any]) -> FPFLSetupReply:
        public_key = _optional_bytes(record, "public-key")
        if public_key is not None and len(public_key) != 32:
            raise MessageError("message field 'public-key' must be bytes (32 of them)")
        return cls(
            parameters_digest=_bytes(record, "parameters-digest", DIGEST_BYTES),
            public_key=public_key,
            identity_key=_optional_bytes(record, "identity-key"),
            signature=_optional_bytes(record, "signature"),
        )


@dataclass(frozen=True)
class FPFLKeyTable:
    """``query.fpfl_keys``: the run's members (sorted node ids) and, with masking, their
    masking keys (signed when every node signed), and the fixed-point codec the server will
    decode with (``clip_range``, ``scale``), which every node derives itself and compares."""

    run_salt: bytes
    parameters_digest: bytes
    members: tuple[int, ...]
    public_keys: tuple[bytes, ...] = ()
    identity_keys: tuple[bytes, ...] = ()
    signatures: tuple[bytes, ...] = ()
    codec_clip_range: float | None = None
    codec_scale: float | None = None

    def __post_init__(self) -> None:
        if list(self.members) != sorted(set(self.members)):
            raise MessageError("message field 'members' must list distinct node ids in order")
        for name in ("public_keys", "identity_keys", "signatures"):
            values = getattr(self, name)
            if values and len(values) != len(self.members):
                raise MessageError(
                    f"message field {name.replace('_', '-')!r} must hold one entry per member"
                )

    def run_digest(self) -> bytes:
        """What the run's pair secrets are bound to: the parameters' digest, the members and
        their masking keys. Two nodes derive the same masks only with the same digest."""
        return _digest(
            _RUN_LABEL,
            self.run_salt,
            self.parameters_digest,
            _ids_bytes(self.members),
            *self.public_keys,
        )

    def to_fields(self) -> dict[str, ConfigValue]:
        fields: dict[str, ConfigValue] = {
            "run-salt": self.run_salt,
            "parameters-digest": self.parameters_digest,
            "members": list(self.members),
        }
        if self.public_keys:
            fields["peer-keys"] = list(self.public_keys)
        if self.identity_keys:
            fields["identity-keys"] = list(self.identity_keys)
            fields["signatures"] = list(self.signatures)
        if self.codec_clip_range is not None and self.codec_scale is not None:
            fields["codec-clip-range"] = float(self.codec_clip_range)
            fields["codec-scale"] = float(self.codec_scale)
        return fields

    @classmethod
    def from_fields(cls, record: Mapping[str, Any]) -> FPFLKeyTable:
        members = _ints(record, "members", distinct=True)
        count = len(members)
        return cls(
            run_salt=_bytes(record, "run-salt"),
            parameters_digest=_bytes(record, "parameters-digest", DIGEST_BYTES),
            members=members,
            public_keys=_bytes_list(record, "peer-keys", count) if "peer-keys" in record else (),
            identity_keys=(
                _bytes_list(record, "identity-keys", count) if "identity-keys" in record else ()
            ),
            signatures=_bytes_list(record, "signatures", count) if "signatures" in record else (),
            codec_clip_range=_optional_float(record, "codec-clip-range"),
            codec_scale=_optional_float(record, "codec-scale"),
        )


@dataclass(frozen=True)
class FPFLKeysReply:
    """The node pinned the table: the run digest it derived (the server compares it with its
    own, so a node given another view is found at setup)."""

    run_digest: bytes

    def to_fields(self) -> dict[str, ConfigValue]:
        return {"run-digest": self.run_digest}

    @classmethod
    def from_fields(cls, record: Mapping[str, Any]) -> FPFLKeysReply:
        return cls(_bytes(record, "run-digest", DIGEST_BYTES))


# -- a round ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FPFLRoundRequest:
    """``query.fpfl_round``: the round number, the run digest the node pinned (it refuses any
    other), the weights (array :data:`WEIGHTS_ARRAY`) and, in a FairFed run, the node's scale
    (``node-scale`` in [0, 1]: the factor of its clipped sum,
    :func:`~fedparity.mechanisms.fpfl.fairfed.node_scales`; 1 when absent)."""

    round: int
    run_digest: bytes
    weights: NDArray[np.float64] = field(compare=False, repr=False)
    node_scale: float = 1.0

    def __post_init__(self) -> None:
        scale = self.node_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise MessageError("message field 'node-scale' must be a number in [0, 1]")
        if not 0.0 <= float(scale) <= 1.0:  # NaN fails too
            raise MessageError("message field 'node-scale' must be a number in [0, 1]")
        object.__setattr__(self, "node_scale", float(scale))

    def to_fields(self) -> dict[str, ConfigValue]:
        fields: dict[str, ConfigValue] = {"round": self.round, "run-digest": self.run_digest}
        if self.node_scale != 1.0:
            fields["node-scale"] = self.node_scale
        return fields

    @classmethod
    def from_fields(
        cls, record: Mapping[str, Any], arrays: Mapping[str, NDArray[Any]]
    ) -> FPFLRoundRequest:
        weights = arrays.get(WEIGHTS_ARRAY)
        if (
            not isinstance(weights, np.ndarray)
            or weights.ndim != 1
            or weights.dtype.kind != "f"
            or not np.isfinite(weights).all()
        ):
            raise MessageError("message array 'weights' must be a 1-d array of finite floats")
        return cls(
            round=_int(record, "round", 0),
            run_digest=_bytes(record, "run-digest", DIGEST_BYTES),
            weights=np.asarray(weights, dtype=np.float64),
            node_scale=record.get("node-scale", 1.0),
        )


@dataclass(frozen=True)
class FPFLRoundReply:
    """A node's round: with masking the double-masked encoded sum (array
    :data:`MASKED_ARRAY`, uint64), the Shamir shares of its self-mask sealed for each other
    member and their threshold; without masking the sum in the clear (:data:`SUM_ARRAY`)."""

    vector: NDArray[Any] = field(compare=False, repr=False)
    recipients: tuple[int, ...] = ()
    sealed: tuple[bytes, ...] = ()
    threshold: int = 0
    #: A FairFed node's own noisy statistics (array :data:`RELEASE_ARRAY`); None otherwise.
    release: NDArray[np.float64] | None = field(default=None, compare=False, repr=False)

    @property
    def masked(self) -> bool:
        return self.vector.dtype == np.uint64

    def to_fields(self) -> dict[str, ConfigValue]:
        if not self.masked:
            return {}
        return {
            "recipients": list(self.recipients),
            "sealed": list(self.sealed),
            "threshold": self.threshold,
        }

    def array_name(self) -> str:
        return MASKED_ARRAY if self.masked else SUM_ARRAY

    @classmethod
    def from_fields(
        cls,
        record: Mapping[str, Any],
        arrays: Mapping[str, NDArray[Any]],
        *,
        masked: bool,
        vector_size: int,
        release_size: int = 0,
    ) -> FPFLRoundReply:
        """``release_size`` > 0: a FairFed run, whose replies carry the node's release."""
        name, dtype = (MASKED_ARRAY, np.uint64) if masked else (SUM_ARRAY, np.float64)
        vector = arrays.get(name)
        if not isinstance(vector, np.ndarray) or vector.dtype != dtype:
            raise MessageError(f"message array {name!r} must be a {np.dtype(dtype).name} array")
        if vector.shape != (vector_size,):
            raise MessageError(f"message array {name!r} must have shape ({vector_size},)")
        release = None
        if release_size:
            release = arrays.get(RELEASE_ARRAY)
            if (
                not isinstance(release, np.ndarray)
                or release.dtype != np.float64
                or release.shape != (release_size,)
                or not np.isfinite(release).all()
            ):
                raise MessageError(
                    f"message array {RELEASE_ARRAY!r} must hold {release_size} finite float64 "
                    "values"
                )
        if not masked:
            if not np.isfinite(vector).all():
                raise MessageError(f"message array {name!r} must hold finite values")
            return cls(vector, release=release)
        recipients = _ints(record, "recipients", distinct=True)
        return cls(
            vector,
            recipients,
            _bytes_list(record, "sealed", len(recipients)),
            _int(record, "threshold", 2),
            release,
        )


@dataclass(frozen=True)
class FPFLConfirmRequest:
    """``query.fpfl_confirm`` (rounds in which a node dropped): the survivors and the dropped
    nodes the server will unmask the round for. A node attests one such view per round."""

    round: int
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]

    def to_fields(self) -> dict[str, ConfigValue]:
        return {
            "round": self.round,
            "survivors": list(self.survivors),
            "dropped": list(self.dropped),
        }

    @classmethod
    def from_fields(cls, record: Mapping[str, Any]) -> FPFLConfirmRequest:
        return cls(
            _int(record, "round", 0),
            _ints(record, "survivors", distinct=True),
            _ints(record, "dropped", distinct=True),
        )


@dataclass(frozen=True)
class FPFLConfirmReply:
    """The node's attestation of the view, one MAC for each other survivor (keyed with their
    pair secret, :func:`~fedparity.mechanisms.crypto.secure_sum.attest_view`)."""

    recipients: tuple[int, ...]
    attestations: tuple[bytes, ...]

    def to_fields(self) -> dict[str, ConfigValue]:
        return {"recipients": list(self.recipients), "attestations": list(self.attestations)}

    @classmethod
    def from_fields(cls, record: Mapping[str, Any]) -> FPFLConfirmReply:
        recipients = _ints(record, "recipients", distinct=True)
        return cls(recipients, _bytes_list(record, "attestations", len(recipients)))


@dataclass(frozen=True)
class FPFLRevealRequest:
    """``query.fpfl_reveal``: the view (survivors, dropped), the sealed self-mask shares the
    other survivors made for this node, and, when a node dropped, the other survivors'
    attestations of the view addressed to this node."""

    round: int
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    share_senders: tuple[int, ...]
    shares: tuple[bytes, ...]
    attesters: tuple[int, ...] = ()
    attestations: tuple[bytes, ...] = ()

    @classmethod
    def for_node(
        cls,
        round_number: int,
        node: int,
        survivors: Sequence[int],
        dropped: Sequence[int],
        sealed: Mapping[int, Mapping[int, bytes]],
        attestations: Mapping[int, Mapping[int, bytes]],
    ) -> FPFLRevealRequest:
        """The request to ``node``: the shares the other survivors sealed for it
        (``sealed[peer][node]``) and the attestations addressed to it
        (``attestations[attester][node]``)."""
        senders = tuple(peer for peer in survivors if peer != node)
        attesters = tuple(
            peer for peer in sorted(attestations) if peer != node and node in attestations[peer]
        )
        return cls(
            round=round_number,
            survivors=tuple(survivors),
            dropped=tuple(dropped),
            share_senders=senders,
            shares=tuple(sealed[peer][node] for peer in senders),
            attesters=attesters,
            attestations=tuple(attestations[peer][node] for peer in attesters),
        )

    def to_fields(self) -> dict[str, ConfigValue]:
        fields: dict[str, ConfigValue] = {
            "round": self.round,
            "survivors": list(self.survivors),
            "dropped": list(self.dropped),
            "share-senders": list(self.share_senders),
            "shares": list(self.shares),
        }
        if self.attesters:
            fields["attesters"] = list(self.attesters)
            fields["attestations"] = list(self.attestations)
        return fields

    @classmethod
    def from_fields(cls, record: Mapping[str, Any]) -> FPFLRevealRequest:
        senders = _ints(record, "share-senders", distinct=True)
        attesters = _ints(record, "attesters", distinct=True) if "attesters" in record else ()
        return cls(
            round=_int(record, "round", 0),
            survivors=_ints(record, "survivors", distinct=True),
            dropped=_ints(record, "dropped", distinct=True),
            share_senders=senders,
            shares=_bytes_list(record, "shares", len(senders)),
            attesters=attesters,
            attestations=(_bytes_list(record, "attestations", len(attesters)) if attesters else ()),
        )


@dataclass(frozen=True)
class FPFLRevealReply:
    """A survivor's unmask: the shares it holds of the survivors' self-mask seeds, and its pair
    seeds of the round with the dropped nodes."""

    share_owners: tuple[int, ...]
    self_shares: tuple[bytes, ...]
    dropped: tuple[int, ...]
    seeds: tuple[bytes, ...]

    def to_fields(self) -> dict[str, ConfigValue]:
        return {
            "share-owners": list(self.share_owners),
            "self-shares": list(self.self_shares),
            "dropped": list(self.dropped),
            "seeds": list(self.seeds),
        }

    @classmethod
    def from_fields(cls, record: Mapping[str, Any]) -> FPFLRevealReply:
        owners = _ints(record, "share-owners", distinct=True)
        dropped = _ints(record, "dropped", distinct=True)
        return cls(
            owners,
            _bytes_list(record, "self-shares", len(owners)),
            dropped,
            _bytes_list(record, "seeds", len(dropped)),
        )
