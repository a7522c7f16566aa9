"""gpt-oss targets: a tiny transformers model (a sliding-window layer and a full one, attention
sinks, attention and expert biases, a biased router, the clamped SwiGLU, YaRN RoPE) converted
with the CLI computes transformers' logits and hidden states; greedy DFlash equals
autoregressive decoding and transformers' greedy `generate` past the window; a published
layout with MXFP4 experts loads as transformers dequantizes it; export gives the checkpoint
back."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import dflash_jax
from conftest import assert_greedy_dflash_exact, converted_pair, favour_two_tokens, rel_err
from dflash_jax.config import ConfigError, parse_config
from dflash_jax.formats.export_hf import export_hf

IDS = np.random.default_rng(0).integers(0, 96, 40)
PROMPTS = [[5, 6, 7], list(range(20, 37))]  # the second longer than the window
CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
              tie_word_embeddings=False)


def make_hf_gpt_oss(seed=0, **config):
    """Random float32 weights with every part visible: sinks, biases and norms drawn, a sharp
    router, experts large enough to reach the SwiGLU's clamp, and an LM head dominated by two
    tokens (a random drafter is often right). `config` overrides CONFIG."""
    torch.manual_seed(seed)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**CONFIG, **config}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("sinks", "bias")) or "norm" in name:
                param.copy_((1.0 if "norm" in name else 0.0) + 0.5 * torch.randn(param.shape, generator=gen))
            elif "router.weight" in name:
                param.normal_(0, 0.5, generator=gen)
            elif "experts" in name:
                param.normal_(0, 0.5, generator=gen)
    favour_two_tokens(hf, gen)
    return hf.float().eval()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt_oss")
    hf = make_hf_gpt_oss()
    return hf, *converted_pair(hf, tmp, target_layer_ids=[0, 1])


def test_config():
    raw = {**transformers.GptOssConfig(**CONFIG).to_dict(), "architectures": ["GptOssForCausalLM"]}
    cfg = parse_config(raw)
    assert [layer.window for layer in cfg.attention_layers] == [6, None] and cfg.attention_sinks
    assert cfg.experts.layers == (0, 1) and cfg.experts.swiglu_limit == 7.0 and cfg.rope.rope_type == "yarn"
    with pytest.raises(ConfigError, match="layer_types must give full_attention or sliding_attention"):
        parse_config({**raw, "layer_types": ["sliding_attention"]})


def test_logits_and_hidden_states_match_transformers(gpt_oss):
    hf, folder, converted, _ = gpt_oss
    with torch.no_grad():
        out = hf(torch.tensor(IDS)[None], output_hidden_states=True)
    for target in (converted, dflash_jax.load_target(folder)):
        logits, features = dflash_jax.target_forward(target, IDS, layer_ids=(0,))
        assert rel_err(logits, out.logits[0].numpy()) <= 1e-5
        assert rel_err(features, out.hidden_states[1][0].numpy()) <= 1e-5
    # the experts' Pallas product and router kernel (interpret mode): top k, then softmax, biases, clamped SwiGLU
    pallas = dflash_jax.target_forward(converted, IDS, kernels=dflash_jax.Kernels(experts="pallas"))[0]
    assert rel_err(pallas, out.logits[0].numpy()) <= 1e-5


@pytest.mark.slow
def test_greedy_dflash_equals_autoregressive_and_transformers(gpt_oss):
    hf, _, target, drafter = gpt_oss
    assert_greedy_dflash_exact(hf, target, drafter, PROMPTS)


def test_convert_quantize_keeps_the_experts_8_bit_and_decodes_exactly(gpt_oss, tmp_path):
    """`convert --quantize int8` on gpt-oss: its stacked experts (interleaved gate and up
    columns, biases float) 8-bit, each expert scaled alone; it computes what its dequantized
    float copy computes, and greedy DFlash equals autoregressive decoding past the window,
    through the grouped-expert kernel too."""
    from dflash_jax.cli import main
    from test_quantization import dequantized

    _, folder, _, drafter = gpt_oss
    assert main(["convert", folder, str(tmp_path / "q"), "--quantize", "int8", "--quantize-block", "16"]) == 0
    target = dflash_jax.load_target(tmp_path / "q")
    mlp = target.layers[0].mlp
    assert (mlp.gate_up[...].dtype, mlp.gate_up_bias[...].dtype) == (np.int8, np.float32)
    logits = np.asarray(dflash_jax.target_forward(target, IDS)[0])
    assert rel_err(logits, dflash_jax.target_forward(dequantized(target), IDS)[0]) <= 1e-5
    pallas = dflash_jax.Kernels(experts="pallas")
    assert rel_err(dflash_jax.target_forward(target, IDS, kernels=pallas)[0], logits) <= 1e-5
    ar = dflash_jax.generate_autoregressive(target, PROMPTS, max_new_tokens=12).token_ids
    for kernels in (dflash_jax.Kernels(), pallas):
        assert dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=12, block_size=4,
                                   kernels=kernels).token_ids == ar


def mxfp4(w_EIO: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks [E, O, I / 32, 16] uint8, scales [E, O, I / 32] uint8) of a weight [E, I, O]: a
    power-of-two scale per 32 inputs, each value rounded to the nearest FP4 value."""
    fp4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    E, inp, out = w_EIO.shape
    groups = w_EIO.transpose(0, 2, 1).reshape(E, out, inp // 32, 32)
    exponent = np.ceil(np.log2(np.abs(groups).max(-1) / 6 + 1e-30)).astype(np.int32)
    codes = np.abs(groups[..., None] / np.ldexp(1.0, exponent)[..., None, None] - fp4).argmin(-1).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exponent + 127).astype(np.uint8)


def test_published_mxfp4_experts_load_as_transformers_dequantizes_them(gpt_oss, tmp_path):
    hf, folder, _, _ = gpt_oss
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    reference = transformers.GptOssForCausalLM(hf.config).float().eval()
    reference_state = dict(state)
    for name in [n for n in state if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = mxfp4(state.pop(name).numpy())
        blocks, scales = np.ascontiguousarray(blocks), np.ascontiguousarray(scales)
        state[f"{name}_blocks"], state[f"{name}_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
        reference_state[name] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                           dtype=torch.float32)
    reference.load_state_dict(reference_state)
    (tmp_path / "mxfp4").mkdir()
    save_file(state, tmp_path / "mxfp4" / "model.safetensors")
    config = json.loads((Path(folder) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    target = dflash_jax.load_target(tmp_path / "mxfp4")
    with torch.no_grad():
        expected = reference(torch.tensor(IDS)[None]).logits[0].numpy()
    assert rel_err(dflash_jax.target_forward(target, IDS)[0], expected) <= 1e-5


def test_export_gives_the_checkpoint_back(gpt_oss, tmp_path):
    hf, _, target, _ = gpt_oss
    export_hf(target, tmp_path / "exported")
    again = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "exported").float().eval()
    assert again.config.layer_types == CONFIG["layer_types"] and again.config.sliding_window == 6
    with torch.no_grad():
        assert rel_err(again(torch.tensor(IDS)[None]).logits[0].numpy(),
                       hf(torch.tensor(IDS)[None]).logits[0].numpy()) <= 1e-6
