"""CKKS encryption layer of FedEvalFair (paper 003, Algorithms 1-2; SPEC 2, 2.2).

Pure numpy + TenSEAL (no Flower import): the Flower handlers call these functions.

Threat model (SPEC 2.2)
-----------------------
* **Server**: honest-but-curious. It holds only the *public* TenSEAL context (no secret key;
  :func:`load_public_context` refuses a file that has one and :func:`add_ciphertexts` refuses
  a context that has one). It receives ciphertexts, adds them and forwards the sums; the only
  plaintext it ever receives is the aggregate vector that the key holders release in round 3.
* **Key holders**: the clients (one secret context shared by all of them, provisioned out of
  band, see :func:`secret_context_path`) or a separate key authority holding the same file.
  TenSEAL has no threshold decryption: a server that colludes with *one* key holder can decrypt
  every ciphertext it received. Transport encryption (TLS) must keep clients from reading
  each other's uploads; the server never forwards an individual ciphertext, only sums.

Protocol (at most three communication rounds; one ciphertext per client per round)
----------------------------------------------------------------------------------
1. Every client encrypts its contribution vector ``c_i`` plus a count slot ``1.0``
   (``[c_i, 1]``) into ONE CKKS ciphertext. The server adds the valid ones: ``S1``.
2. The server sends ``S1`` and the number of ciphertexts it accepted. Every client decrypts
   ``S1``, checks it (finite, sane magnitude, count slot = accepted count), computes its
   round-2 term ``t_i = term_fn(S1, c_i)`` and encrypts ``[t_i, c_i, 1]`` -- the term *and a
   fresh copy of its contribution*, batched into ONE ciphertext. The server adds: ``S2``.
3. The server sends ``S1`` and ``S2`` (and their accepted counts) to the key holders, who
   decrypt and check both and release ``release_fn(DecryptedSums)`` in plaintext. The server
   checks that all key holders agree (to ``agreement_tolerance``) and computes the report
   (p-values) from the released aggregates. ``release_fn`` decides what the server learns:
   the default releases the round-2 sums; a release of only the test statistics and their
   degrees of freedom (e.g. ``[Q, W*, k]``) gives the SPEC 2 minimum.

Dropouts between rounds
-----------------------
A client that drops between rounds 1 and 2 has its contribution in ``S1`` but no term in
``S2``: round-2 terms computed from ``S1`` then refer to a different set of clients than the
one that takes part in round 2. Subtracting its contribution is impossible without it, and
repeating round 1 costs a fourth round. Instead, round-2 messages carry a fresh copy of the
contribution, so ``S2`` holds exact sums over the round-2 set ``R2``; the count slots of
``S1`` and ``S2`` tell whether the set changed (``R2`` is always a subset of ``R1``). The
key holders, who know ``S1``, correct the terms. For centred terms this is exact:
``sum_R2 w (y - c)^2 = sum_R2 w (y - mu_R2)^2 + W_R2 (mu_R2 - c)^2`` for any reference ``c``
(here ``c`` comes from ``S1``), so Cochran's Q over ``R2`` = term sum - ``W_R2 (mu_R2 - c)^2``.
Terms that cannot be corrected (the paper's ``T1`` with ``1 / (1 - w_i / W)``) need the same
set in both rounds: the default :func:`release_sums` raises :class:`StaleReferenceError` when
the set changed, and the caller reruns the protocol. A client that drops between rounds 2 and
3 changes nothing (its term and contribution are both in ``S2``); it just cannot be a key
holder. Every round needs at least ``min_clients`` (default 2) clients, so that no released
sum is one client's value. The key holders must not release ``S1`` when the set changed:
``S1 - S2`` (contribution part) would be the dropped clients' contributions.

What the server cannot detect, and the count slot
-------------------------------------------------
:func:`add_ciphertexts` rejects payloads that do not parse, are not a single fresh CKKS
ciphertext of the public context's parameters (degree, moduli, level, scale; BFV vectors,
tensors, transparent ciphertexts) or have a different slot count. It cannot tell a
ciphertext encrypted under *another secret key with the same parameters*: it parses and adds
fine, and the sum decrypts to garbage (|values| around 1e29-1e31 at the default
parameters). The defence
is applied after decryption: every message carries a count slot ``1.0``; the decrypted count
must equal the number of accepted ciphertexts to ``count_tolerance`` (1e-3)
(:func:`check_count_slot`), and every decrypted value must be finite and within
``max_magnitude`` (:func:`check_magnitude`). A failed check raises a
:class:`DecryptionCheckError`; nothing derived from that sum is released. These checks catch
broken or foreign-key ciphertexts, not a client that lies about its own statistics (outside
the honest-but-curious model).

Precision
---------
CKKS decryption is approximate with an *absolute* error per slot: about 1e-8 for sums of
hundreds of O(1) values at scale 2^40, growing with the largest magnitude in the same
ciphertext (double-precision decoding: about 2e-16 times it, so 1e-6 in every slot when one
slot holds 1e10). With weights ``1 / S^2`` of 1e4-1e6 summed over 1000 clients (1e9) the
error is about 1e-7 absolute, 1e-10 relative on Cochran's Q; measured p-value errors are
at most 1e-9 for k = 10..1000 (benchmarks/results/fedevalfair_protocol.md). Small statistics
must not come from cancelling large decrypted sums (``sum w y^2 - (sum w y)^2 / sum w``): the
round-2 terms compute them as sums of small non-negative per-client terms. Keep slot values
below ~1e10 (rescale by a public constant if needed) for the 1e-6 target.

Integration notes
-----------------
TenSEAL objects (contexts, vectors) cannot be pickled: Flower messages carry the serialized
bytes as uint8 arrays (:func:`to_array` / :func:`from_array`). Loading a context takes about
40 ms; contexts are loaded with ``n_threads=1`` (CKKS vectors do not use TenSEAL's thread
pool, and one pool per simulated client would oversubscribe the machine). TenSEAL does not
document sharing one context between threads: load one per thread or guard it with a lock.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import tenseal as ts

#: Maximum total coefficient-modulus bits log2(q) per polynomial modulus degree N for 128-bit
#: classical security with a ternary secret: HomomorphicEncryption.org Security Standard
#: (Albrecht et al., 2018), Table 1; SEAL's ``SEAL_HE_STD_PARMS_128_TC`` uses the same values.
MAX_COEFF_MODULUS_BITS_128: Mapping[int, int] = {
    1024: 27,
    2048: 54,
    4096: 109,
    8192: 218,
    16384: 438,
    32768: 881,
}
#: Classical security level (bits) every accepted parameter set reaches.
SECURITY_BITS = 128
#: SEAL accepts primes of at most 60 bits.
MAX_PRIME_BITS = 60
#: Below this scale the decryption error (~2^-scale * noise) exceeds the protocol's 1e-6 target.
MIN_SCALE_BITS = 20

#: Node-config key of the secret context path (``flower-supernode --node-config``).
NODE_CONFIG_KEY = "fef-secret-context"
#: Environment variable of the secret context path (simulation, where node config is fixed).
SECRET_CONTEXT_ENV = "FEDPARITY_SECRET_CONTEXT"
SECRET_CONTEXT_FILE = "secret_context.tenseal"
#: Where ``fedparity keys`` writes by default and nodes/server look last.
DEFAULT_KEY_DIR = Path.home() / ".fedparity" / "keys"
PUBLIC_CONTEXT_FILE = "public_context.tenseal"

DEFAULT_MAX_MAGNITUDE = 1e12
DEFAULT_COUNT_TOLERANCE = 1e-3
DEFAULT_AGREEMENT_TOLERANCE = 1e-6
#: Bytes of the plaintext "accepted ciphertexts" count the server sends with a sum.
COUNT_BYTES = 8
NUM_ROUNDS = 3


class KeyMaterialError(ValueError):
    """Key material is missing, misplaced (a secret key on the server) or malformed."""


class DecryptionCheckError(ValueError):
    """A decrypted sum failed a plausibility check; nothing derived from it may be released."""


class MagnitudeCheckError(DecryptionCheckError):
    """A decrypted value is not finite or exceeds the allowed magnitude."""


class CountSlotError(DecryptionCheckError):
    """The decrypted count slot differs from the number of accepted ciphertexts."""


class ProtocolError(RuntimeError):
    """The protocol cannot complete (too few clients, key holders disagree, ...)."""


class StaleReferenceError(ProtocolError):
    """Round-2 terms refer to a round-1 sum over a different set of clients."""


class NoValidCiphertextError(ProtocolError):
    """Every payload of a round was rejected."""

    def __init__(self, message: str, rejections: Sequence[Rejection]) -> None:
        super().__init__(message)
        self.rejections = tuple(rejections)


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CkksParameters:
    """CKKS encryption parameters, checked for 128-bit classical security.

    The limits are the HomomorphicEncryption.org Security Standard (Albrecht et al., 2018,
    Table 1, ternary secret, 128-bit classical): maximum total coefficient modulus
    log2(q) = 27, 54, 109, 218, 438, 881 bits for N = 1024 ... 32768. The total counts every
    prime, the special (key-switching) prime included, as SEAL does.

    Parameters
    ----------
    poly_modulus_degree
        Ring dimension N (a power of two in the table); N / 2 slots per ciphertext.
    coeff_mod_bit_sizes
        Bit sizes of the coefficient-modulus primes (at least 2, each <= 60 and > log2(2N)).
        The last is the special prime; the first is the data prime that holds the integer part.
    global_scale_bits
        log2 of the encoding scale: the precision. At most every inner prime and below the
        first prime (room for the integer part); at least 20.

    Notes
    -----
    The server only adds ciphertexts and clients multiply nothing encrypted, so no
    multiplicative depth is needed; the default (8192, (60, 40, 40, 60), 40) uses 200 of the
    218 bits allowed at N = 8192 and represents values up to 2^99 in magnitude.

    Examples
    --------
    >>> CkksParameters().security_bits
    128
    >>> CkksParameters(8192, (60, 60, 60, 60), 40)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: coeff_mod_bit_sizes total 240 bits exceeds 218, the maximum for 128-bit ...
    """

    poly_modulus_degree: int = 8192
    coeff_mod_bit_sizes: tuple[int, ...] = (60, 40, 40, 60)
    global_scale_bits: int = 40

    def __post_init__(self) -> None:
        degree = self.poly_modulus_degree
        if (
            isinstance(degree, bool)
            or not isinstance(degree, (int, np.integer))
            or int(degree) not in MAX_COEFF_MODULUS_BITS_128
        ):
            allowed = ", ".join(map(str, MAX_COEFF_MODULUS_BITS_128))
            raise ValueError(
                f"poly_modulus_degree must be one of {allowed} (HomomorphicEncryption.org "
                f"128-bit table), got {degree!r}"
            )
        object.__setattr__(self, "poly_modulus_degree", int(degree))
        try:
            sizes = tuple(self.coeff_mod_bit_sizes)
        except TypeError:
            raise ValueError(
                f"coeff_mod_bit_sizes must be a sequence of integers, got "
                f"{self.coeff_mod_bit_sizes!r}"
            ) from None
        if len(sizes) < 2:
            raise ValueError(
                "coeff_mod_bit_sizes must list at least 2 primes (data prime + special prime), "
                f"got {sizes!r}"
            )
        min_bits = int(math.log2(2 * self.poly_modulus_degree)) + 1
        for bits in sizes:
            if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
                raise ValueError(f"coeff_mod_bit_sizes must hold integers, got {bits!r}")
            if not min_bits <= bits <= MAX_PRIME_BITS:
                raise ValueError(
                    f"coeff_mod_bit_sizes entries must be in [{min_bits}, {MAX_PRIME_BITS}] "
                    f"at poly_modulus_degree={self.poly_modulus_degree}, got {bits}"
                )
        sizes = tuple(int(bits) for bits in sizes)
        object.__setattr__(self, "coeff_mod_bit_sizes", sizes)
        total, limit = sum(sizes), MAX_COEFF_MODULUS_BITS_128[self.poly_modulus_degree]
        if total > limit:
            raise ValueError(
                f"coeff_mod_bit_sizes total {total} bits exceeds {limit}, the maximum for "
                f"{SECURITY_BITS}-bit security at poly_modulus_degree={self.poly_modulus_degree} "
                "(HomomorphicEncryption.org standard)"
            )
        scale = self.global_scale_bits
        if isinstance(scale, bool) or not isinstance(scale, (int, np.integer)):
            raise ValueError(f"global_scale_bits must be an integer, got {scale!r}")
        scale = int(scale)
        object.__setattr__(self, "global_scale_bits", scale)
        if scale < MIN_SCALE_BITS:
            raise ValueError(
                f"global_scale_bits must be >= {MIN_SCALE_BITS} (precision), got {scale}"
            )
        inner = sizes[1:-1]
        if inner and scale > min(inner):
            raise ValueError(
                f"global_scale_bits={scale} exceeds the smallest inner prime ({min(inner)} bits "
                f"of coeff_mod_bit_sizes={sizes})"
            )
        if scale >= sizes[0]:
            raise ValueError(
                f"global_scale_bits={scale} must be below the first (data) prime of "
                f"coeff_mod_bit_sizes ({sizes[0]} bits), which holds the integer part"
            )

    @property
    def security_bits(self) -> int:
        """Classical security level guaranteed by the standard's table (always 128)."""
        return SECURITY_BITS

    @property
    def total_coeff_modulus_bits(self) -> int:
        """log2(q) of the whole coefficient modulus, special prime included."""
        return sum(self.coeff_mod_bit_sizes)

    @property
    def max_coeff_modulus_bits(self) -> int:
        """The standard's 128-bit limit on log2(q) at this degree."""
        return MAX_COEFF_MODULUS_BITS_128[self.poly_modulus_degree]

    @property
    def slot_count(self) -> int:
        """Values one ciphertext holds (N / 2)."""
        return self.poly_modulus_degree // 2

    @property
    def global_scale(self) -> float:
        """The encoding scale 2^global_scale_bits."""
        return float(2**self.global_scale_bits)

    @property
    def max_plaintext_magnitude(self) -> float:
        """Largest |value| a fresh ciphertext (and a sum) can hold before it wraps around."""
        data_bits = self.total_coeff_modulus_bits - self.coeff_mod_bit_sizes[-1]
        return float(2 ** (data_bits - self.global_scale_bits - 1))

    def make_context(self) -> ts.Context:
        """A fresh TenSEAL context with a new key pair (holds the secret key)."""
        import tenseal as ts

        context = ts.context(
            ts.SCHEME_TYPE.CKKS,
            poly_modulus_degree=self.poly_modulus_degree,
            coeff_mod_bit_sizes=list(self.coeff_mod_bit_sizes),
        )
        context.global_scale = self.global_scale
        return context

    @classmethod
    def from_context(cls, context: ts.Context) -> CkksParameters:
        """The (checked) parameters of a loaded context; raises if it is not 128-bit CKKS."""
        import tenseal as ts

        seal = context.seal_context().data
        first = seal.first_context_data()
        if first.parms().scheme() != ts.SCHEME_TYPE.CKKS.value:
            raise ValueError(f"context must be a CKKS context, got {first.parms().scheme()}")
        totals = []
        level = first
        while level is not None:
            totals.append(int(level.total_coeff_modulus_bit_count()))
            level = level.next_context_data()
        data_primes = [*(a - b for a, b in zip(totals, totals[1:], strict=False)), totals[-1]]
        special = int(seal.key_context_data().total_coeff_modulus_bit_count()) - totals[0]
        try:
            scale = float(context.global_scale)
        except ValueError:
            raise ValueError("context has no global scale set") from None
        scale_bits = math.log2(scale) if scale > 0 else math.nan
        if not float(scale_bits).is_integer():
            raise ValueError(f"context global scale must be a power of two, got {scale}")
        return cls(
            poly_modulus_degree=int(first.parms().poly_modulus_degree()),
            coeff_mod_bit_sizes=(*reversed(data_primes), special),
            global_scale_bits=int(scale_bits),
        )


# --------------------------------------------------------------------------------------------
# Key material
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyPaths:
    """Where :func:`generate_keys` wrote the key material."""

    #: Secret context (secret + public key) for the clients / key holders; mode 0600.
    secret: Path
    #: Public context (no secret key) for the server.
    public: Path


def context_has_secret_key(context: ts.Context) -> bool:
    """Whether a TenSEAL context holds a secret key (it can decrypt)."""
    return bool(context.has_secret_key())


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` atomically to ``path`` with permission bits ``mode`` from the start."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(descriptor, mode)  # the umask may have removed bits; never adds any
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def generate_keys(
    directory: str | os.PathLike[str],
    parameters: CkksParameters | None = None,
    *,
    overwrite: bool = False,
) -> KeyPaths:
    """Generate a key pair and write the secret and the public context to ``directory``.

    Parameters
    ----------
    directory
        Created (mode 0700) if absent.
    parameters
        CKKS parameters; default :class:`CkksParameters()`.
    overwrite
        Replace existing files; otherwise an existing file raises ``FileExistsError``.

    Returns
    -------
    KeyPaths
        ``secret``: the context with the secret key (mode 0600), for the clients / key holders;
        ``public``: the context without it (``save_secret_key=False``), for the server.
        Neither holds relinearisation or Galois keys: the protocol only adds.
    """
    parameters = CkksParameters() if parameters is None else parameters
    if not isinstance(parameters, CkksParameters):
        raise ValueError(f"parameters must be a CkksParameters, got {type(parameters).__name__}")
    folder = Path(directory)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = KeyPaths(secret=folder / SECRET_CONTEXT_FILE, public=folder / PUBLIC_CONTEXT_FILE)
    if not overwrite:
        for path in (paths.secret, paths.public):
            if path.exists():
                raise FileExistsError(f"{path} exists; pass overwrite=True to replace the keys")
    context = parameters.make_context()
    secret = context.serialize(
        save_public_key=True,
        save_secret_key=True,
        save_galois_keys=False,
        save_relin_keys=False,
    )
    public = context.serialize(
        save_public_key=True,
        save_secret_key=False,
        save_galois_keys=False,
        save_relin_keys=False,
    )
    _write_file(paths.secret, secret, 0o600)
    _write_file(paths.public, public, 0o644)
    return paths


def _load_context(path: str | os.PathLike[str], n_threads: int) -> ts.Context:
    import tenseal as ts

    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as error:
        raise KeyMaterialError(f"cannot read TenSEAL context {file}: {error}") from None
    try:
        context = ts.context_from(data, n_threads=n_threads)
    except (ValueError, RuntimeError, TypeError) as error:
        raise KeyMaterialError(f"{file} is not a serialized TenSEAL context: {error}") from None
    CkksParameters.from_context(context)  # raises if not CKKS or not 128-bit secure
    return context


def load_secret_context(path: str | os.PathLike[str], *, n_threads: int = 1) -> ts.Context:
    """Load a client's / key holder's context; it must hold the secret key.

    Raises
    ------
    KeyMaterialError
        The file is unreadable, not a TenSEAL context, or has no secret key.
    ValueError
        The parameters are not 128-bit secure CKKS parameters.
    """
    context = _load_context(path, n_threads)
    if not context_has_secret_key(context):
        raise KeyMaterialError(
            f"{path} holds no secret key: clients need the secret context from generate_keys"
        )
    return context


def load_public_context(path: str | os.PathLike[str], *, n_threads: int = 1) -> ts.Context:
    """Load the server's context; refuses a file that contains a secret key.

    Raises
    ------
    KeyMaterialError
        The file is unreadable, not a TenSEAL context, or holds a secret key (the server must
        never hold one: give it the public context written by :func:`generate_keys`).
    """
    context = _load_context(path, n_threads)
    if context_has_secret_key(context):
        raise KeyMaterialError(
            f"{path} contains a secret key; the server may only load the public context"
        )
    return context


def secret_context_path(
    node_config: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    *,
    default_dir: Path | None = None,
) -> Path:
    """Where this node's secret context is: node config, then environment, then the node's
    default key folder (``~/.fedparity/keys``, where ``fedparity keys`` writes by default).

    Parameters
    ----------
    node_config
        The node configuration; key ``fef-secret-context`` (set with
        ``flower-supernode --node-config "fef-secret-context='/abs/secret_context.tenseal'"``).
    environ
        Environment; variable ``FEDPARITY_SECRET_CONTEXT`` (simulation, where the node config
        cannot be set per node). Default ``os.environ``.
    default_dir
        The node-local fallback folder (default :data:`DEFAULT_KEY_DIR`); used only if it
        holds a secret context. Every source is on the node: never a path from the server.

    Returns
    -------
    Path
        An absolute path to an existing file.

    Raises
    ------
    KeyMaterialError
        Neither is set, the value is not an absolute path, or the file does not exist.
    """
    environ = os.environ if environ is None else environ
    fallback = (DEFAULT_KEY_DIR if default_dir is None else Path(default_dir)) / (
        SECRET_CONTEXT_FILE
    )
    candidates = (
        (f"node config {NODE_CONFIG_KEY!r}", node_config.get(NODE_CONFIG_KEY)),
        (f"environment variable {SECRET_CONTEXT_ENV}", environ.get(SECRET_CONTEXT_ENV)),
        ("the default key folder", str(fallback) if fallback.is_file() else None),
    )
    for source, value in candidates:
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise KeyMaterialError(f"{source} must be a path string, got {value!r}")
        path = Path(value).expanduser()
        if not path.is_absolute():
            raise KeyMaterialError(f"{source} must be an absolute path, got {value!r}")
        if not path.is_file():
            raise KeyMaterialError(f"{source} = {value!r}: no such file")
        return path
    raise KeyMaterialError(
        f"no secret TenSEAL context for this node: set the node config key {NODE_CONFIG_KEY!r} "
        f"(flower-supernode --node-config \"{NODE_CONFIG_KEY}='/abs/path'\"), or, in "
        f"simulation, the environment variable {SECRET_CONTEXT_ENV}, or create the keys in "
        f"{fallback.parent} (fedparity keys)"
    )


# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------

RejectionKind = Literal["malformed", "parameters", "size"]


@dataclass(frozen=True)
class Rejection:
    """A payload the server did not add, and why."""

    #: Position of the payload in the list given to :func:`add_ciphertexts`.
    index: int
    #: "malformed" (does not parse), "parameters" (not one fresh CKKS ciphertext of the
    #: context's parameters) or "size" (slot count differs from the others).
    kind: RejectionKind
    reason: str


class _Invalid(Exception):
    def __init__(self, kind: RejectionKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def to_array(data: bytes) -> np.ndarray:
    """Serialized bytes as a 1-D uint8 array (for a Flower ``ArrayRecord``)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"data must be bytes, got {type(data).__name__}")
    return np.frombuffer(bytes(data), dtype=np.uint8).copy()


def from_array(array: np.ndarray) -> bytes:
    """The bytes held by a 1-D uint8 array made by :func:`to_array`."""
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
        described = (
            f"{array.dtype} array of shape {array.shape}"
            if isinstance(array, np.ndarray)
            else type(array).__name__
        )
        raise ValueError(f"array must be a 1-D uint8 array, got {described}")
    return array.tobytes()


def _as_values(values: Any, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite (found NaN or infinity)")
    return array


def _slot_count(context: ts.Context) -> int:
    return int(context.seal_context().data.first_context_data().parms().poly_modulus_degree()) // 2


def encrypt_vector(context: ts.Context, values: np.ndarray) -> bytes:
    """Encrypt all ``values`` into ONE CKKS ciphertext and serialize it.

    Parameters
    ----------
    context
        Any context with the public key (the secret context of a client works).
    values
        1-D, finite, at most ``poly_modulus_degree / 2`` values.
    """
    import tenseal as ts

    array = _as_values(values, "values")
    slots = _slot_count(context)
    if array.size > slots:
        raise ValueError(f"values must fit one ciphertext ({slots} slots), got {array.size}")
    return ts.ckks_vector(context, array.tolist()).serialize()


def _load_vector(context: ts.Context, data: bytes) -> ts.CKKSVector:
    """Deserialize one fresh CKKS ciphertext of ``context``'s parameters, or raise _Invalid."""
    import tenseal as ts

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _Invalid("malformed", f"payload must be bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise _Invalid("malformed", "empty payload")
    try:
        vector = ts.ckks_vector_from(context, bytes(data))
    except ValueError as error:
        raise _Invalid("malformed", f"not a serialized CKKS vector ({error})") from None
    except (RuntimeError, TypeError) as error:
        raise _Invalid(
            "parameters", f"not valid under this context's CKKS parameters ({error})"
        ) from None
    ciphertexts = vector.ciphertext()
    if len(ciphertexts) != 1:
        raise _Invalid("parameters", f"expected one ciphertext, got {len(ciphertexts)}")
    ciphertext = ciphertexts[0]
    seal = context.seal_context().data
    if ciphertext.poly_modulus_degree() != seal.first_context_data().parms().poly_modulus_degree():
        raise _Invalid("parameters", "polynomial modulus degree differs from the context's")
    if list(ciphertext.parms_id()) != list(seal.first_parms_id()):
        raise _Invalid("parameters", "not at the context's top modulus level")
    if ciphertext.size() != 2:
        raise _Invalid("parameters", f"ciphertext has {ciphertext.size()} polynomials, not 2")
    if ciphertext.is_transparent():
        raise _Invalid("parameters", "transparent ciphertext (its plaintext is readable)")
    if not math.isclose(ciphertext.scale, float(context.global_scale), rel_tol=1e-9):
        raise _Invalid(
            "parameters",
            f"scale {ciphertext.scale:.6g} differs from the context's {context.global_scale:.6g}",
        )
    size = vector.size()
    if not 1 <= size <= _slot_count(context):
        raise _Invalid("size", f"slot count {size} outside [1, {_slot_count(context)}]")
    return vector


def decrypt_vector(
    context: ts.Context, data: bytes, *, expected_size: int | None = None
) -> np.ndarray:
    """Decrypt one serialized CKKS vector (a client or key holder; needs the secret key).

    Raises
    ------
    KeyMaterialError
        ``context`` has no secret key.
    ValueError
        ``data`` is not one fresh CKKS ciphertext of the context's parameters, or its slot
        count differs from ``expected_size``.
    """
    if not context_has_secret_key(context):
        raise KeyMaterialError("decrypt_vector needs a context with the secret key")
    try:
        vector = _load_vector(context, data)
    except _Invalid as invalid:
        raise ValueError(f"data: {invalid.reason}") from None
    if expected_size is not None and vector.size() != expected_size:
        raise ValueError(f"data holds {vector.size()} values, expected {expected_size}")
    return np.asarray(vector.decrypt(), dtype=np.float64)


def add_ciphertexts(
    public_context: ts.Context,
    payloads: Sequence[bytes | np.ndarray],
    *,
    expected_size: int | None = None,
) -> tuple[bytes, list[Rejection]]:
    """Server side: add the valid ciphertexts, reject (never crash on) the others.

    Parameters
    ----------
    public_context
        The server's context; it must not hold a secret key.
    payloads
        Serialized CKKS vectors, as bytes or as uint8 arrays from :func:`to_array`.
    expected_size
        Slot count every vector must have (the server knows the layout; the sum is then
        computed streaming). Default: the most common slot count among the payloads that
        parse (the first one seen on a tie).

    Returns
    -------
    (bytes, list of Rejection)
        The serialized sum of the accepted payloads, and the rejected ones with reasons.
        Accepted = ``len(payloads) - len(rejections)``.

    Raises
    ------
    KeyMaterialError
        ``public_context`` holds a secret key.
    NoValidCiphertextError
        No payload is valid (its ``rejections`` say why).

    Notes
    -----
    A ciphertext encrypted under another secret key with the same parameters is accepted:
    the server cannot detect it. It is caught after decryption by the count slot and the
    magnitude check (:func:`check_count_slot`, :func:`check_magnitude`).
    """

    if context_has_secret_key(public_context):
        raise KeyMaterialError(
            "public_context holds a secret key; the server may only hold the public context"
        )
    rejections: list[Rejection] = []
    pending: list[tuple[int, ts.CKKSVector]] = []  # only while the expected size is unknown
    total: ts.CKKSVector | None = None
    size = expected_size

    def accept(index: int, vector: ts.CKKSVector) -> None:
        nonlocal total
        if vector.size() != size:
            reason = f"slot count {vector.size()} differs from the expected {size}"
            rejections.append(Rejection(index, "size", reason))
        elif total is None:
            total = vector
        else:
            total.add_(vector)

    for index, payload in enumerate(payloads):
        try:
            if isinstance(payload, np.ndarray):
                try:
                    payload = from_array(payload)
                except ValueError as error:
                    raise _Invalid("malformed", str(error)) from None
            vector = _load_vector(public_context, payload)
        except _Invalid as invalid:
            rejections.append(Rejection(index, invalid.kind, invalid.reason))
            continue
        if size is None:
            pending.append((index, vector))
        else:
            accept(index, vector)  # streaming: one ciphertext in memory besides the sum
    if pending:
        size = Counter(vector.size() for _, vector in pending).most_common(1)[0][0]
        for index, vector in pending:
            accept(index, vector)
    if total is None:
        raise NoValidCiphertextError(
            f"none of the {len(payloads)} payloads is a valid ciphertext", rejections
        )
    rejections.sort(key=lambda rejection: rejection.index)
    return total.serialize(), rejections


def append_count_slot(values: np.ndarray) -> np.ndarray:
    """``values`` followed by the count slot 1.0 (every client appends one)."""
    return np.append(_as_values(values, "values"), 1.0)


def check_magnitude(
    values: np.ndarray, *, max_magnitude: float = DEFAULT_MAX_MAGNITUDE, name: str = "values"
) -> np.ndarray:
    """Return ``values`` if all are finite and at most ``max_magnitude`` in absolute value.

    Raises
    ------
    MagnitudeCheckError
        Otherwise: the sum is corrupted (e.g. a ciphertext under another key was added).
    """
    if not (math.isfinite(max_magnitude) and max_magnitude > 0):
        raise ValueError(f"max_magnitude must be a finite number > 0, got {max_magnitude!r}")
    array = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(array)):
        raise MagnitudeCheckError(f"{name}: decrypted values are not finite")
    largest = float(np.max(np.abs(array))) if array.size else 0.0
    if largest > max_magnitude:
        raise MagnitudeCheckError(
            f"{name}: decrypted |value| {largest:.3g} exceeds max_magnitude={max_magnitude:.3g}"
            " (corrupted sum, e.g. a ciphertext under another key)"
        )
    return array


def check_count_slot(
    decrypted: np.ndarray, expected_count: int, *, tolerance: float = DEFAULT_COUNT_TOLERANCE
) -> np.ndarray:
    """Check the last (count) slot of a decrypted sum and return the other slots.

    Parameters
    ----------
    decrypted
        A decrypted sum whose last slot is the count slot.
    expected_count
        Number of ciphertexts the server accepted into the sum.
    tolerance
        Largest allowed ``|count - expected_count|``.

    Raises
    ------
    CountSlotError
        The count differs: the sum contains a ciphertext that is not an honest encryption
        under this key (or the server misreported the count).
    """
    if not (math.isfinite(tolerance) and 0 < tolerance < 0.5):
        raise ValueError(f"tolerance must be in (0, 0.5), got {tolerance!r}")
    array = np.asarray(decrypted, dtype=np.float64)
    if array.ndim != 1 or array.size < 2:
        raise ValueError(f"decrypted must be a 1-D array with a count slot, shape {array.shape}")
    count = float(array[-1])
    if not math.isfinite(count) or abs(count - expected_count) > tolerance:
        raise CountSlotError(
            f"count slot {count:.6g} differs from the {expected_count} accepted ciphertexts "
            f"(tolerance {tolerance})"
        )
    return array[:-1].copy()
