"""CKKS parameters (128-bit security) and key files: the server's public context and the
holders' secret context, each in its own file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import tenseal as ts

from ..._files import private_file_problem, write_file_atomic
from .errors import KeyMaterialError

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


def generate_keys(
    directory: str | os.PathLike[str],
    parameters: CkksParameters | None = None,
    *,
    overwrite: bool = False,
    public_directory: str | os.PathLike[str] | None = None,
) -> KeyPaths:
    """Generate a key pair and write the secret context to ``directory`` and the public one
    to ``public_directory`` (default: ``directory``).

    Run it on a key holder (or a key authority), never on the server's host, and ship only
    the public context to the server: whoever can read the secret file can decrypt every
    holder's statistics.

    Parameters
    ----------
    directory
        The secret context's folder: created with mode 0700, or tightened to 0700 if it exists
        (only its owner may list or enter it).
    parameters
        CKKS parameters; default :class:`CkksParameters()`.
    overwrite
        Replace existing files; otherwise an existing file raises ``FileExistsError``.
    public_directory
        Where the public context goes (e.g. a folder to copy to the server).

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
    folder.chmod(0o700)  # mkdir's mode does not tighten a folder that already exists
    public_folder = folder if public_directory is None else Path(public_directory)
    public_folder.mkdir(parents=True, exist_ok=True)
    paths = KeyPaths(
        secret=folder / SECRET_CONTEXT_FILE, public=public_folder / PUBLIC_CONTEXT_FILE
    )
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
    write_file_atomic(paths.secret, secret, 0o600)
    write_file_atomic(paths.public, public, 0o644)
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


def check_private_file(path: str | os.PathLike[str]) -> None:
    """Refuse (``KeyMaterialError``) a secret file that its group or others may read or write
    (POSIX permission bits ``0o077``): whoever reads it decrypts every holder's statistics.
    ``generate_keys`` writes it with mode 0600."""
    problem = private_file_problem(path, "a secret key")
    if problem is not None:
        raise KeyMaterialError(problem)


def load_secret_context(path: str | os.PathLike[str], *, n_threads: int = 1) -> ts.Context:
    """Load a client's / key holder's context; it must hold the secret key and be private to
    its owner (:func:`check_private_file`).

    Raises
    ------
    KeyMaterialError
        The file is readable by group or others, unreadable, not a TenSEAL context, or has no
        secret key.
    ValueError
        The parameters are not 128-bit secure CKKS parameters.
    """
    context = _load_context(path, n_threads)
    if not context_has_secret_key(context):
        raise KeyMaterialError(
            f"{path} holds no secret key: clients need the secret context from generate_keys"
        )
    check_private_file(path)
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


def check_key_pair(
    secret_path: str | os.PathLike[str], public_path: str | os.PathLike[str]
) -> None:
    """Check that two files are one key pair: each loads as it should
    (:func:`load_secret_context`, :func:`load_public_context`), both have the same parameters,
    and a vector encrypted under the public context decrypts under the secret one.

    Raises
    ------
    KeyMaterialError
        Either file fails to load, or the two are not one pair (the public context was written
        with another secret key, or with other parameters).
    """
    import tenseal as ts

    secret = load_secret_context(secret_path)
    public = load_public_context(public_path)
    if CkksParameters.from_context(secret) != CkksParameters.from_context(public):
        raise KeyMaterialError(
            f"{public_path} and {secret_path} have different CKKS parameters: not one key pair"
        )
    probe = np.random.default_rng().uniform(-1.0, 1.0, 8)
    vector = ts.ckks_vector(public, probe.tolist())
    vector.link_context(secret)
    if not np.allclose(vector.decrypt(), probe, atol=1e-3):
        raise KeyMaterialError(
            f"{public_path} was not written with the secret key of {secret_path}: not one key pair"
        )


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
