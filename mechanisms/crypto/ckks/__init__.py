"""CKKS encryption layer of FedEvalFair (the paper's Algorithms 1-2), with its threat model.

FedEvalFair: "FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness
Evaluation Framework", anonymous authors, ACM Multimedia 2024 submission (anonymous review
version); FedEvalFair (anonymous, 2024) below. In its protocol every value a client uploads is
homomorphically encrypted and the server computes on ciphertexts only; here the scheme is CKKS
(TenSEAL) and the server only adds ciphertexts.

Pure numpy + TenSEAL, imported only inside the functions that need it (no Flower import): the
Flower handlers and strategy call these functions. Modules: :mod:`.keys` (parameters, key
files), :mod:`.vectors` (one-ciphertext messages and the checks after decryption),
:mod:`.aggregation` (the server's sum, and a holder's own recomputation), :mod:`.signing`
(signed ciphertexts, endorsed sums and the one committed set of a run), :mod:`.flooding`
(noise flooding of released decryptions), :mod:`.releases` (a key holder's journal of its
commitments and releases per secret key), :mod:`.holder_dp` (the optional holder-level
differentially private release), :mod:`.errors`.

Threat model
------------
* **Server**: it holds only the *public* TenSEAL context (no secret key;
  :func:`load_public_context` refuses a file that has one and :func:`add_ciphertexts` refuses
  a context that has one). It receives ciphertexts, adds them and forwards them; the only
  plaintext it ever receives is the aggregate vector that the key holders release in round 3,
  noise-flooded (:mod:`.flooding`). Against an *active* server (forged sums, claimed counts,
  replays) holders decrypt only sums of ciphertexts signed by distinct members of their roster
  for the run and round (:mod:`.signing`), and release over one round-2 set per run, signed by
  every holder in it (so releases cannot be differenced down to one holder); docs/threat-model.md
  has the whole model.
* **Key holders**: the clients (one secret context shared by all of them, provisioned out of
  band, see :func:`secret_context_path`) or a separate key authority holding the same file.
  TenSEAL has no threshold decryption: a server that colludes with *one* key holder can decrypt
  every ciphertext it received. Transport encryption (TLS) must keep clients from reading
  each other's uploads. The verifiers and key holders receive the individual signed
  ciphertexts (to recompute the sums they decrypt), so a curious key holder can read them:
  make them a key authority where holders do not trust each other.

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
   degrees of freedom (e.g. ``[Q, W*, k]``) gives the minimum: the server learns only the
   test statistics and the p-values.

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

import lazy_loader as _lazy

# The names below load on first use (lazy_loader; the stub next to this file lists them for
# type checkers). Importing one submodule never runs the others, so two threads that import
# different submodules at once cannot deadlock on the import locks: Flower's simulation loads
# the ServerApp and the ClientApp in two threads.
__getattr__, __dir__, __all__ = _lazy.attach_stub(__name__, __file__)
