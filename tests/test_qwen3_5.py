"""Qwen3.5 hybrid targets (transformers' Qwen3_5ForCausalLM as the oracle), float32 on CPU:
three gated-delta-net layers and one gated full-attention layer with partial RoPE and
zero-centred norms, converted with the CLI; logits and tapped features against transformers;
the gated delta rule against transformers' own recurrent and chunked forms; export round
trip."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dflash_jax
from conftest import rel_err, save_hf
from dflash_jax.cli import main
from dflash_jax.config import ConfigError, parse_config

SHAPES = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False)


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)


def make_qwen3_5(seed: int = 0, moe: bool = False, **overrides):
    """A tiny random transformers Qwen3.5 text model (or its MoE variant) in float32; every
    weight, the zero-centred norms, decays and biases included, drawn so that a misplaced one
    shows."""
    import transformers

    torch.manual_seed(seed)
    if moe:
        shapes = {k: v for k, v in SHAPES.items() if k != "intermediate_size"}
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**shapes, **MOE, **overrides))
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**{**SHAPES, **overrides}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "A_log")):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
            elif "mlp" in name:  # experts and router start at zero or tiny
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return model.float().eval()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen3_5")
    hf = make_qwen3_5()
    folder = save_hf(hf, tmp / "hf")
    assert main(["convert", folder, str(tmp / "converted")]) == 0
    return hf, dflash_jax.load_target(tmp / "converted"), tmp


def hf_forward(hf, ids):
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].numpy(), [h[0].numpy() for h in out.hidden_states]


def transformers_logprobs(hf, prompt, generated) -> np.ndarray:
    """float64 log-probabilities transformers gives each generated token after its prefix."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0].double()
    return torch.log_softmax(logits, -1)[len(prompt) - 1: -1].gather(1, torch.tensor(generated)[:, None])[:, 0].numpy()


def test_config_reads_the_hybrid_layout(converted):
    _, target, _ = converted
    cfg = target.cfg
    assert cfg.linear_attention.layers == (0, 1, 2) and not cfg.is_linear_attention(3)
    assert cfg.kv_layers == (3,)  # the paged cache keeps the attention layer's keys and values only
    assert cfg.attention_output_gate and cfg.zero_centered_norms
    assert cfg.rope.get("partial_rotary_factor") == 0.25


def test_logits_and_features_match_transformers(converted):
    hf, target, _ = converted
    ids = np.random.default_rng(0).integers(0, 96, 37).tolist()
    want_logits, hidden = hf_forward(hf, ids)
    logits, features = dflash_jax.target_forward(target, ids, layer_ids=[0, 2])
    assert rel_err(logits, want_logits) < 1e-4
    # hidden_states[i + 1] is layer i's output (the last one, the final norm's)
    np.testing.assert_allclose(features, np.concatenate([hidden[1], hidden[3]], axis=-1), rtol=1e-4, atol=1e-4)


def test_the_gated_delta_rule_matches_transformers_recurrent_and_chunked_forms():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule,
    )

    import jax.numpy as jnp

    from dflash_jax.gated_delta_rule import gated_delta_rule

    rng = np.random.default_rng(1)
    T, Hk, Hv, dk, dv = 70, 2, 4, 16, 8
    q, k = (rng.normal(size=(T, Hk, dk)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(T, Hv, dv)).astype(np.float32)
    g = -np.abs(rng.normal(size=(T, Hv))).astype(np.float32)
    beta = rng.uniform(size=(T, Hv)).astype(np.float32)
    state = rng.normal(size=(Hv, dk, dv)).astype(np.float32)
    ours, last = gated_delta_rule(*(jnp.asarray(x) for x in (q, k, v, g, beta, state)))
    args = [torch.tensor(x)[None] for x in (q, k, v, g, beta)]
    for rule in (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule):
        out, final = rule(*args, initial_state=torch.tensor(state)[None], output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
        assert rel_err(ours, out[0].numpy()) < 1e-4, rule.__name__
        assert rel_err(last, final[0].numpy()) < 1e-4, rule.__name__


def test_export_round_trip_loads_in_transformers(converted, tmp_path):
    import transformers

    from dflash_jax.formats.export_hf import export_hf

    hf, target, _ = converted
    export_hf(target, tmp_path / "exported")
    again = dflash_jax.load_target(tmp_path / "exported")
    assert again.cfg == target.cfg
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").float().eval()
    ids = [3, 14, 15, 92, 65, 35]
    np.testing.assert_allclose(hf_forward(reloaded, ids)[0], hf_forward(hf, ids)[0], rtol=1e-5, atol=1e-5)


def test_a_vision_language_checkpoint_converts_to_its_text_model(tmp_path):
    """`Qwen3_5ForConditionalGeneration` through the CLI: its vision tower skipped, its text
    model's logits those of the whole model on text (where its 3-D positions are 1-D)."""
    import transformers

    torch.manual_seed(3)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=1, spatial_merge_size=1)
    text = {**SHAPES, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    hf = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=False)).float().eval()
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "converted")]) == 0
    target = dflash_jax.load_target(tmp_path / "converted", dtype="float32")
    ids = [3, 14, 15, 92, 65, 35, 8, 9]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    logits, _ = dflash_jax.target_forward(target, ids, layer_ids=[0])
    assert rel_err(logits, want) < 1e-4


OFFICIAL_FP8_FLOAT = ("linear_attn.in_proj_a", "linear_attn.in_proj_b")  # what Qwen's own FP8 checkpoints keep float


@pytest.mark.parametrize("kind, layout, keep_float, eight_bit", [
    ("text", "qwen", OFFICIAL_FP8_FLOAT, True), ("vision-language", "compressed-tensors", (), True),
    ("text", "compressed-tensors", ("linear_attn",), False), ("text", "qwen", ("linear_attn",), False),
    ("moe", "qwen", OFFICIAL_FP8_FLOAT, True)],
    ids=["official", "every-projection", "mixers-float", "mixers-float-unlisted", "moe-official"])
def test_published_fp8_checkpoints_load_8_bit_or_as_their_dequantized_float_model(tmp_path, kind, layout, keep_float,
                                                                                 eight_bit, request):
    """FP8 projections load as the 8-bit products that hold them (the gated-delta-net layers'
    b and a, float here, read dequantized where stored 8-bit; Qwen3.5-MoE's routed and shared
    experts 8-bit, its router and shared expert gate float); a checkpoint that stores
    products held 8-bit here in float (every linear_attn module, as community FP8 checkpoints
    do, listed in its config or not) loads as the float model of its dequantized weights, its
    converted config.json float. Either way transformers' logits from the weights they stand
    for."""
    import orbax.checkpoint as ocp
    import transformers

    from conftest import write_published_fp8

    if kind == "text":
        hf, architecture = make_qwen3_5(seed=5), transformers.Qwen3_5ForCausalLM
    elif kind == "moe":
        hf, architecture = make_qwen3_5(seed=5, moe=True), transformers.Qwen3_5MoeForCausalLM
    else:
        torch.manual_seed(5)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      temporal_patch_size=1, spatial_merge_size=1)
        hf = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(
            text_config={**SHAPES, "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
            vision_config=vision, tie_word_embeddings=False))
        architecture = transformers.Qwen3_5ForConditionalGeneration
    hf.save_pretrained(tmp_path / "hf")
    write_published_fp8(tmp_path / "hf", tmp_path / "fp8", tmp_path / "reference", layout, keep_float)
    if request.node.callspec.id == "mixers-float-unlisted":
        config = json.loads((tmp_path / "fp8" / "config.json").read_text())
        config["quantization_config"]["modules_to_not_convert"] = ["lm_head"]
        (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    ids = [3, 14, 15, 92, 65, 35, 8, 9]
    with torch.no_grad():
        want = architecture.from_pretrained(tmp_path / "reference").float().eval()(
            input_ids=torch.tensor([ids])).logits[0].numpy()
    assert main(["convert", str(tmp_path / "fp8"), str(tmp_path / "converted")]) == 0
    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert ("quantization_config" in config or "quantization_config" in config.get("text_config", {})) == eight_bit
    layer = ocp.StandardCheckpointer().restore((tmp_path / "converted" / "params").absolute())["layers"]["0"]
    mixer = layer["linear_attn"]
    dtypes = [str(np.dtype(mixer[name]["kernel"].dtype)) for name in ("in_proj_qkv", "out_proj", "in_proj_a")]
    assert dtypes == (["float8_e4m3fn"] * 2 if eight_bit else ["float32"] * 2) + ["float32"]
    if kind == "moe":
        mlp = layer["mlp"]
        experts = [mlp["gate_up"], mlp["down"], mlp["shared_expert"]["down_proj"]["kernel"]]
        assert {str(np.dtype(a.dtype)) for a in experts} == {"float8_e4m3fn"}
        assert str(np.dtype(mlp["router"]["kernel"].dtype)) == "float32"
    for target in (dflash_jax.load_target(tmp_path / "converted"), dflash_jax.load_target(tmp_path / "fp8")):
        assert (target.cfg.quantization is not None) == eight_bit
        assert rel_err(dflash_jax.target_forward(target, ids, layer_ids=[0])[0], want) < 1e-4


def test_an_8_bit_weight_without_its_scale_is_refused(tmp_path):
    """A b projection (held float here, read dequantized) stored in e4m3 with its scale gone."""
    from safetensors.torch import load_file, save_file

    from conftest import write_published_fp8
    from dflash_jax.formats.hf_reader import ConversionError

    make_qwen3_5(seed=5).save_pretrained(tmp_path / "hf")
    write_published_fp8(tmp_path / "hf", tmp_path / "fp8", tmp_path / "reference", "qwen")
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    del tensors["model.layers.0.linear_attn.in_proj_b.weight_scale_inv"]
    save_file(tensors, tmp_path / "fp8" / "model.safetensors")
    with pytest.raises(ConversionError, match=r"in_proj_b.weight' is float8_e4m3fn but has no weight_scale_inv beside "
                                              r"it; the checkpoint is damaged"):
        dflash_jax.load_target(tmp_path / "fp8")


def test_vision_language_checkpoints_read_their_text_model():
    text = json.loads(json.dumps({**SHAPES, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}))
    cfg = parse_config({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
                        "vision_config": {"depth": 2}})
    assert cfg.linear_attention.layers == (0, 1, 2) and cfg.architecture == "Qwen3_5ForConditionalGeneration"
    with pytest.raises(ConfigError, match="layer_types"):
        parse_config({**text, "architectures": ["Qwen3_5ForCausalLM"], "layer_types": ["mamba"] * 4})


def test_a_memory_budget_holds_the_recurrent_states_before_pages():
    from dflash_jax.kv_cache import pages_within
    from dflash_jax.recurrent_state import RecurrentState, recurrent_state_bytes

    cfg = parse_config({**SHAPES, "architectures": ["Qwen3_5ForCausalLM"],
                        "layer_types": ["linear_attention"] * 3 + ["full_attention"]})
    for dtype in (jnp.float32, jnp.bfloat16):
        state = RecurrentState.zeros(cfg, 3, dtype)
        assert recurrent_state_bytes(cfg, 3, dtype) == sum(a.nbytes for a in jax.tree.leaves(state)) > 0
    assert pages_within(10_000, 1_000, 2_500) == 7
    with pytest.raises(ValueError, match="cannot hold the target's recurrent states"):
        pages_within(2_500, 1_000, 2_500)


@pytest.fixture(scope="module")
def decoding_pair(tmp_path_factory):
    """A Qwen3.5 target whose greedy outputs repeat (so a random drafter's drafts are often,
    not always, right) and a random z-lab DFlash-1 drafter for it, block 4."""
    from conftest import drafter_config_dict, favour_two_tokens, make_zlab_drafter

    tmp = tmp_path_factory.mktemp("qwen3_5_decoding")
    hf = make_qwen3_5(seed=2)
    favour_two_tokens(hf, torch.Generator().manual_seed(2))
    assert main(["convert", save_hf(hf, tmp / "hf"), str(tmp / "converted")]) == 0
    config = drafter_config_dict(hf.config.to_dict(), dflash_config={"mask_token_id": 95, "block_size": 4,
                                                                    "target_layer_ids": [0, 2]})
    drafter = dflash_jax.load_drafter(save_hf(make_zlab_drafter(config, seed=5), tmp / "drafter", config))
    return hf, dflash_jax.load_target(tmp / "converted"), drafter, tmp


# the last prompt is prefilled in chunks of 64 tokens (`recurrent_state.rule_by_rows`) by
# `generate`, token by token in the Engine's 16-token prefill chunks
PROMPTS = [[5, 17, 33, 2, 8, 41, 7], [40, 41, 9], np.random.default_rng(7).integers(0, 95, 70).tolist()]


def test_greedy_dflash_equals_autoregressive_and_transformers_with_partly_accepted_blocks(decoding_pair):
    """The verify blocks advance the gated-delta-net states over drafts the target rejects:
    a state that kept them would change the tokens at once."""
    from conftest import assert_greedy_dflash_exact

    hf, target, drafter, _ = decoding_pair
    assert_greedy_dflash_exact(hf, target, drafter, PROMPTS, max_new_tokens=16)


@pytest.mark.slow
def test_convert_quantize_makes_every_wide_product_8_bit_and_decodes_exactly(decoding_pair, tmp_path):
    """`convert --quantize int8` on a hybrid target: the gated-delta-net layers' q/k/v, z, out
    and MLP products are 8-bit on disk like the attention layer's (b and a, a column a head,
    stay float); the model computes what its dequantized float copy computes, and greedy DFlash
    equals its own autoregressive decoding with partly accepted blocks, also through the
    Pallas product (interpret mode)."""
    import orbax.checkpoint as ocp

    from test_quantization import dequantized

    hf, _, drafter, tmp = decoding_pair
    assert main(["convert", str(tmp / "hf"), str(tmp_path / "q"), "--quantize", "int8", "--quantize-block", "16"]) == 0
    stored = ocp.StandardCheckpointer().restore((tmp_path / "q" / "params").absolute())["layers"]
    linear_attn = stored["0"]["linear_attn"]
    eight_bit = [linear_attn[name]["kernel"] for name in ("in_proj_qkv", "in_proj_z", "out_proj")]
    eight_bit += [layer["mlp"][name]["kernel"] for layer in stored.values() for name in ("gate_up_proj", "down_proj")]
    assert {str(np.dtype(kernel.dtype)) for kernel in eight_bit} == {"int8"}
    assert {str(np.dtype(linear_attn[name]["kernel"].dtype)) for name in ("in_proj_a", "in_proj_b")} == {"float32"}
    stale = tmp_path / "stale"  # float weights under an 8-bit config (a folder an earlier version quantized)
    shutil.copytree(tmp / "converted", stale)
    shutil.copy(tmp_path / "q" / "config.json", stale / "config.json")
    with pytest.raises(ConfigError, match="holds other parameters than its config.json describes"):
        dflash_jax.load_target(stale)
    target = dflash_jax.load_target(tmp_path / "q")
    ids = PROMPTS[2]
    logits = np.asarray(dflash_jax.target_forward(target, ids)[0])
    assert rel_err(logits, np.asarray(dflash_jax.target_forward(dequantized(target), ids)[0])) <= 1e-5
    assert rel_err(logits, hf_forward(hf, ids)[0]) <= 0.05  # int8 rounding, through 70 tokens of state
    ar = dflash_jax.generate_autoregressive(target, PROMPTS, max_new_tokens=16).token_ids
    for kernels in (dflash_jax.Kernels(), dflash_jax.Kernels(quantized="pallas")):
        spec = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=16, kernels=kernels)
        assert spec.token_ids == ar
        assert any(n > 1 for lengths in spec.accepted_lengths for n in lengths)
        assert any(n < 4 for lengths in spec.accepted_lengths for n in lengths[:-1])


@pytest.mark.parametrize("rule", [dict(recurrence="pallas"), dict(recurrence="fused"),
                                  dict(recurrence="fused_decode", rule_inputs="pallas")],
                         ids=["pallas", "fused", "fused_decode-inputs"])
def test_the_delta_rule_kernel_decodes_alike(decoding_pair, rule):
    """The Pallas rule (interpret mode here; "fused": with the convolution and norms in the
    kernel; "fused_decode": so in one-token steps only, the other steps' inputs from the
    rule-inputs kernel) in the verify pass and the commit over kept tokens, and in
    autoregressive steps, against the jnp reference's autoregressive tokens; the heads' Pallas
    finish (interpret mode) rotating a quarter of each head (partial RoPE)."""
    _, target, drafter, _ = decoding_pair
    want = dflash_jax.generate_autoregressive(target, PROMPTS, max_new_tokens=12).token_ids
    kernels = dflash_jax.Kernels(heads="pallas", **rule)
    assert dflash_jax.generate_autoregressive(target, PROMPTS, max_new_tokens=12, kernels=kernels).token_ids == want
    spec = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=12, block_size=4, kernels=kernels)
    assert spec.token_ids == want
    assert any(0 < n < 4 for per_request in spec.accepted_lengths for n in per_request)


@pytest.mark.slow
def test_the_engine_stays_exact_under_chunked_prefill_preemption_and_abort(decoding_pair):
    hf, target, drafter, _ = decoding_pair
    prompts = [np.random.default_rng(i).integers(0, 95, n).tolist() for i, n in enumerate((23, 5, 17, 30, 9))]
    reference = dflash_jax.generate_autoregressive(target, prompts, max_new_tokens=20).token_ids
    # 8-token prefill chunks; 16 usable pages of 8 tokens: not enough for all five requests at once
    engine = dflash_jax.Engine(target, drafter, max_num_reqs=4, max_num_tokens=16, num_pages=17, page_size=8,
                               block_size=4, kernels=dflash_jax.Kernels(recurrence="pallas"))  # interpret mode here
    assert engine.prefix_caching and engine.scheduler.saved_states is not None  # unshared prompts: no hits
    aborted = engine.add_request(prompts[3], dflash_jax.SamplingParams(max_new_tokens=20))
    engine.step()
    engine.step()
    engine.abort(aborted)  # two steps in: its slot and state go to a request that must start afresh
    ids = [engine.add_request(p, dflash_jax.SamplingParams(max_new_tokens=20)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert [engine.output(i) for i in ids] == reference
    assert sum(engine.stats(i).num_preemptions for i in ids) > 0


@pytest.fixture(scope="module")
def slow_decay(tmp_path_factory):
    """A Qwen3.5 target whose gated-delta-net states decay slowly (A_log near -4: ~1% a
    token), so that a state 64 tokens back still shows in the logits."""
    tmp = tmp_path_factory.mktemp("qwen3_5_slow_decay")
    hf = make_qwen3_5(seed=3)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("A_log"):
                param.sub_(4.0)
    assert main(["convert", save_hf(hf, tmp / "hf"), str(tmp / "converted")]) == 0
    return hf, dflash_jax.load_target(tmp / "converted")


def test_long_prefill_rows_in_chunks_give_transformers_log_probabilities(slow_decay, decoding_pair, monkeypatch):
    """A 100-token prompt arrives while another request verifies drafts: one step holds its
    whole prompt as one row (no prefix caching, which would cut it at its last full page),
    which goes through the rule in chunks of 64 and 36, beside a verify row whose state that
    pass leaves alone. Each generated token's log-probability, both requests', equals
    transformers' over the same sequence, and the tokens equal an Engine's that walks long
    prefill rows token by token (`prefill_rule="tokens"`, a GPU's default). (The chunked Pallas
    walk: its kernel tests, and the tensor-parallel run's long prompt.)"""
    import dflash_jax.kernels
    from dflash_jax.step_program import clear_compiled_programs

    hf, target = slow_decay
    prompts = [[5, 17, 33, 2, 8, 41, 7], np.random.default_rng(11).integers(0, 95, 100).tolist()]
    params = dflash_jax.SamplingParams(max_new_tokens=8, logprobs=0)
    chunked, calls = dflash_jax.kernels.chunked_delta_rule_reference, []
    monkeypatch.setattr(dflash_jax.kernels, "chunked_delta_rule_reference",
                        lambda *a, **kw: calls.append(1) or chunked(*a, **kw))
    clear_compiled_programs()  # trace afresh: the calls counted are this test's

    def run(max_num_tokens, prefill_rule="auto"):
        engine = dflash_jax.Engine(target, decoding_pair[2], max_num_reqs=2, max_num_tokens=max_num_tokens,
                                   block_size=4, prefix_caching=False,
                                   kernels=dflash_jax.Kernels(recurrence="reference", prefill_rule=prefill_rule))
        ids, logprobs = [engine.add_request(prompts[0], params)], {}
        while engine.has_unfinished():
            if len(ids) == 1 and engine.output(ids[0]):  # the first request is decoding: the long one joins
                ids.append(engine.add_request(prompts[1], params))
            for out in engine.step():
                logprobs.setdefault(out.request_id, []).extend(t.logprob for t in out.logprobs)
        return [engine.output(i) for i in ids], [logprobs[i] for i in ids]

    tokens, logprobs = run(128)
    assert calls  # the long row took the chunked form
    for prompt, generated, got in zip(prompts, tokens, logprobs):
        np.testing.assert_allclose(got, transformers_logprobs(hf, prompt, generated), rtol=0, atol=2e-5)
    calls.clear()
    assert run(128, prefill_rule="tokens")[0] == tokens and not calls


def test_prefix_caching_starts_hybrid_requests_from_saved_states_exactly(converted, decoding_pair):
    """Requests sharing a prefix (a system prompt; an earlier turn and its answer) start from
    the state saved where the first one's prompt ended a page, its pages found cached: their
    greedy tokens equal autoregressive decoding's, and their tokens' log-probabilities
    transformers'. A row that took its slot's stale state instead, or the state after the
    whole first prompt, shifts the log-probabilities."""
    hf, target, drafter = converted[0], converted[1], decoding_pair[2]
    rng = np.random.default_rng(7)
    system = rng.integers(0, 95, 21).tolist()
    first = system + [3, 9]

    def run():
        engine = dflash_jax.Engine(target, drafter, max_num_reqs=2, max_num_tokens=16, num_pages=40, page_size=8,
                                   block_size=4)
        params = dflash_jax.SamplingParams(max_new_tokens=12, logprobs=0)
        logprobs = {}

        def finish():
            while engine.has_unfinished():
                for out in engine.step():
                    logprobs.setdefault(out.request_id, []).extend(t.logprob for t in out.logprobs)

        ids = [engine.add_request(first, params)]
        finish()
        prompts = [first, system + [50, 51, 52], first + engine.output(ids[0]) + [60, 61, 62, 63, 64, 65, 66]]
        ids += [engine.add_request(p, params) for p in prompts[1:]]
        finish()
        return (prompts, [engine.output(i) for i in ids], [engine.stats(i).num_cached_tokens for i in ids],
                [logprobs[i] for i in ids])

    prompts, tokens, cached, logprobs = run()
    assert tokens == dflash_jax.generate_autoregressive(target, prompts, max_new_tokens=12).token_ids
    assert cached == [0, 16, 16]  # the first prompt's last full page ends at 16: both later ones restart there
    for prompt, generated, got in zip(prompts, tokens, logprobs):
        np.testing.assert_allclose(got, transformers_logprobs(hf, prompt, generated), rtol=0, atol=2e-5)


def test_saved_states_are_pinned_until_read_and_evicted_oldest_first():
    from dflash_jax.prefix_states import SavedStates

    saved = SavedStates(capacity=2, interval=16)
    assert saved.next_boundary(0, 40, last=24) == 16 and saved.next_boundary(16, 40, last=24) == 24
    assert saved.next_boundary(24, 40, last=24) is None and saved.next_boundary(0, 10, last=24) is None
    a, b = saved.claim(b"a"), saved.claim(b"b")
    assert saved.claim(b"a") is None  # saved already
    assert saved.claim(b"z") is None  # both pinned until their saving steps launch
    saved.unpin(a)
    saved.unpin(b)
    assert saved.deepest([b"x", b"a", b"y"]) == (2, a)  # the longest run ending in a saved key: pinned
    c = saved.claim(b"c")  # evicts b, the oldest unpinned
    assert c == b and saved.deepest([b"b"]) is None
    saved.unpin(c)
    assert saved.claim(b"d") == c  # a stays pinned, so c (now the only unpinned) goes
    saved.unpin(c)
    saved.unpin(a)  # read: now the most recently used
    assert saved.claim(b"e") == c and saved.deepest([b"d"]) is None and saved.deepest([b"a"]) == (1, a)


def test_each_saved_state_goes_under_the_key_of_the_page_its_chunk_ends():
    """A prompt crossing several saving boundaries (every 8 tokens here, and its last full
    page at 28) saves each chunk's state under the key of the page that chunk ends at, not
    under the key of the prompt's last page, which admission has already hashed."""
    from dflash_jax.prefix_cache import PrefixCache, extend_page_keys
    from dflash_jax.prefix_states import SavedStates
    from dflash_jax.requests import RequestStats, SamplingParams
    from dflash_jax.scheduler import Request, Scheduler

    saved = SavedStates(capacity=8, interval=8)
    scheduler = Scheduler(max_num_reqs=1, max_num_tokens=16, num_drafts=0, lookahead=1, page_size=4,
                          allocator=PrefixCache(32), window_allocators=[], windows=(), saved_states=saved)
    tokens = list(range(1, 31))
    scheduler.add(Request(0, len(tokens), tokens, SamplingParams(max_new_tokens=1), RequestStats()))
    ends = []
    while not scheduler.running or not scheduler.running[0].decoding:
        (work,) = scheduler.schedule()
        end = work.request.num_computed + work.rows
        if work.save >= 0:
            ends.append(end)
            assert saved._key_of[work.save] == extend_page_keys([], tokens, 4, end // 4)[-1], end
        scheduler.launched([work])
    assert ends == [8, 16, 24, 28]


@pytest.mark.slow
def test_the_cli_generates_with_a_hybrid_target(decoding_pair, capsys):
    _, target, _, tmp = decoding_pair
    argv = ["generate", "--target", str(tmp / "converted"), "--drafter", str(tmp / "drafter"), "--prompt-ids",
            ",".join(map(str, PROMPTS[0])), "--max-new-tokens", "8", "--block-size", "4"]
    assert main(argv) == 0
    want = dflash_jax.generate_autoregressive(target, PROMPTS[:1], max_new_tokens=8).token_ids[0]
    assert ",".join(map(str, want)) in capsys.readouterr().out


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """Qwen3.5-MoE: every layer's experts routed (softmax, top 2 of 4, renormalised) plus a
    shared expert scaled by its sigmoid gate; greedy outputs repeat, and a random drafter."""
    from conftest import drafter_config_dict, favour_two_tokens, make_zlab_drafter

    tmp = tmp_path_factory.mktemp("qwen3_5_moe")
    hf = make_qwen3_5(seed=4, moe=True)
    favour_two_tokens(hf, torch.Generator().manual_seed(4))
    assert main(["convert", save_hf(hf, tmp / "hf"), str(tmp / "converted")]) == 0
    config = drafter_config_dict(hf.config.to_dict(), dflash_config={"mask_token_id": 95, "block_size": 4,
                                                                    "target_layer_ids": [0, 2]})
    drafter = dflash_jax.load_drafter(save_hf(make_zlab_drafter(config, seed=7), tmp / "drafter", config))
    return hf, dflash_jax.load_target(tmp / "converted"), drafter, tmp / "hf"


def test_the_moe_variant_matches_transformers(moe_pair):
    hf, target, _, _ = moe_pair
    assert target.cfg.experts.shared_intermediate_size == 40 and target.cfg.experts.layers == (0, 1, 2, 3)
    ids = np.random.default_rng(4).integers(0, 96, 29).tolist()
    assert rel_err(dflash_jax.target_forward(target, ids)[0], hf_forward(hf, ids)[0]) < 1e-4


@pytest.mark.slow
def test_the_moe_variant_decodes_exactly(moe_pair):
    from conftest import assert_greedy_dflash_exact

    hf, target, drafter, _ = moe_pair
    assert_greedy_dflash_exact(hf, target, drafter, PROMPTS, max_new_tokens=12)


@pytest.mark.slow
def test_convert_quantize_makes_the_moe_variant_8_bit_and_decodes_exactly(moe_pair, tmp_path):
    """`convert --quantize int8` on Qwen3.5-MoE: the routed experts and the shared expert 8-bit
    on disk (the router and the shared expert's one-column gate float); it computes what its
    dequantized float copy computes, and greedy DFlash equals its own autoregressive decoding."""
    import orbax.checkpoint as ocp

    from test_quantization import dequantized

    hf, _, drafter, folder = moe_pair
    assert main(["convert", str(folder), str(tmp_path / "q"), "--quantize", "int8", "--quantize-block", "16"]) == 0
    mlp = ocp.StandardCheckpointer().restore((tmp_path / "q" / "params").absolute())["layers"]["0"]["mlp"]
    eight_bit = [mlp["gate_up"], mlp["down"], mlp["shared_expert"]["gate_up_proj"]["kernel"]]
    assert {str(np.dtype(a.dtype)) for a in eight_bit} == {"int8"}
    assert {str(np.dtype(mlp[name]["kernel"].dtype)) for name in ("router", "shared_expert_gate")} == {"float32"}
    target = dflash_jax.load_target(tmp_path / "q")
    ids = PROMPTS[2]
    logits = np.asarray(dflash_jax.target_forward(target, ids)[0])
    assert rel_err(logits, np.asarray(dflash_jax.target_forward(dequantized(target), ids)[0])) <= 1e-5
    for short in PROMPTS[:2]:  # near the float model's; over 70 tokens int8 rounding flips some experts' routing
        assert rel_err(np.asarray(dflash_jax.target_forward(target, short)[0]), hf_forward(hf, short)[0]) <= 0.05
    ar = dflash_jax.generate_autoregressive(target, PROMPTS, max_new_tokens=12).token_ids
    spec = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=12, block_size=4)
    assert spec.token_ids == ar
    assert any(n > 1 for lengths in spec.accepted_lengths for n in lengths)


@pytest.mark.slow
def test_serve_answers_as_generate_does(decoding_pair, tmp_path):
    """The OpenAI-compatible server on a hybrid target: a greedy completion's tokens are
    `generate`'s."""
    import threading

    import openai

    from dflash_jax.serve.cli import ModelInfo, bind, make_server
    from dflash_jax.tokenizer import ChatTokenizer
    from test_serve import EOS, write_char_tokenizer

    _, target, drafter, _ = decoding_pair
    write_char_tokenizer(tmp_path)
    tokenizer = ChatTokenizer(tmp_path)
    prompt = "Once upon a time"
    want = dflash_jax.generate(target, drafter, [tokenizer.encode_text(prompt)], max_new_tokens=12, block_size=4,
                               stop_token_ids=[EOS]).token_ids[0]
    engine = dflash_jax.Engine(target, drafter, max_num_reqs=2, max_num_tokens=16, block_size=4)
    server = make_server(engine, tokenizer, ModelInfo("hybrid", 256, 4), max_queue=4, shutdown_timeout_s=60,
                         log_level="warning")
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert server.ready.wait(60), "the server did not start"
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300) as client:
            answer = client.completions.create(model="hybrid", prompt=prompt, max_tokens=12, temperature=0)
        assert answer.choices[0].text == tokenizer.decode([t for t in want if t != EOS]) != ""
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
