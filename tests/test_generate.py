"""generate / generate_autoregressive: lossless against autoregressive decoding, transformers
and the z-lab reference loop; seeded sampling independent of the batch; bad input refused."""

import time

import numpy as np
import pytest
import torch

import dflash_jax
from conftest import drafter_config_dict, favour_two_tokens, hf_greedy, make_hf_target, make_zlab_drafter, save_hf
from dflash_jax.generate import generate, generate_autoregressive
from dflash_jax.kernels import Kernels

PROMPTS = [[5, 6, 7], list(range(20, 37)), list(range(40, 80)) + [3, 4]]


def biased_target(seed=0, **overrides):
    """A random Qwen3 whose LM head is dominated by a few tokens along random directions, so
    greedy outputs are repetitive and a random drafter's guesses are often right."""
    hf = make_hf_target("qwen3", num_hidden_layers=6, head_dim=16, seed=seed, **overrides)
    favour_two_tokens(hf, torch.Generator().manual_seed(seed))
    return hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair")
    hf = biased_target()
    config = drafter_config_dict(hf.config.to_dict(), dflash_config={"mask_token_id": 95, "block_size": 8})
    zlab = make_zlab_drafter(config, seed=1)
    target = dflash_jax.load_target(save_hf(hf, tmp / "target"))
    drafter = dflash_jax.load_drafter(save_hf(zlab, tmp / "drafter", config))
    return hf, zlab, target, drafter


@pytest.mark.slow
def test_greedy_equals_autoregressive_and_transformers(pair):
    hf, _, target, drafter = pair
    ar = generate_autoregressive(target, PROMPTS, max_new_tokens=24)
    assert ar.token_ids == [hf_greedy(hf, p, 24) for p in PROMPTS]
    for block_size in (2, 5, 8):
        spec = generate(target, drafter, PROMPTS, max_new_tokens=24, block_size=block_size)
        assert spec.token_ids == ar.token_ids, block_size
        assert all(sum(lengths) + 1 == 24 for lengths in spec.accepted_lengths)
        assert all(1 <= n <= block_size for lengths in spec.accepted_lengths for n in lengths)


def test_stop_tokens_end_requests_at_different_times(pair):
    hf, _, target, drafter = pair
    ar = generate_autoregressive(target, PROMPTS, max_new_tokens=30)
    stop = ar.token_ids[1][7]  # a token request 1 emits; others may emit it at other times
    spec = generate(target, drafter, PROMPTS, max_new_tokens=30, stop_token_ids=[stop])
    ar_stop = generate_autoregressive(target, PROMPTS, max_new_tokens=30, stop_token_ids=[stop])
    assert spec.token_ids == ar_stop.token_ids
    assert spec.token_ids == [hf_greedy(hf, p, 30, stop) for p in PROMPTS]
    assert spec.token_ids[1][-1] == stop and len(spec.token_ids[1]) <= 8
    assert len({len(t) for t in spec.token_ids}) > 1


@pytest.mark.slow
def test_parameters_changed_between_calls_are_used(tmp_path):
    """generate reads a model's parameters at every call (no copy kept between calls): after
    swapping two tokens' LM-head columns, its output follows transformers with the same swap."""
    hf = biased_target(seed=3)
    target = dflash_jax.load_target(save_hf(hf, tmp_path / "target"))
    assert not target.cfg.tie_word_embeddings  # the swap below touches the LM head only
    prompt = PROMPTS[1]
    before = generate_autoregressive(target, [prompt], max_new_tokens=16).token_ids[0]
    assert before == hf_greedy(hf, prompt, 16) and {10, 20} & set(before)
    with torch.no_grad():
        hf.lm_head.weight[[10, 20]] = hf.lm_head.weight[[20, 10]].clone()
    columns = np.arange(target.cfg.vocab_size)
    columns[[10, 20]] = [20, 10]
    target.lm_head.kernel[...] = target.lm_head.kernel[...][:, columns]
    after = generate_autoregressive(target, [prompt], max_new_tokens=16).token_ids[0]
    assert after != before and after == hf_greedy(hf, prompt, 16)


def zlab_generate(zlab, hf, prompt, max_new_tokens, block_size=None):
    import dflash.model as zmodel

    real_timer = zmodel._cuda_time
    zmodel._cuda_time = time.perf_counter  # its stats timer calls torch.cuda.synchronize
    try:
        stats = zmodel.dflash_generate(
            zlab, hf, torch.tensor([prompt]), max_new_tokens=max_new_tokens, stop_token_ids=None,
            block_size=block_size, return_stats=True,
        )
    finally:
        zmodel._cuda_time = real_timer
    return stats.output_ids[0, len(prompt):].tolist(), stats.acceptance_lengths


DRAFTERS = {
    "full": {},
    "sliding-window-shorter-than-context": dict(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=9,
        use_sliding_window=True,
    ),
}


@pytest.mark.slow
def test_pallas_attention_equals_reference(pair):
    """The Pallas paged-attention kernel (interpret mode on CPU) in target and drafter steps."""
    _, _, target, drafter = pair
    kwargs = dict(max_new_tokens=6, block_size=4)
    reference = generate(target, drafter, PROMPTS[:2], kernels=Kernels(attention="reference"), **kwargs)
    pallas = generate(target, drafter, PROMPTS[:2], kernels=Kernels(attention="pallas"), **kwargs)
    assert pallas.token_ids == reference.token_ids
    assert pallas.accepted_lengths == reference.accepted_lengths
    ar = generate_autoregressive(target, PROMPTS[:2], max_new_tokens=4, kernels=Kernels(attention="pallas"))
    assert ar.token_ids == [t[:4] for t in reference.token_ids]
    with pytest.raises(ValueError, match="attention kernel must be one of"):
        Kernels(attention="triton")


def dense_replay_lengths(target, drafter, prompt, generated, block_size, draft_block_size):
    """Per-cycle accepted lengths of greedy DFlash replayed with the dense API: each cycle drafts
    a block of draft_block_size from the target's features before its anchor and verifies the
    first block_size - 1 drafts against the (known) greedy text."""
    _, features = dflash_jax.target_forward(target, list(prompt) + list(generated), layer_ids=drafter.cfg.target_layer_ids)
    lengths, first = [], 0  # first: index in `generated` of the cycle's anchor
    while first + 1 < len(generated):
        block = [generated[first]] + [drafter.cfg.mask_token_id] * (draft_block_size - 1)
        drafts = np.argmax(dflash_jax.draft_logits(target, drafter, features[: len(prompt) + first], block), -1)
        truth = generated[first + 1 : first + block_size]
        accepted = next((k for k, (d, t) in enumerate(zip(drafts, truth)) if d != t), len(truth))
        lengths.append(accepted + 1)
        first += accepted + 1
    return lengths


@pytest.mark.slow
@pytest.mark.parametrize("draft_block_size", [None, 4])
def test_draft_block_size_drafts_the_trained_block_and_verifies_fewer(pair, draft_block_size):
    """block_size 4 with the drafter's own block of 8 (the default) or exactly the verified 4."""
    _, _, target, drafter = pair
    ar = generate_autoregressive(target, PROMPTS, max_new_tokens=32)
    spec = generate(target, drafter, PROMPTS, max_new_tokens=32, block_size=4, draft_block_size=draft_block_size)
    assert spec.token_ids == ar.token_ids
    for prompt, tokens, lengths in zip(PROMPTS, spec.token_ids, spec.accepted_lengths):
        replay = dense_replay_lengths(target, drafter, prompt, tokens, 4, draft_block_size or drafter.cfg.trained_block_size)
        assert lengths[:-2] == replay[: len(lengths) - 2]  # the last cycles are cut by max_new_tokens
    with pytest.raises(ValueError, match=r"draft_block_size must lie in \[4, 8\]"):
        generate(target, drafter, PROMPTS[:1], max_new_tokens=4, block_size=4, draft_block_size=3)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_matches_zlab_reference_loop(tmp_path, kind):
    hf = biased_target(seed=3)
    config = drafter_config_dict(
        hf.config.to_dict(), dflash_config={"mask_token_id": 95, "block_size": 8}, **DRAFTERS[kind]
    )
    zlab = make_zlab_drafter(config, seed=4)
    target = dflash_jax.load_target(save_hf(hf, tmp_path / "target"))
    drafter = dflash_jax.load_drafter(save_hf(zlab, tmp_path / "drafter", config))
    ours = generate(target, drafter, PROMPTS, max_new_tokens=48)
    means = []
    for prompt, tokens, lengths in zip(PROMPTS, ours.token_ids, ours.accepted_lengths):
        assert (tokens, lengths) == zlab_generate(zlab, hf, prompt, 48)
        means.append(np.mean(lengths))
    assert np.mean(means) > 1.5, means


@pytest.mark.slow
def test_same_seed_same_tokens_alone_or_in_a_batch(tmp_path):
    hf = make_hf_target("qwen3", num_hidden_layers=6, head_dim=16)
    config = drafter_config_dict(hf.config.to_dict(), dflash_config={"mask_token_id": 95, "block_size": 4})
    target = dflash_jax.load_target(save_hf(hf, tmp_path / "target"))
    drafter = dflash_jax.load_drafter(save_hf(make_zlab_drafter(config), tmp_path / "drafter", config))
    kwargs = dict(max_new_tokens=20, temperature=1.5, top_k=40, top_p=0.95, seed=7)
    alone = generate(target, drafter, [PROMPTS[1]], **kwargs)
    others = [list(range(i, i + 3 + 2 * i)) for i in range(1, 8)]
    batch = generate(target, drafter, others[:4] + [PROMPTS[1]] + others[4:], **kwargs)
    assert batch.token_ids[4] == alone.token_ids[0]
    assert generate(target, drafter, [PROMPTS[1]], **{**kwargs, "seed": 8}).token_ids != alone.token_ids


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ([[]], {}, "prompt 0 is empty"),
        ([[1, 96]], {}, "outside the vocabulary"),
        ([[1] * 250], {}, "exceeds the model's max length 256"),
        ([[1]], dict(temperature=-1.0), "temperature must be >= 0"),
        ([[1]], dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
        ([[1]], dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
        ([[1]], dict(top_k=-2), "top_k must be a non-negative integer"),
        ([[1]], dict(block_size=1), r"block_size must lie in \[2, 8\]"),
        ([[1]], dict(block_size=9), r"block_size must lie in \[2, 8\]"),
        ([[1]], dict(max_new_tokens=0), "max_new_tokens must be at least 1"),
        ([], {}, "non-empty list"),
    ],
)
def test_bad_input_is_refused(pair, prompts, kwargs, message):
    _, _, target, drafter = pair
    with pytest.raises(ValueError, match=message):
        generate(target, drafter, prompts, **{"max_new_tokens": 10, **kwargs})


def test_drafter_for_another_target_is_refused(pair, tmp_path):
    _, _, _, drafter = pair
    other = dflash_jax.load_target(save_hf(make_hf_target("qwen3", num_hidden_layers=2), tmp_path / "t"))
    with pytest.raises(ValueError, match="target has 2 layers"):
        generate(other, drafter, [[1, 2]], max_new_tokens=4)


def test_num_traces_counts_each_new_program_once(pair):
    """The benchmarks' door: a call of new shapes traces one program, the same call again none."""
    from dflash_jax.generate import num_traces

    _, _, target, _ = pair
    prompts = [list(range(30, 63))]  # a prompt length no other test compiles for
    before = num_traces()
    generate_autoregressive(target, prompts, max_new_tokens=3)
    traced = num_traces()
    generate_autoregressive(target, prompts, max_new_tokens=3)
    assert traced == before + 1 and num_traces() == traced


@pytest.mark.parametrize("speculative", [True, False])
def test_compile_only_compiles_what_the_next_call_runs(pair, caplog, speculative):
    """A compile-only call decodes nothing and compiles the program; the same call then runs
    it without compiling (a warm-up that costs no decode)."""
    import jax

    _, _, target, drafter = pair
    prompts = [list(range(50, 61))]  # a prompt length no other test compiles for
    options = dict(max_new_tokens=9, block_size=3) if speculative else dict(max_new_tokens=9)

    def decode(**more):
        if speculative:
            return generate(target, drafter, prompts, **options, **more)
        return generate_autoregressive(target, prompts, **options, **more)

    def compiled_programs():
        return [r for r in caplog.records if r.getMessage().startswith("Finished XLA compilation of jit(_program)")]

    with jax.log_compiles(True), caplog.at_level("WARNING"):
        warm = decode(compile_only=True)
        assert warm.token_ids == [[]] and warm.accepted_lengths == [[]] and warm.elapsed_s > 0
        assert len(compiled_programs()) == 1
        caplog.clear()
        out = decode()
        assert compiled_programs() == []
    assert len(out.token_ids[0]) == 9
