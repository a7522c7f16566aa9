"""Sampling: processed distributions vs the z-lab definitions, losslessness of the rejection
sampler by chi-square, greedy verification, and batch invariance of the seeded draws."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import chi_square_pvalue
from dflash_jax import sampling

P_MIN = 1e-3  # chi-square threshold; every test below uses fixed seeds, so none is flaky
processed_probs = jax.jit(sampling.processed_probs)
rejection_sample = jax.jit(sampling.rejection_sample, static_argnames=("greedy", "argmax_drafts"))


def reference_probs(logits_V, temperature, top_k, top_p):
    """numpy, one row, written from dflash.model._sampling_probs (ties: lowest index first)."""
    logits_V = np.asarray(logits_V, np.float64)
    vocab = logits_V.shape[0]
    if temperature == 0:
        return np.eye(vocab)[np.argmax(logits_V)]
    scores = logits_V / temperature
    kept = np.argsort(-scores, kind="stable")
    if 0 < top_k < vocab:
        kept = kept[:top_k]
    probs = np.exp(scores[kept] - scores[kept].max())
    probs /= probs.sum()  # descending, as kept is sorted
    if top_p < 1.0:
        keep = np.cumsum(probs) - probs < top_p
        kept, probs = kept[keep], probs[keep] / probs[keep].sum()
    out = np.zeros(vocab)
    out[kept] = probs
    return out


def token_pvalue(tokens, probs_V) -> float:
    """p-value of `tokens` being draws from probs_V."""
    return chi_square_pvalue(np.bincount(np.asarray(tokens), minlength=len(probs_V)), probs_V)


PARAM_CASES = {
    "temperature": (0.8, 0, 1.0),
    "top_k": (1.0, 3, 1.0),
    "top_p": (1.5, 0, 0.8),
    "top_k_top_p": (1.3, 5, 0.9),
}


@pytest.mark.parametrize(
    "vocab, top_ks",
    [(50, [0, 1, 5, 20, 50, 53]), (200, [1, 5, 12, sampling.TOP_K_FAST]), (200, [0, 1, 20, 100, 200])],
    ids=["small_vocab", "top_k_fast_path", "full_ranking"],
)
def test_processed_probs_matches_reference(vocab, top_ks):
    rng = np.random.default_rng(0)
    rows = 64
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
    temperature = rng.choice([0.0, 0.3, 1.0, 1.7], rows).astype(np.float32)
    top_k = rng.choice(top_ks, rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.05, 0.5, 0.9], rows).astype(np.float32)
    ours = np.asarray(processed_probs(logits, temperature, top_k, top_p))
    ref = np.stack([reference_probs(*args) for args in zip(logits, temperature, top_k, top_p)])
    np.testing.assert_allclose(ours, ref, atol=2e-6)
    np.testing.assert_array_equal(ours > 0, ref > 0)


def test_threshold_path_breaks_ties_like_a_stable_sort():
    """Many exactly tied scores (small integer logits, zeros of both signs): top-k beyond
    TOP_K_FAST and top-p take the threshold path, top-k within it the fast path; on both,
    boundary ties (-0.0 and 0.0 too) must go to the lowest indices."""
    rng = np.random.default_rng(3)
    rows, vocab = 96, 97
    logits = rng.integers(-2, 2, (rows, vocab)).astype(np.float32)
    logits *= rng.choice(np.float32([1, -1]), (rows, vocab))
    temperature = rng.choice([0.5, 1.0, 2.0], rows).astype(np.float32)
    top_k = rng.choice([0, 7, 17, 30, 60, 96], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.1, 0.37, 0.8, 0.99], rows).astype(np.float32)
    ref = np.stack([reference_probs(*args) for args in zip(logits, temperature, top_k, top_p)])
    assert sampling.threshold_digit_bits(8) != sampling.threshold_digit_bits(rows)  # two widths below
    for r in (rows, 8):  # the threshold searches settle more bits per pass for few rows
        ours = np.asarray(processed_probs(logits[:r], temperature[:r], top_k[:r], top_p[:r]))
        np.testing.assert_array_equal(ours > 0, ref[:r] > 0)
        np.testing.assert_allclose(ours, ref[:r], atol=2e-6)


def test_threshold_mask_keeps_the_sorts_tokens_at_every_digit_width():
    """The benchmark's door: `threshold_truncation_mask` at any bits per pass keeps exactly the
    tokens of the full sort `truncation_mask(..., vocab)`."""
    rng = np.random.default_rng(4)
    rows, vocab = 6, 50
    scores = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32) * 3)
    probs = jax.nn.softmax(scores, -1)
    top_k = jnp.asarray([1, 5, 17, 50, 30, 2], jnp.int32)
    top_p = jnp.asarray([1.0, 0.9, 0.5, 0.3, 1.0, 0.99], jnp.float32)
    use_p = top_p < 1
    want = np.asarray(sampling.truncation_mask(scores, probs, top_k, top_p, use_p, vocab))
    for bits in (1, 2, 4, 8):
        got = sampling.threshold_truncation_mask(scores, probs, top_k, top_p, use_p, digit_bits=bits)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_processed_probs_matches_zlab():
    torch = pytest.importorskip("torch")
    zlab = pytest.importorskip("dflash.model")
    logits = np.random.default_rng(1).normal(size=(3, 40)).astype(np.float32) * 2
    for temperature, top_k, top_p in PARAM_CASES.values():
        ref = zlab._sampling_probs(torch.from_numpy(logits), temperature, top_p, top_k).numpy()
        params = (np.full(3, x) for x in (temperature, top_k, top_p))
        np.testing.assert_allclose(processed_probs(logits, *params), ref, atol=2e-6)


def test_processed_probs_broadcasts_over_rows_and_breaks_ties_low():
    logits = np.random.default_rng(2).normal(size=(2, 3, 12)).astype(np.float32)
    temperature, top_k, top_p = np.array([0.5, 0.0], np.float32), np.array([4, 0]), np.array([0.9, 1.0])
    ours = processed_probs(logits, temperature, top_k, top_p)
    flat = processed_probs(logits.reshape(6, 12), *(np.repeat(x, 3) for x in (temperature, top_k, top_p)))
    np.testing.assert_array_equal(ours, np.asarray(flat).reshape(2, 3, 12))

    # A row's probabilities do not depend on which ranking path its batch takes.
    row = np.random.default_rng(7).normal(size=(1, 300)).astype(np.float32)
    alone = processed_probs(row, np.array([0.7]), np.array([0]), np.array([1.0]))
    batched = processed_probs(np.concatenate([row, row]), np.array([0.7, 1.0]), np.array([0, 3]), np.array([1.0, 0.5]))
    np.testing.assert_array_equal(alone[0], batched[0])
    top_k_row = (np.array([0.7]), np.array([sampling.TOP_K_FAST]), np.array([0.9]))
    fast = processed_probs(row, *top_k_row)
    full = processed_probs(np.concatenate([row, row]), *(np.append(x, y) for x, y in zip(top_k_row, (1.0, 0, 0.5))))
    np.testing.assert_allclose(fast[0], full[0], rtol=1e-6, atol=0)
    np.testing.assert_array_equal(fast[0] > 0, full[0] > 0)

    tied = np.array([[1.0, 2.0, 2.0, 0.0, 2.0]] * 2, np.float32)
    probs = processed_probs(tied, np.array([0.0, 1.0]), np.array([0, 2]), np.array([1.0, 1.0]))
    np.testing.assert_array_equal(probs[0], [0, 1, 0, 0, 0])
    np.testing.assert_allclose(probs[1], [0, 0.5, 0.5, 0, 0])


def test_validate_sampling_params():
    sampling.validate_sampling_params(np.array([0.0, 0.7]), np.array([0, 5]), np.array([1.0, 0.1]))
    for bad in [(-0.1, 0, 1.0), (float("nan"), 0, 1.0), (1.0, -1, 1.0), (1.0, 2.5, 1.0), (1.0, 0, 0.0), (1.0, 0, 1.1)]:
        with pytest.raises(ValueError):
            sampling.validate_sampling_params(*bad)


# Losslessness: fixed target rows p_k and a deliberately poor drafter q_k (the target's logits,
# damped and noised), many requests with distinct seeds, random positions and num_drafts.
# Drafts drawn from q ("sample") or its argmax ("argmax": the same drafts for every request).
VOCAB, N_DRAFTS, N_SAMPLES = 8, 3, 100_000


@functools.partial(jax.jit, static_argnames="argmax")
def _speculate(target_logits_SV, draft_logits_NV, temperature, top_k, top_p, seeds_R, positions_R, num_drafts_R,
               argmax=False):
    def full(x, dtype):
        return jnp.full(seeds_R.shape, x, dtype)

    params = (full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32))
    draft_logits_RNV = jnp.broadcast_to(draft_logits_NV, seeds_R.shape + draft_logits_NV.shape)
    target_logits_RSV = jnp.broadcast_to(target_logits_SV, seeds_R.shape + target_logits_SV.shape)
    drafts_RN, q_RNV = sampling.sample_drafts(draft_logits_RNV, *params, seeds_R, positions_R, argmax=argmax)
    tokens_RS, accepted_R = sampling.rejection_sample(
        target_logits_RSV, drafts_RN, q_RNV, num_drafts_R, *params, seeds_R, positions_R, argmax_drafts=argmax
    )
    p_RSV = sampling.processed_probs(target_logits_RSV, *params)
    from_p_R = sampling.sample_tokens(p_RSV[:, 0], seeds_R, positions_R, sampling.TARGET_STREAM)
    return drafts_RN, tokens_RS, accepted_R, from_p_R


def _lossless_setup(temperature, top_k, top_p, argmax=False):
    rng = np.random.default_rng(3)
    target_logits = rng.normal(size=(N_DRAFTS + 1, VOCAB)).astype(np.float32)
    draft_logits = (0.5 * target_logits[:N_DRAFTS] + rng.normal(size=(N_DRAFTS, VOCAB))).astype(np.float32)
    seeds = np.arange(N_SAMPLES, dtype=np.int32)
    positions = rng.integers(0, 4096, N_SAMPLES).astype(np.int32)
    num_drafts = rng.integers(0, N_DRAFTS + 1, N_SAMPLES).astype(np.int32)
    outs = _speculate(target_logits, draft_logits, temperature, top_k, top_p, seeds, positions, num_drafts,
                      argmax=argmax)
    p = np.stack([reference_probs(row, temperature, top_k, top_p) for row in target_logits])
    return p, num_drafts, *(np.asarray(x) for x in outs)


@pytest.mark.parametrize("draft_sampling", sampling.DRAFT_SAMPLING)
@pytest.mark.parametrize("case", PARAM_CASES)
def test_rejection_sampling_is_lossless(case, draft_sampling):
    p, num_drafts, drafts, tokens, accepted, _ = _lossless_setup(*PARAM_CASES[case], argmax=draft_sampling == "argmax")
    assert np.all(accepted <= num_drafts)
    assert np.all(tokens[np.arange(N_SAMPLES), accepted] >= 0)
    assert np.all((tokens >= 0) == (np.arange(N_DRAFTS + 1) <= accepted[:, None]))
    for k in range(N_DRAFTS + 1):
        exists = accepted >= k
        assert exists.sum() >= 2_000
        assert token_pvalue(tokens[exists, k], p[k]) > P_MIN, f"output token {k}"


@pytest.mark.parametrize("draft_sampling", sampling.DRAFT_SAMPLING)
def test_chi_square_catches_wrong_samplers(draft_sampling):
    p, num_drafts, drafts, tokens, accepted, from_p = _lossless_setup(*PARAM_CASES["temperature"],
                                                                      argmax=draft_sampling == "argmax")
    assert token_pvalue(tokens[:, 0], p[0]) > P_MIN
    always_accept = np.where(num_drafts > 0, drafts[:, 0], tokens[:, 0])
    assert token_pvalue(always_accept, p[0]) < P_MIN
    replacement_from_p = np.where(accepted > 0, drafts[:, 0], from_p)
    assert token_pvalue(replacement_from_p, p[0]) < P_MIN


@pytest.mark.slow
def test_argmax_drafts_verify_as_one_hot_q():
    """argmax_drafts=True gives the tokens of the general test with q = one_hot(drafts), for
    sampled, truncated and greedy rows alike; a draft outside p's support is never accepted."""
    rng = np.random.default_rng(9)
    rows, n, vocab = 64, 4, 16
    logits = rng.normal(size=(rows, n + 1, vocab)).astype(np.float32)
    params = (rng.choice([0.0, 0.5, 1.0, 1.5], rows).astype(np.float32), rng.choice([0, 1, 4], rows).astype(np.int32),
              rng.choice([1.0, 0.7], rows).astype(np.float32), np.arange(rows, dtype=np.int32),
              rng.integers(0, 500, rows).astype(np.int32))
    # Half the drafts are the target's argmaxes (often accepted), the rest anything.
    drafts = np.where(rng.random((rows, n)) < 0.5, logits[:, :n].argmax(-1), rng.integers(0, vocab, (rows, n)))
    drafts = drafts.astype(np.int32)
    num_drafts = rng.integers(0, n + 1, rows).astype(np.int32)
    one_hot = np.asarray(jax.nn.one_hot(drafts, vocab))
    tokens, accepted = rejection_sample(logits, drafts, one_hot, num_drafts, *params)
    tokens_argmax, accepted_argmax = rejection_sample(logits, drafts, None, num_drafts, *params, argmax_drafts=True)
    np.testing.assert_array_equal(tokens_argmax, tokens)
    np.testing.assert_array_equal(accepted_argmax, accepted)
    assert 0 < np.mean(accepted) < np.mean(num_drafts)
    p = np.asarray(processed_probs(logits, *params[:3]))
    draft_p = np.take_along_axis(p[:, :n], drafts[..., None], axis=-1)[..., 0]
    first_unsupported = np.where((draft_p == 0).any(1), (draft_p == 0).argmax(1), n)
    assert np.all(np.asarray(accepted) <= first_unsupported) and np.any(first_unsupported < num_drafts)


def test_drafts_follow_q():
    temperature, top_k, top_p = PARAM_CASES["top_k_top_p"]
    rng = np.random.default_rng(4)
    draft_logits = rng.normal(size=(N_DRAFTS, VOCAB)).astype(np.float32)
    rows = 20_000
    drafts, _ = jax.jit(sampling.sample_drafts)(
        np.broadcast_to(draft_logits, (rows, N_DRAFTS, VOCAB)),
        np.full(rows, temperature, np.float32),
        np.full(rows, top_k, np.int32),
        np.full(rows, top_p, np.float32),
        np.arange(rows, dtype=np.int32) + 1000,
        np.full(rows, 17, np.int32),
    )
    for j in range(N_DRAFTS):
        q = reference_probs(draft_logits[j], temperature, top_k, top_p)
        assert token_pvalue(np.asarray(drafts)[:, j], q) > P_MIN


def _greedy_case():
    rng = np.random.default_rng(5)
    rows, n, vocab = 6, 4, 16
    logits = rng.normal(size=(rows, n + 1, vocab)).astype(np.float32)
    argmax = logits.argmax(-1)
    matches = np.array([0, 1, 2, 4, 4, 3])
    num_drafts = np.array([4, 4, 4, 4, 2, 0])
    drafts = np.where(np.arange(n) < matches[:, None], argmax[:, :n], (argmax[:, :n] + 1) % vocab)
    q = np.asarray(jax.nn.one_hot(drafts, vocab))
    return logits, drafts.astype(np.int32), q, num_drafts, np.minimum(matches, num_drafts), argmax


@pytest.mark.slow
def test_greedy_verification():
    logits, drafts, q, num_drafts, expected, argmax = _greedy_case()
    rows = len(drafts)
    zeros = np.zeros(rows)
    tokens, accepted = rejection_sample(
        logits, drafts, q, num_drafts, zeros, zeros.astype(np.int32), zeros + 1, np.arange(rows), zeros.astype(np.int32)
    )
    np.testing.assert_array_equal(accepted, expected)
    for r, a in enumerate(expected):
        np.testing.assert_array_equal(tokens[r, :a], drafts[r, :a])
        assert tokens[r, a] == argmax[r, a]
        assert np.all(np.asarray(tokens[r, a + 1 :]) == -1)

    # The same greedy rows next to a sampled one take the general path and agree.
    temperature = np.concatenate([zeros, [0.9]])
    extra = lambda x, v: np.concatenate([x, [v]])  # noqa: E731
    tokens2, accepted2 = rejection_sample(
        extra(logits, logits[0]), extra(drafts, drafts[0]), extra(q, q[0]), extra(num_drafts, 4),
        temperature, np.zeros(rows + 1, np.int32), np.ones(rows + 1), np.arange(rows + 1), np.zeros(rows + 1, np.int32),
    )  # fmt: skip
    np.testing.assert_array_equal(tokens2[:rows], tokens)
    np.testing.assert_array_equal(accepted2[:rows], accepted)

    # Compiled greedy-only (no draft probabilities at all): the same.
    tokens3, accepted3 = rejection_sample(
        logits, drafts, None, num_drafts, zeros, zeros.astype(np.int32), zeros + 1, np.arange(rows),
        zeros.astype(np.int32), greedy=True,
    )
    np.testing.assert_array_equal(tokens3, tokens)
    np.testing.assert_array_equal(accepted3, accepted)


def test_static_greedy_sampling_matches_the_runtime_check():
    logits = np.random.default_rng(8).normal(size=(3, 5, 40)).astype(np.float32)
    zeros = np.zeros(3)
    params = (zeros, zeros.astype(np.int32), zeros + 1, np.arange(3))
    positions = np.array([4, 9, 2])
    np.testing.assert_array_equal(sampling.sample_target(logits[:, 0], *params, positions, greedy=True),
                                  sampling.sample_target(logits[:, 0], *params, positions))
    tokens, probs = sampling.sample_drafts(logits, *params, positions)
    tokens_static, probs_static = sampling.sample_drafts(logits, *params, positions, greedy=True)
    np.testing.assert_array_equal(tokens_static, tokens)
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    assert probs_static is None and probs.shape == logits.shape
    # argmax drafts: the argmax for sampled rows too, no probabilities.
    sampled = (zeros + 1.0, zeros.astype(np.int32) + 3, zeros + 0.5, np.arange(3))
    tokens_argmax, probs_argmax = sampling.sample_drafts(logits, *sampled, positions, argmax=True)
    np.testing.assert_array_equal(tokens_argmax, logits.argmax(-1))
    assert probs_argmax is None
    with pytest.raises(ValueError, match="draft probs"):  # sampling needs q
        rejection_sample(logits, tokens[:, :4], None, np.full(3, 4), zeros, *params[1:], positions)


def test_residual_all_zero_falls_back_to_p():
    # q == p with top_k = 1: the draft has p = q = 0, is rejected, max(p - q, 0) is all zero.
    logits = np.array([[[0.0, 3.0, 1.0, 2.0]] * 2], np.float32)
    params = (np.array([1.0]), np.array([1]), np.array([1.0]))
    p = processed_probs(logits, *params)
    tokens, accepted = rejection_sample(logits, np.array([[0]]), p[:, :1], np.array([1]), *params, np.array([3]), np.array([9]))
    assert int(accepted[0]) == 0 and int(tokens[0, 0]) == 1


def _random_request(rng, vocab=32, n=4):
    temperature = rng.choice([0.0, 0.6, 1.0])
    return dict(
        draft_logits=rng.normal(size=(n, vocab)).astype(np.float32),
        target_logits=rng.normal(size=(n + 1, vocab)).astype(np.float32),
        temperature=np.float32(temperature),
        top_k=np.int32(rng.choice([0, 8])),
        top_p=np.float32(rng.choice([1.0, 0.9])),
        seed=np.int32(rng.integers(0, 2**31 - 1)),
        position=np.int32(rng.integers(0, 1000)),
        num_drafts=np.int32(rng.integers(0, n + 1)),
    )


@functools.partial(jax.jit, static_argnames="argmax")
def _step(batch, argmax):
    params = (batch["temperature"], batch["top_k"], batch["top_p"])
    drafts, q = sampling.sample_drafts(batch["draft_logits"], *params, batch["seed"], batch["position"], argmax=argmax)
    tokens, accepted = sampling.rejection_sample(
        batch["target_logits"], drafts, q, batch["num_drafts"], *params, batch["seed"], batch["position"],
        argmax_drafts=argmax,
    )
    return drafts, tokens, accepted


@pytest.mark.slow
@pytest.mark.parametrize("draft_sampling", sampling.DRAFT_SAMPLING)
def test_batch_invariance(draft_sampling):
    rng = np.random.default_rng(6)
    for focus in [
        dict(_random_request(rng), temperature=np.float32(0.9), num_drafts=np.int32(4), top_p=np.float32(0.95)),
        dict(_random_request(rng), temperature=np.float32(0.0)),
    ]:
        others = [_random_request(rng) for _ in range(7)]
        batch = others[:5] + [focus] + others[5:]
        stack = lambda reqs: {k: np.stack([r[k] for r in reqs]) for k in focus}  # noqa: E731
        alone = _step(stack([focus]), draft_sampling == "argmax")
        together = _step(stack(batch), draft_sampling == "argmax")
        for x, y in zip(alone, together):
            np.testing.assert_array_equal(x[0], y[5])


def test_streams_and_positions_give_distinct_draws():
    probs = np.full((3, 1000), 1e-3, np.float32)
    draws = [
        sampling.sample_tokens(probs, 7, np.array([5, 6, 5]), sampling.DRAFT_STREAM),
        sampling.sample_tokens(probs, 7, np.array([5, 6, 5]), sampling.TARGET_STREAM),
        sampling.sample_tokens(probs, 8, np.array([5, 6, 5]), sampling.DRAFT_STREAM),
    ]
    assert int(draws[0][0]) == int(draws[0][2])  # same (seed, stream, position), different row
    assert len({int(d[0]) for d in draws} | {int(draws[0][1])}) == 4
    # Scalar seed and position: one key, the same draw in every row.
    assert len(set(np.asarray(sampling.sample_tokens(probs, 7, 5, sampling.DRAFT_STREAM)).tolist())) == 1
