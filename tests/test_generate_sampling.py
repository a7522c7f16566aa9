"""End to end losslessness at temperature > 0: generate()'s tokens follow the target's own
sampling distribution (chi-square), with a tiny vocabulary and a deliberately poor drafter,
whose drafts are drawn from it or are its argmaxes."""

import jax
import numpy as np
import pytest
from flax import nnx

import dflash_jax
from conftest import chi_square_pvalue
from dflash_jax import sampling
from dflash_jax.config import parse_config
from dflash_jax.generate import generate
from dflash_jax.models import Drafter, Target

VOCAB = 6
PROMPT = [1, 4, 2]
NUM_SAMPLES = 20_000
TARGET = dict(
    architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
)
DRAFTER = dict(
    architectures=["DFlashDraftModel"], vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_target_layers=2,
    dflash_config={"mask_token_id": 5, "block_size": 3, "target_layer_ids": [0]},
)


def scaled(model, factor):
    """Multiply every parameter: larger weights give the tiny models peaked, distinct outputs."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * factor, state))


def target_probs(target, prefix, params):
    logits = dflash_jax.target_forward(target, prefix)[0][-1]
    return np.asarray(sampling.processed_probs(logits[None], *[np.array([v]) for v in params]))[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "params, draft_sampling",
    [((1.0, 0, 1.0), "sample"), ((0.8, 3, 1.0), "sample"), ((1.2, 0, 0.7), "sample"),
     ((1.0, 0, 1.0), "argmax"), ((0.9, 3, 0.8), "argmax")],
    ids=["temperature", "top-k", "top-p", "argmax-temperature", "argmax-top-k-top-p"],
)
def test_generated_tokens_follow_the_target_distribution(params, draft_sampling):
    temperature, top_k, top_p = params
    target = scaled(Target(parse_config(TARGET), rngs=nnx.Rngs(0)), 3.0)
    drafter = scaled(Drafter(parse_config(DRAFTER), rngs=nnx.Rngs(5)), 3.0)
    result = generate(
        target, drafter, [PROMPT] * NUM_SAMPLES, max_new_tokens=3, temperature=temperature,
        top_k=top_k, top_p=top_p, seed=list(range(NUM_SAMPLES)), draft_sampling=draft_sampling,
    )
    lengths = [n for per_request in result.accepted_lengths for n in per_request]
    # Drafts do get accepted: the rejection sampler is exercised (less by the random drafter's
    # argmax, a token the target gives about a tenth of its mass).
    assert np.mean(lengths) > (1.2 if draft_sampling == "sample" else 1.05)
    assert np.mean(lengths) < 2.8  # ... and rejected

    observed = np.zeros((VOCAB,) * 3)
    for tokens in result.token_ids:
        observed[tuple(tokens)] += 1
    expected = np.zeros_like(observed)
    p0 = target_probs(target, PROMPT, params)
    for t0 in range(VOCAB):
        p1 = target_probs(target, PROMPT + [t0], params)
        for t1 in range(VOCAB):
            expected[t0, t1] = p0[t0] * p1[t1] * target_probs(target, PROMPT + [t0, t1], params)
    assert chi_square_pvalue(observed, expected) > 0.001
