"""Sampling and speculative verification as pure, jittable JAX functions.

Shape letters as in docs/ARCHITECTURE.md (R requests, N drafts, Q = 1 + N verify rows, V vocab).
Sampling parameters are per-request arrays, so one batch mixes greedy and sampled requests; a
temperature of 0 means greedy, `top_k` 0 and `top_p` 1.0 mean off. The processed
distribution follows the z-lab reference (`dflash.model._sampling_probs`): logits /
temperature, keep the `top_k` largest, softmax, then keep tokens while the probability mass
before them (largest first) is < `top_p`, renormalize. Ties rank the lowest index first.

Random draws are keyed by (seed, stream, position), never by batch row, so a request's
tokens do not depend on what else is in its batch:

    key = fold_in(fold_in(jax.random.key(seed, impl="threefry2x32"), stream), position)

`position` is the position of the row whose logits gave the distribution, i.e. the position
of the sampled token minus one (vLLM keys a draft draw by `sample_pos - 1`; the target's
bonus or correction drawn from verify row k is keyed by that row's position). The streams:
DRAFT_STREAM draws draft tokens, TARGET_STREAM draws target tokens (bonus, correction, or a
plain non-speculative step), ACCEPT_STREAM draws the accept uniforms. Every key that decides
a committed token is used once per request: a cycle that commits up to position t used keys
at positions <= t - 1 for its decisions, and the next cycle's decisions use keys >= t. Keys a
cycle drew but never examined (drafts past the first rejection) may be drawn again later,
which is harmless since nothing depended on them.

Drafts are proposed one of two ways (`DRAFT_SAMPLING`, a static choice of the caller):
"sample" draws draft j from the drafter's processed distribution q_j, "argmax" proposes the
drafter's most likely token at every row. Which accepts more depends on the drafter: a draw
from q is accepted with probability 1 - TV(p, q), near 1 when q is close to the target's p,
an argmax with p(argmax q), at most max p (small when p is flat), though its block is the
drafter's one best guess where independent draws per position need not hang together. An
argmax proposal is a draw from a one-hot q, so the same test stays exact: draft x is
accepted with probability p(x), and on rejection the token comes from p with x removed,
renormalized. No q is stored for it; a draft outside the support of the target's truncated
p has p(x) = 0 and is always rejected.

When every row is greedy, each function takes an argmax-only path with the same result. A
runtime check picks it (`lax.cond`), which on a GPU costs a device-to-host copy of the
predicate and a stall per call; a caller that knows on the host that every row is greedy
passes `greedy=True` and that path is compiled alone.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

DRAFT_STREAM = 0
TARGET_STREAM = 1
ACCEPT_STREAM = 2

DRAFT_SAMPLING = ("sample", "argmax")
DEFAULT_DRAFT_SAMPLING = "sample"


def check_draft_sampling(draft_sampling) -> str:
    """Raise ValueError unless `draft_sampling` is one of DRAFT_SAMPLING."""
    if not isinstance(draft_sampling, str) or draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling must be one of {', '.join(map(repr, DRAFT_SAMPLING))}, "
                         f"got {draft_sampling!r}.")
    return draft_sampling


def validate_sampling_params(temperature, top_k, top_p) -> None:
    """Raise ValueError unless temperature is finite and >= 0, top_k an integer >= 0 and
    0 < top_p <= 1 (scalars or per-request arrays; bools are refused, not read as 0 or 1).

    For the engine to call once per request; the jitted functions below do not validate.
    """
    def real(name, x, hint):
        try:
            array = np.asarray(x)
        except ValueError:
            array = np.asarray(None)
        if array.dtype.kind not in "iuf" or _holds_bool(x):
            raise ValueError(f"{name} must be a number{hint}, got {x!r}.")
        return array

    temperature = real("temperature", temperature, " >= 0 (0 = greedy)")
    top_p = real("top_p", top_p, " in (0, 1] (1.0 = off)")
    if not np.all(np.isfinite(temperature) & (temperature >= 0)):
        raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), got {temperature}.")
    top_k_array = real("top_k", top_k, " (an integer >= 0, 0 = off)")
    if top_k_array.dtype.kind not in "iu" or np.any(top_k_array < 0):
        raise ValueError(f"top_k must be a non-negative integer (0 = off), got {top_k}.")
    if not np.all((top_p > 0) & (top_p <= 1)):
        raise ValueError(f"top_p must lie in (0, 1] (1.0 = off), got {top_p}.")


def _holds_bool(x) -> bool:
    """True and False convert to 1 and 0 silently; a bool among the values is a mistake."""
    if isinstance(x, (bool, np.bool_)):
        return True
    if isinstance(x, (list, tuple)):
        return any(_holds_bool(v) for v in x)
    return False


def _per_row(param, logits) -> jax.Array:
    """Broadcast a per-request parameter [R] (or [R, Q]) over logits [R, ..., V] minus V."""
    param = jnp.asarray(param)
    param = param.reshape(param.shape + (1,) * (logits.ndim - 1 - param.ndim))
    return jnp.broadcast_to(param, logits.shape[:-1])


# When every truncating row has 0 < top_k <= this, top-k/top-p rank only the top TOP_K_FAST
# candidates. XLA's GPU TopK kernel covers k <= 16; a larger k falls back to a full sort, several
# times slower (bench/LESSONS.md), so other rows take `threshold_truncation_mask` instead,
# which needs no ranking at all.
TOP_K_FAST = 16


def truncation_mask(scores, probs, top_k, top_p, use_p, candidates: int) -> jax.Array:
    """Tokens kept by top-k (rank < top_k) then top-p (mass before the token < top_p).

    Only the `candidates` best tokens can be kept: the caller passes TOP_K_FAST when no
    truncating row keeps more. lax.top_k ranks ties lowest index first. Public for the
    benchmark that times this sort against `threshold_truncation_mask` (bench.kernels.sampling).
    """
    _, order = lax.top_k(_signless_zeros(scores), candidates)
    rank = lax.broadcasted_iota(jnp.int32, order.shape, order.ndim - 1)
    in_k_sorted = rank < top_k[..., None]
    sorted_probs = jnp.where(in_k_sorted, jnp.take_along_axis(probs, order, axis=-1), 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdims=True)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = in_k_sorted & ((mass_before < top_p[..., None]) | ~use_p[..., None])
    return jnp.put_along_axis(jnp.zeros(scores.shape, bool), order, keep_sorted, axis=-1, inplace=False)


def _signless_zeros(scores) -> jax.Array:
    """scores with -0.0 as 0.0, so the two tie by index as they compare equal (XLA may fold
    away the plain `scores + 0.0`)."""
    return jnp.where(scores == 0, jnp.zeros_like(scores), scores)


def _order_keys(scores) -> jax.Array:
    """uint32 keys in the order of the float32 scores (-0.0 taken as 0.0)."""
    bits = lax.bitcast_convert_type(_signless_zeros(scores), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def threshold_digit_bits(rows: int) -> int:
    """Bits of a threshold `_largest_key` settles per pass, for `rows` rows of scores.

    Each pass counts 2**bits - 1 candidate thresholds in one sweep of the vocabulary, so a
    32-bit key takes 32 / bits passes: fewer passes, more counting per pass. Few rows leave
    the GPU idle between passes, so they take wide digits; many rows make counting the cost,
    so they take narrow ones (`python -m bench.kernels.sampling` chose the split).
    """
    return 4 if rows <= 16 else 2


def _largest_key(predicate, shape, bits: int) -> jax.Array:
    """Per row, the largest uint32 t with predicate(t) true, for a predicate true at 0 and
    false above some point. predicate maps candidate thresholds [*shape, C] to bools of that
    shape. Digits of `bits` bits are set from the top: the next digit is the number of its
    nonzero values whose candidate keeps the predicate true."""
    digits = jnp.arange(1, 2**bits, dtype=jnp.uint32)

    def set_digit(i, t):
        shift = (32 - bits * (i + 1)).astype(jnp.uint32)
        candidates = t[..., None] | lax.shift_left(digits, shift)
        digit = jnp.sum(predicate(candidates), axis=-1, dtype=jnp.uint32)
        return t | lax.shift_left(digit, shift)

    # A loop, not unrolled: unrolled passes multiplied the compiled code of every program
    # that samples (the CPU test suite crashed on its memory maps).
    return lax.fori_loop(0, 32 // bits, set_digit, jnp.zeros(shape, jnp.uint32))


def threshold_truncation_mask(scores, probs, top_k, top_p, use_p, digit_bits: int | None = None) -> jax.Array:
    """The same tokens as `truncation_mask(..., vocab)`, found by thresholds instead of a
    sort of the vocabulary: two digit-by-digit searches on the scores' bits (`_largest_key`),
    each settling `digit_bits` per pass (default `threshold_digit_bits` of the row count;
    the benchmark bench.kernels.sampling times other widths through it).

    Top-k: the k-th largest score key, then ties at it by lowest index. Top-p: the smallest
    key v whose strictly-larger kept tokens hold mass < top_p; tokens above v are kept, and
    tokens at v while the mass before them (larger ones, then lower-index ties) is < top_p.
    """
    keys = _order_keys(scores)
    row_shape = scores.shape[:-1]
    bits = digit_bits or threshold_digit_bits(math.prod(row_shape))
    kth = _largest_key(lambda t: jnp.sum(keys[..., None, :] >= t[..., None], axis=-1) >= top_k[..., None],
                       row_shape, bits)[..., None]
    tied = keys == kth
    room = top_k - jnp.sum(keys > kth, axis=-1)
    in_k = (keys > kth) | (tied & (_exclusive_cumsum(tied.astype(jnp.int32)) < room[..., None]))

    mass = jnp.where(in_k, probs, 0.0)
    mass = mass / mass.sum(-1, keepdims=True)
    below = _largest_key(
        lambda t: jnp.sum(jnp.where(keys[..., None, :] > t[..., None], mass[..., None, :], 0.0), axis=-1)
        >= top_p[..., None], row_shape, bits)
    last = jnp.min(jnp.where(in_k & (keys > below[..., None]), keys, jnp.uint32(0xFFFFFFFF)), axis=-1)[..., None]
    at_last = in_k & (keys == last)
    mass_above = jnp.sum(jnp.where(keys > last, mass, 0.0), axis=-1, keepdims=True)
    keep_p = (in_k & (keys > last)) | (at_last & (mass_above + _exclusive_cumsum(jnp.where(at_last, mass, 0.0)) < top_p[..., None]))
    return in_k & (keep_p | ~use_p[..., None])


def _exclusive_cumsum(x) -> jax.Array:
    return jnp.cumsum(x, axis=-1) - x


def scaled_logits(logits, temperature) -> jax.Array:
    """(logits - row max) / temperature in float32: the softmax's scores at any temperature > 0.

    Dividing first overflows: at temperature 1e-12 the logits become +-inf and the softmax
    NaN (inf - inf). After the shift every score is <= 0, so a tiny temperature only sends
    the others to -inf and the maximum keeps exp(0) = 1: the distribution tends to the argmax,
    as it should. Temperatures above 0 but below float32's tiny (flushed to 0 on some
    backends) are clamped to it, so they never divide by zero.
    """
    logits = jnp.asarray(logits).astype(jnp.float32)
    temperature = jnp.maximum(jnp.asarray(temperature, jnp.float32), jnp.finfo(jnp.float32).tiny)
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    return shifted / temperature[..., None]


def processed_probs(logits, temperature, top_k, top_p) -> jax.Array:
    """The target's (or drafter's) sampling distribution, float32, same shape as `logits`.

    logits [R, V] or [R, Q, V]; temperature, top_k, top_p [R] (broadcast over Q) or the
    full leading shape. Greedy rows give a one-hot at argmax. The ranking behind
    top-k/top-p runs only when some row uses them, over TOP_K_FAST candidates when that
    suffices, else by thresholds without a sort; a row's result is the same on every path
    (up to float summation order inside the top-p mass), so it does not depend on the batch.
    """
    logits = jnp.asarray(logits)
    vocab = logits.shape[-1]
    temperature, top_k, top_p = (_per_row(x, logits) for x in (temperature, top_k, top_p))
    greedy = temperature == 0
    scores = scaled_logits(logits, jnp.where(greedy, 1.0, temperature))
    probs = jax.nn.softmax(scores, axis=-1)
    use_k = (top_k > 0) & (top_k < vocab) & ~greedy
    use_p = (top_p < 1) & ~greedy
    truncate = use_k | use_p
    top_k = jnp.where(use_k, top_k, vocab)
    mask = functools.partial(truncation_mask, scores, probs, top_k, top_p, use_p)
    fast = min(TOP_K_FAST, vocab)
    keep = lax.cond(
        jnp.any(truncate),
        lambda: lax.cond(jnp.all(~truncate | (top_k <= fast)), lambda: mask(fast),
                         lambda: threshold_truncation_mask(scores, probs, top_k, top_p, use_p)),
        lambda: jnp.ones(logits.shape, bool),
    )
    kept = jnp.where(keep, probs, 0.0)
    probs = jnp.where(truncate[..., None], kept / kept.sum(-1, keepdims=True), probs)
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
    return jnp.where(greedy[..., None], one_hot, probs)


def draw_keys(seeds, positions, stream: int) -> jax.Array:
    """Typed PRNG keys, shape broadcast(seeds, positions); see the module docstring."""
    shape = jnp.broadcast_shapes(jnp.shape(seeds), jnp.shape(positions))

    def one(seed, position):
        key = jax.random.key(seed, impl="threefry2x32")
        return jax.random.fold_in(jax.random.fold_in(key, stream), position)

    seeds, positions = (jnp.broadcast_to(x, shape).reshape(-1) for x in (seeds, positions))
    return jax.vmap(one)(seeds, positions).reshape(shape)


def sample_tokens(probs, seeds, positions, stream: int) -> jax.Array:
    """Draw one token per row of `probs` [..., V] (any non-negative weights) by Gumbel-max.

    seeds and positions broadcast to probs.shape[:-1]; `positions` is the position of the
    row whose logits gave `probs` (the sampled token's position - 1). A one-hot row (greedy)
    always returns its hot index, whatever the noise.
    """
    probs = jnp.asarray(probs, jnp.float32)
    keys = draw_keys(jnp.broadcast_to(seeds, probs.shape[:-1]), positions, stream)
    vocab = probs.shape[-1]
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,)))(keys.reshape(-1))
    scores = jnp.log(probs) + gumbel.reshape(keys.shape + (vocab,))
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)


def sample_target(logits_RV, temperature_R, top_k_R, top_p_R, seeds_R, positions_R, *, greedy: bool = False
                  ) -> jax.Array:
    """One token per row from the target's processed distribution, keyed (TARGET_STREAM,
    the row's position): a plain, non-speculative step (e.g. the first token after prefill).
    When every row is greedy this is an argmax over the logits, with the same result: no
    softmax or noise over the vocabulary (a greedy step's only pass over it is the argmax).
    `greedy=True` compiles that argmax alone."""
    logits_RV, temperature_R = jnp.asarray(logits_RV), jnp.asarray(temperature_R)

    def greedy_only():
        return jnp.argmax(logits_RV, axis=-1).astype(jnp.int32)

    def general():
        probs_RV = processed_probs(logits_RV, temperature_R, top_k_R, top_p_R)
        return sample_tokens(probs_RV, seeds_R, positions_R, TARGET_STREAM)

    return greedy_only() if greedy else lax.cond(jnp.all(temperature_R == 0), greedy_only, general)


def sample_drafts(draft_logits_RNV, temperature_R, top_k_R, top_p_R, seeds_R, positions_R, *, greedy: bool = False,
                  argmax: bool = False):
    """(draft_tokens_RN, draft_probs_RNV): draft j is drawn from q at draft row j.

    `positions_R` is the anchor's position (as in `rejection_sample`): draft j sits at
    positions_R + 1 + j and is keyed (DRAFT_STREAM, positions_R + j). When every row is
    greedy this is an argmax (no softmax, no draws), with the same result. `greedy=True`
    compiles that argmax alone and returns None for the probabilities, which greedy
    verification does not read. `argmax=True` ("argmax" draft sampling) proposes that
    argmax for every row, sampled or not, and also returns None: `rejection_sample` with
    `argmax_drafts=True` needs no q.
    """
    draft_logits_RNV, temperature_R = jnp.asarray(draft_logits_RNV), jnp.asarray(temperature_R)
    num_drafts, vocab = draft_logits_RNV.shape[1:]
    if greedy or argmax:
        return jnp.argmax(draft_logits_RNV, axis=-1).astype(jnp.int32), None

    def greedy_only():  # one-hot probabilities: both branches return the same structure
        tokens_RN = jnp.argmax(draft_logits_RNV, axis=-1).astype(jnp.int32)
        return tokens_RN, jax.nn.one_hot(tokens_RN, vocab, dtype=jnp.float32)

    def general():
        probs_RNV = processed_probs(draft_logits_RNV, temperature_R, top_k_R, top_p_R)
        positions_RN = jnp.asarray(positions_R)[:, None] + jnp.arange(num_drafts, dtype=jnp.int32)
        return sample_tokens(probs_RNV, jnp.asarray(seeds_R)[:, None], positions_RN, DRAFT_STREAM), probs_RNV

    return lax.cond(jnp.all(temperature_R == 0), greedy_only, general)


def _leading_true(mask_RN) -> jax.Array:
    return jnp.cumprod(mask_RN.astype(jnp.int32), axis=-1).sum(-1)


def rejection_sample(
    target_logits_RQV,
    draft_tokens_RN,
    draft_probs_RNV,
    num_drafts_R,
    temperature_R,
    top_k_R,
    top_p_R,
    seeds_R,
    positions_R,
    *,
    greedy: bool = False,
    argmax_drafts: bool = False,
):
    """Speculative verification: (tokens_RQ int32, num_accepted_R int32).

    Positions: `positions_R` is the anchor's position (verify row 0). Verify row k sits at
    positions_R + k and its logits give p for the token at positions_R + k + 1. Draft j
    (0-based) sits at positions_R + 1 + j, was drawn from q = draft_probs_RNV[:, j], and is
    checked against p at verify row j. Only drafts j < num_drafts_R count (0..N; e.g. a
    smaller block, or the end of max_new_tokens).

    Sampled rows accept draft j with probability min(1, p(x)/q(x)) (uniform keyed
    (ACCEPT_STREAM, positions_R + j)); a = the number of leading accepted drafts. The next
    token comes from verify row a, keyed (TARGET_STREAM, positions_R + a): from
    normalize(max(p - q, 0)) if draft a was rejected (p if that is all zero), else from p
    (the bonus). Greedy rows (temperature 0) accept drafts equal to the target argmax and
    take the argmax at row a. tokens_RQ[r, :a+1] = accepted drafts then that token; the
    rest is -1.

    Example, one request, N = 3, anchor t0 at position 10, drafts [x0, x1, x2] at 11..13:
    x0 accepted (u at 10), x1 rejected (u at 11) -> a = 1, y ~ residual of verify row 1
    keyed (TARGET, 11); tokens = [x0, y, -1, -1]: x0 at position 11, y at 12. The next
    cycle's anchor is y, positions_R = 12.

    When every row is greedy the softmax over V and the random draws are skipped; greedy
    rows give the same result on either path. `greedy=True` compiles that path alone, and
    `draft_probs_RNV` may then be None.

    `argmax_drafts=True`: the drafts are the drafter's argmaxes, q one-hot at each draft, and
    `draft_probs_RNV` is not read (pass None). Then min(1, p(x)/q(x)) = p(x) and max(p - q, 0)
    is p without the rejected draft: the same tokens as passing q = one_hot(drafts).
    """
    target_logits_RQV, draft_tokens_RN, num_drafts_R, temperature_R, seeds_R, positions_R = (
        jnp.asarray(x) for x in (target_logits_RQV, draft_tokens_RN, num_drafts_R, temperature_R, seeds_R, positions_R)
    )
    num_rows, num_verify, vocab = target_logits_RQV.shape
    n = num_verify - 1
    draft_probs_RNV = None if draft_probs_RNV is None else jnp.asarray(draft_probs_RNV)
    probs_shape = None if draft_probs_RNV is None else draft_probs_RNV.shape
    needs_q = not (greedy or argmax_drafts)
    if n < 1 or draft_tokens_RN.shape != (num_rows, n) or (probs_shape != (num_rows, n, vocab) and needs_q):
        raise ValueError(
            f"rejection_sample needs target logits [R, N+1, V] with N >= 1, draft tokens [R, N] and "
            f"draft probs [R, N, V]; got {target_logits_RQV.shape}, {draft_tokens_RN.shape}, {probs_shape}."
        )
    rows_R = jnp.arange(num_rows)
    greedy_R = temperature_R == 0
    argmax_RQ = jnp.argmax(target_logits_RQV, axis=-1).astype(jnp.int32)
    valid_RN = jnp.arange(n) < num_drafts_R[:, None]
    greedy_accept_RN = draft_tokens_RN == argmax_RQ[:, :n]

    def greedy_only():
        accepted_R = _leading_true(greedy_accept_RN & valid_RN)
        return accepted_R, argmax_RQ[rows_R, accepted_R]

    def general():
        p_RQV = processed_probs(target_logits_RQV, temperature_R, top_k_R, top_p_R)
        p_draft_RN = jnp.take_along_axis(p_RQV[:, :n], draft_tokens_RN[..., None], axis=-1)[..., 0]
        if argmax_drafts:
            q_draft_RN = jnp.ones(draft_tokens_RN.shape, jnp.float32)
        else:
            q_draft_RN = jnp.take_along_axis(draft_probs_RNV, draft_tokens_RN[..., None], axis=-1)[..., 0]
        keys_RN = draw_keys(seeds_R[:, None], positions_R[:, None] + jnp.arange(n), ACCEPT_STREAM)
        u_RN = jax.vmap(jax.random.uniform)(keys_RN.reshape(-1)).reshape(num_rows, n)
        accept_RN = jnp.where(greedy_R[:, None], greedy_accept_RN, u_RN * q_draft_RN < p_draft_RN)
        accepted_R = _leading_true(accept_RN & valid_RN)

        p_RV = p_RQV[rows_R, accepted_R]
        rejected_at_R = jnp.minimum(accepted_R, n - 1)
        if argmax_drafts:
            rejected_RV = jnp.arange(vocab) == draft_tokens_RN[rows_R, rejected_at_R][:, None]
            residual_RV = jnp.where(rejected_RV, 0.0, p_RV)
        else:
            residual_RV = jnp.maximum(p_RV - draft_probs_RNV[rows_R, rejected_at_R], 0.0)
        use_residual_R = (accepted_R < num_drafts_R) & (residual_RV.sum(-1) > 0)
        weights_RV = jnp.where(use_residual_R[:, None], residual_RV, p_RV)
        sampled_R = sample_tokens(weights_RV, seeds_R, positions_R + accepted_R, TARGET_STREAM)
        return accepted_R, jnp.where(greedy_R, argmax_RQ[rows_R, accepted_R], sampled_R)

    if greedy:
        accepted_R, next_R = greedy_only()
    else:
        accepted_R, next_R = lax.cond(jnp.all(greedy_R), greedy_only, general)
    k_Q = jnp.arange(num_verify)
    drafts_RQ = jnp.pad(draft_tokens_RN.astype(jnp.int32), ((0, 0), (0, 1)))
    tokens_RQ = jnp.where(
        k_Q < accepted_R[:, None], drafts_RQ, jnp.where(k_Q == accepted_R[:, None], next_R[:, None], -1)
    )
    return tokens_RQ, accepted_R.astype(jnp.int32)


# Most likely alternatives reported with each token's log-probability (OpenAI's top_logprobs limit).
MAX_TOP_LOGPROBS = 20


def token_logprobs(logits_RQV, tokens_RQ):
    """(logprob_RQ, top_ids_RQJ, top_logprobs_RQJ): under the log-softmax of the raw logits
    (no temperature or truncation, as vLLM reports by default), each token's log-probability
    and the `MAX_TOP_LOGPROBS` most likely tokens' (a token < 0, no token, reads id 0's)."""
    logprobs_RQV = jax.nn.log_softmax(logits_RQV.astype(jnp.float32), axis=-1)
    logprob_RQ = jnp.take_along_axis(logprobs_RQV, jnp.maximum(tokens_RQ, 0)[..., None], axis=-1)[..., 0]
    top_logprobs_RQJ, top_ids_RQJ = lax.top_k(logprobs_RQV, min(MAX_TOP_LOGPROBS, logprobs_RQV.shape[-1]))
    return logprob_RQ, top_ids_RQJ.astype(jnp.int32), top_logprobs_RQJ


def adjusted_logits(logits_RQV, token_pos_RQ, bias_ids_RW, bias_RW, min_stop_pos_R, stop_ids_RE):
    """The logits with each row's logit bias added (`bias_ids_RW` < 0: no entry) and its stop
    tokens made impossible (-inf) for tokens at positions before `min_stop_pos_R` (its
    prompt length plus min_tokens); `token_pos_RQ`: the position of the token each logits
    row gives. Applied before verification and sampling alike, so verify blocks and single
    steps draw from the same distribution."""
    num_rows, _, vocab = logits_RQV.shape
    rows_R1 = jnp.arange(num_rows)[:, None]
    bias_RV = jnp.zeros((num_rows, vocab), jnp.float32).at[rows_R1, jnp.maximum(bias_ids_RW, 0)].add(
        jnp.where(bias_ids_RW >= 0, bias_RW, 0.0))
    is_stop_RV = jnp.zeros((num_rows, vocab), bool).at[rows_R1, jnp.maximum(stop_ids_RE, 0)].max(stop_ids_RE >= 0)
    early_RQ = token_pos_RQ < min_stop_pos_R[:, None]
    logits_RQV = logits_RQV.astype(jnp.float32) + bias_RV[:, None, :]
    return jnp.where(early_RQ[:, :, None] & is_stop_RV[:, None, :], -jnp.inf, logits_RQV)


def penalized_logits(logits_RQV, counts_RQV, seen_RQV, presence_R, frequency_R, repetition_R):
    """vLLM's penalties: the repetition penalty divides positive logits (multiplies negative
    ones) of tokens seen in the prompt or the output so far (`seen_RQV`); the frequency and
    presence penalties subtract per output occurrence (`counts_RQV`) and once per token
    present in the output."""
    logits_RQV = logits_RQV.astype(jnp.float32)
    repetition = repetition_R[:, None, None]
    logits_RQV = jnp.where(seen_RQV, jnp.where(logits_RQV > 0, logits_RQV / repetition, logits_RQV * repetition),
                           logits_RQV)
    return (logits_RQV - frequency_R[:, None, None] * counts_RQV
            - presence_R[:, None, None] * (counts_RQV > 0).astype(jnp.float32))
