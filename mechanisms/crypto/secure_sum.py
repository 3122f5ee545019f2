"""Double-masking secure sum for FPFL training (Bonawitz et al. 2017), pinned and authenticated.

The FPFL training job sums the nodes' clipped statistic vectors; with this module the server
sees only the sum. It is the secure aggregation of Bonawitz et al., "Practical Secure
Aggregation for Privacy-Preserving Machine Learning", CCS 2017 (pairwise masks, a self-mask
per node shared t-of-n, and its PKI variant), arranged so that keys are agreed once per run
and a round costs two exchanges. Pure numpy plus the ``cryptography`` package (X25519, HKDF,
HMAC, ChaCha20, ChaCha20-Poly1305) and the ``shamirs`` package's Shamir secret sharing; no
primitive is written here. The Flower adapters (:mod:`fedparity.clients.fpfl_handlers`,
:mod:`fedparity.strategies.fpfl`) call these functions.

**Why not Flower's SecAgg+.** In Flower 1.41, ``SecAggPlusWorkflow`` only runs inside the
legacy workflow (a ``LegacyContext``, a legacy ``Strategy``, ``FitIns``/``FitRes``), spends
four exchanges per round, has no key authentication either, and seeds its mask generator with
a 32-bit fold of the seed (``np.random.RandomState``). Here keys are pinned for the run (with
an optional roster of signed keys), a round costs two exchanges, and masks come from ChaCha20.

Protocol
--------
1. *Setup (once per run).* Every node makes an X25519 key pair (:class:`MaskingKeyPair`) and
   sends its public key, signed with its identity key when it has one, together with the
   digest of the run parameters it accepted (:func:`masking_key_transcript`;
   :mod:`fedparity.mechanisms.crypto.identity`). The server broadcasts the key table; each node
   checks it (own key present, at most ``max-nodes`` entries, distinct keys; with a roster, every
   key signed by a distinct roster member over the same parameters: :func:`check_signed_key_table`)
   and **pins** it: the pair secrets ``s_uv = HKDF-SHA256(X25519(u, v), salt=run_salt,
   info=label || min id || max id || run digest)`` (:func:`pair_secrets`; RFC 7748, RFC 5869;
   the run digest binds the parameters, members and keys) are the only ones it uses for the
   rest of the run, and any later table is refused.
2. *Round r, masked vectors.* The round's members are a subset of the pinned table. Node
   ``u`` draws a fresh self-mask seed ``b_u`` (:func:`new_self_seed`), splits it into Shamir
   shares with threshold ``t`` (:func:`share_threshold`, :func:`share_self_seed`), seals each
   peer's share (:func:`seal_share`: ChaCha20-Poly1305 under a key derived from the pair
   secret, the round and the direction) and sends ``y_u = enc(x_u) + PRG(b_u) +
   sum_{v > u} m_uvr - sum_{v < u} m_uvr (mod 2^64)`` (:func:`mask_vector`), where the pair
   mask ``m_uvr`` is the ChaCha20 keystream keyed by ``k_uvr = HMAC-SHA256(s_uv, label ||
   r)`` (:func:`round_seed`, :func:`expand_mask`) and ``PRG(b)`` is :func:`self_mask`, with
   the sealed shares and ``t``. A node masks a round number at most once, in increasing
   order.
3. *Round r, unmask.* The server names the survivors ``S`` (vectors received) and the dropped
   ``D``. When ``D`` is not empty every survivor first attests the view ``(S, D)`` to each
   other survivor (:func:`attest_view`, one view per round), and a node reveals only for a view
   :func:`attestation_threshold` members attested (:func:`check_attestations`). The server asks
   every survivor when ``D`` is not empty, else the ``max t_u`` survivors of
   the smallest share indices; each survivor asked opens the shares sealed for it and returns
   the shares of ``b_u`` for ``u`` in ``S`` and its pair seeds ``k_vdr`` for ``d`` in ``D``
   (:func:`reveal_round_seeds`) -- once per round, only for the round it masked last, only
   if ``S`` and ``D`` split that round's members and ``S`` holds at least
   ``max(min-survivors, n_min)`` nodes. The server rebuilds each ``b_u`` from ``t_u`` shares
   (:func:`combine_self_seed`) and removes every mask (:func:`unmask_sum`);
   :meth:`FixedPointCodec.decode` gives the floats.

Fixed point (:class:`FixedPointCodec`, :func:`contribution_codec`): ``enc(x) = rint(x *
scale)`` as int64 viewed as uint64, with a power-of-two scale such that the sum of
``max_nodes`` vectors bounded by ``clip_range`` stays below ``2^52`` (exact in float64, no
wrap-around). Each node derives the range from values it checks itself -- ``R = K b + 12 C
sigma + 1`` for ``K`` users with per-user bound ``b`` -- and refuses a step above ``2^-10`` of
its noise share's std: the server never chooses the quantisation.

Threat model (see also the project's threat-model page)
--------------------------------------------------------
* **Curious server** (follows the protocol, reads everything, keeps late replies): learns only
  the sum of the survivors' vectors. A vector that arrives late, or that the server calls
  malformed, stays hidden by its self-mask: the survivors revealed its pair seeds but no
  share of its self-mask.
* **Active server** (replays, edits, splits views): an honest node answers one unmask request
  per round and attests one view with dropped nodes per round. With the share threshold of
  :func:`share_threshold` (``t + r > n + 1 + c``) no split view gets both ``t`` shares of a
  node's self-mask and every one of its pair seeds, and with the attestations at most one view
  with dropped nodes is unmasked per round, so no set smaller than the survivors is ever
  decoded; replays, pre-reveals and key changes are refused; the quantisation is the node's.
* **What is not protected without a roster.** Keys exchanged without authentication can be
  replaced by a server that is active *at setup*, and a server can invent up to ``max-nodes``
  peers (sybils) whose masks it knows: the honest nodes' privacy then rests on their own noise
  shares. With a roster (node config ``roster``, ``identity-key``) neither is possible; a
  node's policy ``require-roster``, true by default outside simulation, refuses masking
  without one.
* **Colluding nodes.** ``c`` colluders learn nothing of the honest nodes' vectors beyond the
  sum; they do know their own noise shares, so each node sizes its share for ``n_min - c``
  honest survivors (:func:`noise_share_std`). The sum itself is not hidden: its privacy is the
  job of the DP noise.
* **No recovery.** A survivor that fails during the unmask exchange loses the round (it still
  counts as spent privacy).

Everything is deterministic given the keys; only :meth:`MaskingKeyPair.generate` and
:func:`new_self_seed` draw entropy (from the OS).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import shamirs
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..validation import check_int_at_least, check_positive_finite
from .identity import Roster, transcript, verify_signature

__all__ = [
    "KEY_BYTES",
    "MAX_MASKING_NODES",
    "NOISE_RANGE_STDS",
    "SELF_SEED_BYTES",
    "SHAMIR_PRIME",
    "SHARE_BYTES",
    "UNCLIPPED_RANGE",
    "FixedPointCodec",
    "MaskingKeyPair",
    "attest_view",
    "attestation_threshold",
    "check_attestations",
    "reveal_minimum",
    "check_masked_vector",
    "check_signed_key_table",
    "combine_self_seed",
    "contribution_codec",
    "masking_key_transcript",
    "new_self_seed",
    "open_share",
    "seal_share",
    "self_mask",
    "share_self_seed",
    "share_threshold",
    "decode_id_table",
    "encode_id_table",
    "expand_mask",
    "fixed_point_scale",
    "mask_vector",
    "pair_secrets",
    "reveal_round_seeds",
    "round_seed",
    "minimum_survivors",
    "noise_share_std",
    "unmask_sum",
]

#: Length of X25519 public keys, pair secrets and round seeds (bytes).
KEY_BYTES = 32
#: Largest ``max_nodes`` a :class:`FixedPointCodec` accepts.
MAX_MASKING_NODES = 2**32
#: The integer sum stays within +-2^52 (< 2^53: exact in float64; < 2^63: no wrap-around).
SUM_BITS = 52
_UINT64_MAX = 2**64 - 1
_PAIR_LABEL = b"fedparity/secure-sum/v1/pair"
_ROUND_LABEL = b"fedparity/secure-sum/v1/round"
_SELF_LABEL = b"fedparity/secure-sum/v2/self-mask"
_SHARE_LABEL = b"fedparity/secure-sum/v2/share"
_KEY_SIGNATURE_LABEL = "fedparity/secure-sum/v3/masking-key"
_VIEW_LABEL = b"fedparity/secure-sum/v3/view"
#: Length of a view attestation (HMAC-SHA256).
ATTESTATION_BYTES = 32
#: Length of a self-mask seed (bytes): 128 bits from the OS, shared as an integer below
#: :data:`SHAMIR_PRIME`.
SELF_SEED_BYTES = 16
#: The prime field of the self-mask sharing: ``2^130 - 5`` (the Poly1305 prime of RFC 8439),
#: the smallest well-known prime above every 16-byte seed.
SHAMIR_PRIME = 2**130 - 5
_SHARE_INDEX_BYTES = 4
_SHARE_VALUE_BYTES = 17
#: Length of one self-mask share: 4 bytes of index (big-endian) and 17 of value (an element
#: of the field of :data:`SHAMIR_PRIME`, big-endian).
SHARE_BYTES = _SHARE_INDEX_BYTES + _SHARE_VALUE_BYTES
#: A node's noise is clamped by the codec beyond this many standard deviations of the full
#: noise ``C sigma`` (probability < 2e-32 per coordinate): the fixed-point range is finite.
NOISE_RANGE_STDS = 12.0
#: Per-user coordinate bound assumed for the unclipped baselines (FL, FFL): their vectors
#: have no norm bound, but a fixed-point sum needs one; larger values are clamped.
UNCLIPPED_RANGE = 1.0e4


def _check_uint64(name: str, value: int) -> int:
    """An integer in [0, 2^64 - 1] (Flower node ids are uint64)."""
    number = check_int_at_least(name, value, 0)
    if number > _UINT64_MAX:
        raise ValueError(f"{name} must be an integer in [0, 2^64 - 1], got {value!r}")
    return number


def _check_key_bytes(name: str, value: bytes) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)) or len(bytes(value)) != KEY_BYTES:
        described = (
            f"{len(bytes(value))} bytes"
            if isinstance(value, (bytes, bytearray, memoryview))
            else type(value).__name__
        )
        raise ValueError(f"{name} must be {KEY_BYTES} bytes, got {described}")
    return bytes(value)


def _check_ids(name: str, values: Collection[int]) -> frozenset[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Collection):
        raise ValueError(f"{name} must be a collection of node ids, got {type(values).__name__}")
    return frozenset(_check_uint64(f"{name} entry", v) for v in values)


def _check_min_survivors(value: int) -> int:
    return check_int_at_least("min_survivors", value, 2)


def _check_pair_secrets(own_id: int, secrets: Mapping[int, bytes]) -> dict[int, bytes]:
    if not isinstance(secrets, Mapping):
        raise ValueError(f"pair_secrets must be a mapping, got {type(secrets).__name__}")
    checked = {
        _check_uint64("pair_secrets key", peer): _check_key_bytes(f"pair_secrets[{peer}]", secret)
        for peer, secret in secrets.items()
    }
    if own_id in checked:
        raise ValueError(f"pair_secrets must not contain own_id ({own_id})")
    return checked


def _format_ids(ids: Collection[int]) -> str:
    return "[" + ", ".join(str(i) for i in sorted(ids)) + "]"


@dataclass(frozen=True)
class MaskingKeyPair:
    """A node's X25519 key pair for one run (RFC 7748).

    The private key never leaves the node; :meth:`private_bytes` is for the node's own
    state between messages.
    """

    private_key: X25519PrivateKey = field(repr=False)

    @classmethod
    def generate(cls) -> MaskingKeyPair:
        """A fresh key pair from OS entropy."""
        return cls(X25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, data: bytes) -> MaskingKeyPair:
        """The key pair whose raw 32-byte private key is ``data``."""
        return cls(X25519PrivateKey.from_private_bytes(_check_key_bytes("data", data)))

    def private_bytes(self) -> bytes:
        """The raw 32-byte private key (secret: node state only)."""
        return self.private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    def public_bytes(self) -> bytes:
        """The raw 32-byte public key sent to the server."""
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )


def pair_secrets(
    own_id: int,
    own_key: MaskingKeyPair,
    peer_public_keys: Mapping[int, bytes],
    run_salt: bytes,
    *,
    run_digest: bytes = b"",
) -> dict[int, bytes]:
    """``{peer_id: s}``: the 32-byte secret shared with every peer of the broadcast key list.

    ``s = HKDF-SHA256(X25519(own, peer), salt=run_salt, info=label || min id || max id ||
    run_digest)`` (RFC 7748, RFC 5869), the same on both sides. ``peer_public_keys`` may
    contain ``own_id`` (the broadcast list), whose key must then be ``own_key``'s.
    ``run_salt`` (non-empty bytes, e.g. the run id) separates runs; ``run_digest`` binds the
    secrets to what the run agreed (its parameters, members and keys: FPFL's
    ``FPFLKeyTable.run_digest``), so two nodes given different views derive secrets, and masks,
    that do not match. Raises ``ValueError`` for ids outside ``[0, 2^64 - 1]``, keys that are
    not 32 bytes, a key listed twice, or a low-order key.
    """
    own_id = _check_uint64("own_id", own_id)
    if not isinstance(own_key, MaskingKeyPair):
        raise ValueError(f"own_key must be a MaskingKeyPair, got {type(own_key).__name__}")
    if not isinstance(peer_public_keys, Mapping):
        raise ValueError(
            f"peer_public_keys must be a mapping {{node_id: 32-byte key}}, "
            f"got {type(peer_public_keys).__name__}"
        )
    if not isinstance(run_salt, (bytes, bytearray)) or len(run_salt) == 0:
        raise ValueError(f"run_salt must be non-empty bytes, got {run_salt!r}")
    own_public = own_key.public_bytes()
    keys = {
        _check_uint64("peer_public_keys key", node): _check_key_bytes(
            f"peer_public_keys[{node}]", key
        )
        for node, key in peer_public_keys.items()
    }
    if own_id in keys and keys[own_id] != own_public:
        raise ValueError(f"peer_public_keys[{own_id}] (own_id) is not own_key's public key")
    keys[own_id] = own_public
    if len(set(keys.values())) != len(keys):
        raise ValueError("peer_public_keys must hold distinct keys (a key is listed twice)")
    secrets: dict[int, bytes] = {}
    for peer, key in keys.items():
        if peer == own_id:
            continue
        try:
            shared = own_key.private_key.exchange(X25519PublicKey.from_public_bytes(key))
        except ValueError:
            raise ValueError(
                f"peer_public_keys[{peer}] is not a usable X25519 key (low-order point)"
            ) from None
        low, high = sorted((own_id, peer))
        info = _PAIR_LABEL + low.to_bytes(8, "big") + high.to_bytes(8, "big") + bytes(run_digest)
        hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=bytes(run_salt), info=info)
        secrets[peer] = hkdf.derive(shared)
    return secrets


def round_seed(pair_secret: bytes, round_number: int) -> bytes:
    """``HMAC-SHA256(pair_secret, label || round)``: the pair's 32-byte mask seed of a round."""
    secret = _check_key_bytes("pair_secret", pair_secret)
    message = _ROUND_LABEL + _check_uint64("round_number", round_number).to_bytes(8, "big")
    return hmac.new(secret, message, hashlib.sha256).digest()


def expand_mask(seed: bytes, length: int) -> np.ndarray:
    """The mask: ``length`` uint64 read little-endian from the ChaCha20 keystream (RFC 8439)
    with key ``seed`` and an all-zero 16-byte nonce/counter (each seed keys one stream)."""
    key = _check_key_bytes("seed", seed)
    length = check_int_at_least("length", length, 1)
    encryptor = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    stream = encryptor.update(bytes(8 * length))
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64)


def fixed_point_scale(clip_range: float, max_nodes: int) -> float:
    """The largest power of two ``scale`` with ``max_nodes * clip_range * scale <= 2^52``.

    Ring bound: a sum of ``max_nodes`` encodings does not wrap if
    ``max_nodes * clip_range * scale < 2^63``; the stricter ``2^52`` keeps the sum exact in
    float64 and leaves ``2^10`` of margin. The quantisation step is ``1 / scale``.
    """
    clip_range = check_positive_finite("clip_range", clip_range)
    max_nodes = check_int_at_least("max_nodes", max_nodes, 2)
    if max_nodes > MAX_MASKING_NODES:
        raise ValueError(
            f"max_nodes must be an integer in [2, {MAX_MASKING_NODES}], got {max_nodes!r}"
        )
    worst = Fraction(clip_range) * max_nodes
    limit = Fraction(2**SUM_BITS)
    exponent = SUM_BITS - math.ceil(math.log2(max_nodes)) - math.frexp(clip_range)[1]
    while worst * Fraction(2) ** exponent > limit:  # log2 guesses may be off by one
        exponent -= 1
    while worst * Fraction(2) ** (exponent + 1) <= limit:
        exponent += 1
    if exponent > 1022:
        raise ValueError(
            f"clip_range must be >= about 2^-970 / max_nodes (scale 2^{exponent} is not a "
            f"finite float), got {clip_range!r}"
        )
    return math.ldexp(1.0, exponent)


@dataclass(frozen=True)
class FixedPointCodec:
    """Fixed-point encoding of clipped float vectors into uint64 (mod 2^64).

    ``encode(x) = rint(x * scale)`` (deterministic, round half to even) viewed as uint64;
    ``decode`` views a sum as int64 and divides by ``scale``. A sum of ``n <= max_nodes``
    encodings decodes to the float sum within :meth:`error_bound` ``(n) = n * 0.5 * step``.

    Attributes
    ----------
    clip_range : float
        Every coordinate satisfies ``|x_i| <= clip_range`` (the caller clips).
    max_nodes : int
        Most vectors in one sum, in ``[2, 2^32]``.
    scale : float
        :func:`fixed_point_scale` ``(clip_range, max_nodes)``, a power of two.
    """

    clip_range: float
    max_nodes: int
    scale: float = field(init=False)

    def __post_init__(self) -> None:
        scale = fixed_point_scale(self.clip_range, self.max_nodes)
        object.__setattr__(self, "clip_range", float(self.clip_range))
        object.__setattr__(self, "max_nodes", int(self.max_nodes))
        object.__setattr__(self, "scale", scale)

    @property
    def step(self) -> float:
        """The quantisation step ``1 / scale``."""
        return 1.0 / self.scale

    @property
    def sum_limit(self) -> int:
        """``max_nodes * rint(clip_range * scale)``: the largest ``|sum|`` of encodings."""
        return self.max_nodes * int(np.rint(self.clip_range * self.scale))

    def error_bound(self, num_nodes: int) -> float:
        """``num_nodes * 0.5 * step``: the largest ``|decode(sum) - float sum|``."""
        num_nodes = check_int_at_least("num_nodes", num_nodes, 1)
        return num_nodes * 0.5 * self.step

    def encode(self, values: np.ndarray) -> np.ndarray:
        """A 1-D float vector with ``|x_i| <= clip_range`` as a uint64 vector."""
        array = np.asarray(values, dtype=np.float64)
        if array.ndim != 1 or array.size == 0:
            raise ValueError(f"values must be a non-empty 1-D array, got shape {array.shape}")
        if not np.all(np.isfinite(array)):
            raise ValueError("values must be finite (found NaN or infinity)")
        beyond = np.flatnonzero(np.abs(array) > self.clip_range)
        if beyond.size:
            raise ValueError(
                f"values must be in [-clip_range, clip_range] = [{-self.clip_range!r}, "
                f"{self.clip_range!r}] (clip first); found {float(array[beyond[0]])!r}"
            )
        return np.rint(array * self.scale).astype(np.int64).view(np.uint64)

    def decode(self, total: np.ndarray) -> np.ndarray:
        """The float vector of an unmasked sum of at most ``max_nodes`` encodings.

        Raises ``ValueError`` if a coordinate exceeds :attr:`sum_limit` in magnitude: the
        input is then not such a sum (masks left in, or too many nodes).
        """
        array = check_masked_vector(total, name="total")
        signed = array.view(np.int64)
        limit = self.sum_limit
        bad = np.flatnonzero((signed > limit) | (signed < -limit))
        if bad.size:
            raise ValueError(
                f"total is not a sum of at most max_nodes={self.max_nodes} encoded vectors: "
                f"|coordinate {bad[0]}| > {limit} (masks left in, or too many nodes)"
            )
        return signed.astype(np.float64) / self.scale


def check_masked_vector(
    vector: np.ndarray, length: int | None = None, name: str = "vector"
) -> np.ndarray:
    """A 1-D uint64 array (of ``length`` entries if given), as a native-order copy.

    Masked vectors travel as Flower ``Array``s of dtype uint64; this validates a received one.
    """
    if not isinstance(vector, np.ndarray) or vector.dtype.kind != "u" or vector.itemsize != 8:
        described = (
            f"{vector.dtype} array" if isinstance(vector, np.ndarray) else type(vector).__name__
        )
        raise ValueError(f"{name} must be a uint64 numpy array, got {described}")
    if vector.ndim != 1 or vector.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {vector.shape}")
    if length is not None and vector.size != length:
        raise ValueError(f"{name} must have length {length}, got {vector.size}")
    return np.ascontiguousarray(vector, dtype=np.uint64).copy()


def mask_vector(
    encoded: np.ndarray,
    own_id: int,
    pair_secrets: Mapping[int, bytes],
    round_number: int,
    *,
    cohort: Collection[int] | None = None,
    self_seed: bytes | None = None,
) -> np.ndarray:
    """``enc + PRG(b) + sum_{v > u} m_uvr - sum_{v < u} m_uvr (mod 2^64)`` over the round's
    peers.

    ``cohort`` (the round's participants, containing ``own_id``) restricts the peers; by
    default every node of ``pair_secrets``. ``self_seed`` ``b`` adds the self-mask of double
    masking (:func:`self_mask`; Bonawitz et al. 2017): the vector then stays hidden even from
    a server that obtains every pair seed of the node. Refuses (``ValueError``) to send a
    vector with no peer to mask it, or with a cohort member it holds no pair secret for.

    References
    ----------
    .. [1] K. Bonawitz, V. Ivanov, B. Kreuter, A. Marcedone, H. B. McMahan, S. Patel,
           D. Ramage, A. Segal and K. Seth, "Practical Secure Aggregation for
           Privacy-Preserving Machine Learning", ACM CCS 2017 (pairwise masks and the
           self-mask of its double masking).
    """
    own_id = _check_uint64("own_id", own_id)
    vector = check_masked_vector(encoded, name="encoded")
    secrets = _check_pair_secrets(own_id, pair_secrets)
    round_number = _check_uint64("round_number", round_number)
    if cohort is None:
        peers = frozenset(secrets)
    else:
        members = _check_ids("cohort", cohort)
        if own_id not in members:
            raise ValueError(f"cohort must contain own_id ({own_id})")
        peers = members - {own_id}
        unknown = peers - secrets.keys()
        if unknown:
            raise ValueError(f"cohort holds nodes without a pair secret: {_format_ids(unknown)}")
    if not peers:
        raise ValueError("the round has no peer to mask with (need at least 2 nodes)")
    if self_seed is not None:
        vector += self_mask(self_seed, vector.size)
    for peer in sorted(peers):
        mask = expand_mask(round_seed(secrets[peer], round_number), vector.size)
        if peer > own_id:
            vector += mask
        else:
            vector -= mask
    return vector


def reveal_round_seeds(
    own_id: int,
    pair_secrets: Mapping[int, bytes],
    round_number: int,
    dropped: Collection[int],
    survivors: Collection[int],
    *,
    min_survivors: int = 2,
) -> dict[int, bytes]:
    """``{d: k_udr}``: this round's seeds with the dropped nodes, for :func:`unmask_sum`.

    Refuses (``ValueError``) unless ``own_id`` is a survivor, ``dropped`` and ``survivors``
    are disjoint sets of known peers, and there are at least ``min_survivors`` (>= 2)
    survivors: revealing all of a lone survivor's seeds would unmask its vector. These
    checks stop an erring server, not a lying one (see the module's threat model).
    """
    own_id = _check_uint64("own_id", own_id)
    secrets = _check_pair_secrets(own_id, pair_secrets)
    round_number = _check_uint64("round_number", round_number)
    dropped_ids = _check_ids("dropped", dropped)
    survivor_ids = _check_ids("survivors", survivors)
    min_survivors = _check_min_survivors(min_survivors)
    if own_id not in survivor_ids:
        raise ValueError(f"survivors must contain own_id ({own_id}): reveal only as a survivor")
    overlap = dropped_ids & survivor_ids
    if overlap:
        raise ValueError(
            f"dropped and survivors must be disjoint; refusing to reveal seeds with "
            f"surviving nodes {_format_ids(overlap)}"
        )
    unknown = (dropped_ids | survivor_ids) - secrets.keys() - {own_id}
    if unknown:
        raise ValueError(f"dropped/survivors hold unknown nodes: {_format_ids(unknown)}")
    if len(survivor_ids) < min_survivors:
        raise ValueError(
            f"survivors must hold at least min_survivors={min_survivors} nodes, got "
            f"{len(survivor_ids)}: refusing to reveal (a sum of so few vectors could expose one)"
        )
    return {peer: round_seed(secrets[peer], round_number) for peer in sorted(dropped_ids)}


def unmask_sum(
    masked_vectors: Mapping[int, np.ndarray],
    revealed: Mapping[tuple[int, int], bytes],
    round_number: int,
    length: int,
    *,
    participants: Collection[int],
    min_survivors: int = 2,
    self_seeds: Mapping[int, bytes] | None = None,
) -> np.ndarray:
    """Server side: the uint64 sum of the survivors' encodings (decode with the codec).

    ``self_seeds`` (``{survivor: b}``, rebuilt with :func:`combine_self_seed`) removes the
    survivors' self-masks; it must then name exactly the survivors.

    Adds ``masked_vectors`` (``{survivor: y}``) modulo ``2^64`` and removes the leftover
    masks of every (survivor, dropped) pair with the sign convention of :func:`mask_vector`.
    ``participants`` is the round's cohort; the dropped nodes are the participants without
    a masked vector. ``revealed`` must hold ``{(survivor, dropped): seed}`` for exactly those
    pairs (the reveals of round ``round_number``). Raises ``ValueError`` otherwise, or with
    fewer than ``min_survivors`` vectors. The unmasking of Bonawitz et al. 2017 (reference at
    :func:`mask_vector`).
    """
    if not isinstance(masked_vectors, Mapping):
        raise ValueError(
            f"masked_vectors must be a mapping {{node_id: uint64 vector}}, "
            f"got {type(masked_vectors).__name__}"
        )
    if not isinstance(revealed, Mapping):
        raise ValueError(
            f"revealed must be a mapping {{(survivor, dropped): seed}}, "
            f"got {type(revealed).__name__}"
        )
    round_number = _check_uint64("round_number", round_number)
    length = check_int_at_least("length", length, 1)
    members = _check_ids("participants", participants)
    min_survivors = _check_min_survivors(min_survivors)
    vectors = {
        _check_uint64("masked_vectors key", node): check_masked_vector(
            vector, length, name=f"masked_vectors[{node}]"
        )
        for node, vector in masked_vectors.items()
    }
    survivors = frozenset(vectors)
    outsiders = survivors - members
    if outsiders:
        raise ValueError(f"masked_vectors from non-participants: {_format_ids(outsiders)}")
    if len(survivors) < min_survivors:
        raise ValueError(
            f"masked_vectors must hold at least min_survivors={min_survivors} vectors, got "
            f"{len(survivors)}"
        )
    dropped = members - survivors
    needed = {(s, d) for s in survivors for d in dropped}
    given: dict[tuple[int, int], bytes] = {}
    for pair, seed in revealed.items():
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError(f"revealed keys must be (survivor, dropped) pairs, got {pair!r}")
        key = (_check_uint64("survivor id", pair[0]), _check_uint64("dropped id", pair[1]))
        given[key] = _check_key_bytes(f"revealed[{key}]", seed)
    missing, extra = needed - given.keys(), given.keys() - needed
    if missing:
        raise ValueError(f"revealed lacks the seeds of (survivor, dropped) {sorted(missing)}")
    if extra:
        raise ValueError(f"revealed holds pairs that are not (survivor, dropped): {sorted(extra)}")
    total = np.zeros(length, dtype=np.uint64)
    for node in sorted(vectors):
        total += vectors[node]
    if self_seeds is not None:
        if set(self_seeds) != set(survivors):
            raise ValueError("self_seeds must hold exactly the survivors' seeds")
        for node in sorted(self_seeds):
            total -= self_mask(self_seeds[node], length)
    for (survivor, gone), seed in sorted(given.items()):
        mask = expand_mask(seed, length)
        if gone > survivor:  # the survivor added this mask
            total -= mask
        else:
            total += mask
    return total


# -- double masking (Bonawitz et al. 2017, Section 4: self-masks with t-of-n shares) ----------


def new_self_seed() -> bytes:
    """A fresh 16-byte self-mask seed from OS entropy (one per node and round)."""
    return secrets.token_bytes(SELF_SEED_BYTES)


def self_mask(seed: bytes, length: int) -> np.ndarray:
    """The self-mask ``PRG(b)``: the ChaCha20 keystream (RFC 8439) keyed by
    ``HKDF-SHA256(b, info=label)`` read as ``length`` little-endian uint64."""
    seed = _check_seed(seed)
    key = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=_SELF_LABEL).derive(
        seed
    )
    return expand_mask(key, length)


def _check_seed(seed: bytes) -> bytes:
    if not isinstance(seed, (bytes, bytearray)) or len(seed) != SELF_SEED_BYTES:
        raise ValueError(f"self-mask seed must be {SELF_SEED_BYTES} bytes")
    return bytes(seed)


def share_threshold(
    num_members: int, *, min_survivors: int, noise_survivors: int = 0, colluders: int = 0
) -> int:
    """``t``: how many shares rebuild a self-mask seed,
    ``max(r, n + 2 + c - r, c + 2)`` with ``r = max(min_survivors, n_min, 2)`` the fewest
    survivors a node reveals anything for (:func:`reveal_minimum`).

    The server unmasks a vector only with its self-mask (``t`` shares, given by nodes told the
    owner survived) *and* every pair seed of its owner (given by each other member told it
    dropped, or by the owner for the members it is told dropped). An honest node answers one
    unmask request per round. Telling the owner "survivors {owner} + A, dropped B" (it needs
    ``1 + |A| + c >= r``), the nodes of A "the owner dropped" and those of B "nobody dropped"
    yields ``1 + |B| + c`` shares; with ``|A| + |B| + c = n - 1`` the attack needs
    ``t + r <= n + 1 + c``. Hence ``t + r > n + 1 + c`` (security review of 2026-11-26, H1),
    with or without noise (``noise_survivors`` is ``n_min`` in both cases), and ``t >= c + 2``
    keeps the self-mask of a node called dropped by everyone hidden. Larger split views are
    stopped by the view attestations (:func:`attest_view`). ``t`` never exceeds the round's
    members (``ValueError``: the round could never be unmasked).
    """
    members = check_int_at_least("num_members", num_members, 1)
    colluders = check_int_at_least("colluders", colluders, 0)
    needed = reveal_minimum(min_survivors, noise_survivors)
    threshold = max(needed, members + 2 + colluders - needed, colluders + 2)
    if threshold > members:
        raise ValueError(
            f"a round of {members} member(s) cannot be unmasked with a share threshold of "
            f"{threshold} (min-survivors and n_min: {needed}; tolerated colluders: {colluders})"
        )
    return threshold


def reveal_minimum(min_survivors: int, noise_survivors: int = 0) -> int:
    """``r = max(min_survivors, n_min, 2)``: the fewest survivors for which a node reveals its
    pair seeds and self-mask shares (``n_min``: :func:`minimum_survivors`, whose noise shares
    add up to the accounted noise)."""
    return max(int(min_survivors), int(noise_survivors), 2)


def attestation_threshold(num_members: int, needed: int, colluders: int = 0) -> int:
    """How many distinct members must attest a view with dropped nodes before a node reveals
    anything for it: ``max(r, floor((n + c) / 2) + 1)``.

    An honest node attests one such view per round (:func:`attest_view`), the ``c`` colluders
    may attest any: two different views would need ``2 a <= n + c`` attestations, so with
    ``2 a > n + c`` at most one view with dropped nodes is unmasked per round (the consistency
    check of Bonawitz et al. 2017, Section 4, with pairwise MACs in place of signatures)."""
    return max(int(needed), (int(num_members) + int(colluders)) // 2 + 1)


def _view_bytes(survivors: Collection[int], dropped: Collection[int]) -> bytes:
    survivor_ids = sorted(_check_ids("survivors", survivors))
    dropped_ids = sorted(_check_ids("dropped", dropped))
    return transcript(
        "view",
        len(survivor_ids),
        *survivor_ids,
        len(dropped_ids),
        *dropped_ids,
    )


def attest_view(
    pair_secret: bytes,
    round_number: int,
    sender: int,
    receiver: int,
    survivors: Collection[int],
    dropped: Collection[int],
) -> bytes:
    """``sender``'s attestation, for ``receiver``, that round ``round_number`` is unmasked
    for ``survivors`` with ``dropped`` gone: HMAC-SHA256 under a key derived from their pair
    secret, the round and the direction (so the server can neither forge one nor turn the
    receiver's own attestation back on it)."""
    key = hmac.new(
        _check_key_bytes("pair_secret", pair_secret),
        _VIEW_LABEL
        + _check_uint64("round_number", round_number).to_bytes(8, "big")
        + _check_uint64("sender", sender).to_bytes(8, "big")
        + _check_uint64("receiver", receiver).to_bytes(8, "big"),
        hashlib.sha256,
    ).digest()
    return hmac.new(key, _view_bytes(survivors, dropped), hashlib.sha256).digest()


def check_attestations(
    own_id: int,
    pair_secrets: Mapping[int, bytes],
    round_number: int,
    survivors: Collection[int],
    dropped: Collection[int],
    attestations: Mapping[int, bytes],
) -> int:
    """How many distinct peers' ``attestations`` (``{sender: MAC}``, addressed to ``own_id``)
    are valid for exactly this view; an invalid or foreign one counts for nothing."""
    valid = 0
    for sender, mac in attestations.items():
        secret = pair_secrets.get(sender)
        if secret is None or sender == own_id or sender not in survivors:
            continue
        expected = attest_view(secret, round_number, sender, own_id, survivors, dropped)
        if isinstance(mac, bytes | bytearray) and hmac.compare_digest(expected, bytes(mac)):
            valid += 1
    return valid


def share_self_seed(seed: bytes, members: Collection[int], threshold: int) -> dict[int, bytes]:
    """``{member: share}``: Shamir ``threshold``-of-``n`` shares of ``seed`` for the round's
    sorted members (Shamir, "How to share a secret", CACM 1979, over the prime field of
    :data:`SHAMIR_PRIME`; the ``shamirs`` package, whose coefficients come from
    ``secrets``). Share ``i`` (index ``i``, from 1) goes to the ``i``-th member; each is
    :data:`SHARE_BYTES` long."""
    seed = _check_seed(seed)
    ids = sorted(_check_ids("members", members))
    threshold = check_int_at_least("threshold", threshold, 2)
    if threshold > len(ids):
        raise ValueError(f"threshold must be at most the {len(ids)} members, got {threshold}")
    shares = shamirs.shares(
        int.from_bytes(seed, "big"),
        quantity=len(ids),
        modulus=SHAMIR_PRIME,
        threshold=threshold,
        compact=True,
    )
    return {
        member: share.index.to_bytes(_SHARE_INDEX_BYTES, "big")
        + share.value.to_bytes(_SHARE_VALUE_BYTES, "big")
        for member, share in zip(ids, shares, strict=True)
    }


def combine_self_seed(shares: Collection[bytes], threshold: int) -> bytes:
    """The seed rebuilt from ``threshold`` distinct shares of :func:`share_self_seed` split
    with that threshold (Lagrange interpolation at 0, ``shamirs.interpolate``).

    Of more shares, the ``threshold`` with the smallest indices are used, so the result does
    not depend on which further shares arrived. ``ValueError`` for a malformed share, fewer
    than ``threshold`` shares, or shares that interpolate to no 16-byte seed (inconsistent
    shares, e.g. of another sharing)."""
    threshold = check_int_at_least("threshold", threshold, 2)
    points: dict[int, int] = {}
    for share in shares:
        if not isinstance(share, (bytes, bytearray)) or len(share) != SHARE_BYTES:
            raise ValueError(f"a share must be {SHARE_BYTES} bytes")
        index = int.from_bytes(bytes(share[:_SHARE_INDEX_BYTES]), "big")
        value = int.from_bytes(bytes(share[_SHARE_INDEX_BYTES:]), "big")
        if index < 1 or index in points:
            raise ValueError("shares must have distinct indices >= 1")
        if value >= SHAMIR_PRIME:
            raise ValueError("a share's value must be below the field's prime")
        points[index] = value
    if len(points) < threshold:
        raise ValueError(
            f"a seed shared with threshold {threshold} needs {threshold} shares, got {len(points)}"
        )
    smallest = sorted(points.items())[:threshold]
    seed = shamirs.interpolate(
        [shamirs.share(index, value) for index, value in smallest],
        modulus=SHAMIR_PRIME,
        threshold=threshold,
    )
    if seed >= 1 << (8 * SELF_SEED_BYTES):
        raise ValueError("the shares do not rebuild a seed (inconsistent shares)")
    return seed.to_bytes(SELF_SEED_BYTES, "big")


def _share_cipher(pair_secret: bytes, round_number: int, sender: int, receiver: int) -> bytes:
    info = (
        _SHARE_LABEL
        + _check_uint64("round_number", round_number).to_bytes(8, "big")
        + _check_uint64("sender", sender).to_bytes(8, "big")
        + _check_uint64("receiver", receiver).to_bytes(8, "big")
    )
    secret = _check_key_bytes("pair_secret", pair_secret)
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


def seal_share(
    pair_secret: bytes, round_number: int, sender: int, receiver: int, share: bytes
) -> bytes:
    """``share`` encrypted and authenticated for ``receiver`` (ChaCha20-Poly1305, RFC 8439):
    the key is derived from the pair secret, the round and the direction, so it is used once
    and the all-zero nonce is safe; the server that relays it can neither read nor alter it."""
    key = _share_cipher(pair_secret, round_number, sender, receiver)
    return ChaCha20Poly1305(key).encrypt(bytes(12), bytes(share), None)


def open_share(
    pair_secret: bytes, round_number: int, sender: int, receiver: int, sealed: bytes
) -> bytes:
    """The share :func:`seal_share` sealed; ``ValueError`` if it was altered, replayed from
    another round or pair, or not sealed for this receiver."""
    key = _share_cipher(pair_secret, round_number, sender, receiver)
    try:
        return ChaCha20Poly1305(key).decrypt(bytes(12), bytes(sealed), None)
    except (InvalidTag, TypeError, ValueError):
        raise ValueError(
            "a sealed share does not open (altered, replayed or misaddressed)"
        ) from None


def masking_key_transcript(
    run_salt: bytes, node_id: int, public_key: bytes, parameters_digest: bytes = b""
) -> bytes:
    """What a node's identity key signs about its masking key: the run, the node, the key and
    the digest of the run parameters it accepted (so a node's key cannot be presented to
    peers that were shown other parameters)."""
    return transcript(
        _KEY_SIGNATURE_LABEL,
        bytes(run_salt),
        _check_uint64("node_id", node_id),
        _check_key_bytes("public_key", public_key),
        bytes(parameters_digest),
    )


def check_signed_key_table(
    run_salt: bytes,
    public_keys: Mapping[int, bytes],
    identity_keys: Mapping[int, bytes],
    signatures: Mapping[int, bytes],
    roster: Roster,
    parameters_digest: bytes = b"",
) -> None:
    """Refuse (``ValueError``, fixed text) a key table unless every masking key is signed, for
    this run, node id and run parameters, by a distinct member of ``roster`` (authenticated
    key agreement: the server can neither substitute a key nor invent a peer, nor show peers
    other parameters)."""
    if set(identity_keys) != set(public_keys) or set(signatures) != set(public_keys):
        raise ValueError("the key table lacks an identity key or signature for some node")
    if len({bytes(key) for key in identity_keys.values()}) != len(identity_keys):
        raise ValueError("two nodes of the key table claim the same identity")
    for node, key in public_keys.items():
        identity = bytes(identity_keys[node])
        if identity not in roster:
            raise ValueError("a node of the key table is not on this node's roster")
        if not verify_signature(
            identity,
            signatures[node],
            masking_key_transcript(run_salt, node, key, parameters_digest),
        ):
            raise ValueError("a masking key of the key table is not signed by its node")


def contribution_codec(
    *, per_user_bound: float | None, population_size: int, noise_std: float, num_nodes: int
) -> FixedPointCodec:
    """The fixed-point codec of a round, derived by every node from values it checks itself
    (never a range the server sends): a node's sum of at most ``K`` users with per-coordinate
    bound ``b`` plus noise, ``R = K b + 12 C sigma + 1`` (``noise_std = C sigma``, the full
    noise's std, which bounds any share's; beyond 12 stds has probability < 2e-32), for a sum
    of ``num_nodes`` vectors. ``per_user_bound`` None (the unclipped baselines FL and FFL,
    whose vectors have no bound) assumes :data:`UNCLIPPED_RANGE`; larger values are clamped."""
    per_user_bound = check_positive_finite(
        "per_user_bound", UNCLIPPED_RANGE if per_user_bound is None else per_user_bound
    )
    population_size = check_int_at_least("population_size", population_size, 1)
    if not math.isfinite(noise_std) or noise_std < 0:
        raise ValueError(f"noise_std must be a finite number >= 0, got {noise_std!r}")
    limit = population_size * per_user_bound + NOISE_RANGE_STDS * noise_std + 1.0
    return FixedPointCodec(clip_range=limit, max_nodes=max(2, int(num_nodes)))


def encode_id_table(table: Mapping[int, bytes]) -> np.ndarray:
    """``{node_id: 32 bytes}`` (public keys, revealed seeds) as a ``(k, 5)`` uint64 array:
    column 0 the id, columns 1-4 the bytes read little-endian (a Flower ``Array``)."""
    if not isinstance(table, Mapping):
        raise ValueError(f"table must be a mapping {{node_id: bytes}}, got {type(table).__name__}")
    rows = np.zeros((len(table), 1 + KEY_BYTES // 8), dtype=np.uint64)
    for row, node in enumerate(sorted(table)):
        rows[row, 0] = _check_uint64("table key", node)
        data = _check_key_bytes(f"table[{node}]", table[node])
        rows[row, 1:] = np.frombuffer(data, dtype="<u8")
    return rows


def decode_id_table(array: np.ndarray) -> dict[int, bytes]:
    """The mapping held by an array made by :func:`encode_id_table` (ids must be distinct)."""
    width = 1 + KEY_BYTES // 8
    if not isinstance(array, np.ndarray) or array.dtype.kind != "u" or array.itemsize != 8:
        raise ValueError("array must be a uint64 numpy array made by encode_id_table")
    if array.ndim != 2 or array.shape[1] != width:
        raise ValueError(f"array must have shape (k, {width}), got {array.shape}")
    table = {
        int(row[0]): np.asarray(row[1:], dtype="<u8").tobytes() for row in array.astype(np.uint64)
    }
    if len(table) != array.shape[0]:
        raise ValueError("array must hold distinct node ids")
    return table


# -- distributed noise ------------------------------------------------------------------


def minimum_survivors(num_nodes: int, dropout_tolerance: float) -> int:
    """``n_min = ceil((1 - rho) n)`` (at least 1): the fewest nodes whose noise shares still
    add up to the full noise of FPFL's Algorithm 1 (see :func:`noise_share_std`)."""
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be an integer >= 1, got {num_nodes!r}")
    if not 0.0 <= dropout_tolerance < 1.0:
        raise ValueError(f"dropout_tolerance must be in [0, 1), got {dropout_tolerance!r}")
    return max(1, math.ceil((1.0 - dropout_tolerance) * num_nodes - 1e-9))


def noise_share_std(clipping_bound: float, noise_multiplier: float, min_contributors: int) -> float:
    """Std of one node's Gaussian noise share (distributed noise):
    ``C sigma / sqrt(n_min)``.

    Algorithm 1 of FPFL (Rodriguez-Galvez et al. 2021) adds ``N(0, C^2 sigma^2 I)`` to the
    cohort's sum. Independent Gaussian shares add their variances, so any ``k >= n_min``
    shares of variance ``C^2 sigma^2 / n_min`` sum to ``N(0, k C^2 sigma^2 / n_min)``, at
    least the noise of Algorithm 1 (exactly it for ``k = n_min``; over-provisioned by
    ``k / n_min`` otherwise). Source: the noise of FPFL's Algorithm 1 [1]_ and the
    additivity of independent Gaussian variances; the secure sum (this module) refuses to
    open a sum of fewer than ``n_min`` shares.

    Parameters
    ----------
    clipping_bound : float
        ``C`` (> 0), the per-user L2 bound.
    noise_multiplier : float
        ``sigma`` (>= 0), from the accountant.
    min_contributors : int
        ``n_min`` (>= 1), the fewest shares a readable sum can hold
        (:func:`minimum_survivors`).

    References
    ----------
    .. [1] B. Rodriguez-Galvez, F. Granqvist, R. van Dalen and M. Seigel, "Enforcing
           fairness in private federated learning via the modified method of differential
           multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning,
           arXiv:2109.08604, 2021. Algorithm 1.

    Examples
    --------
    >>> noise_share_std(2.0, 1.5, 4)
    1.5
    """
    if not math.isfinite(clipping_bound) or clipping_bound <= 0:
        raise ValueError(f"clipping_bound must be a finite number > 0, got {clipping_bound!r}")
    if not math.isfinite(noise_multiplier) or noise_multiplier < 0:
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    min_contributors = check_int_at_least("min_contributors", min_contributors, 1)
    return clipping_bound * noise_multiplier / math.sqrt(min_contributors)
