"""Qwen3-MoE targets: a tiny transformers model (routed experts in two layers, a dense one
between them) converted with the CLI and loaded on the fly computes transformers' logits and
hidden states; greedy DFlash on it equals its greedy autoregressive decoding and
transformers' greedy `generate`, in `generate` and in the Engine; export gives the HF
checkpoint back; malformed configs are refused with the reason."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import dflash_jax
from conftest import (assert_greedy_dflash_exact, converted_pair, engine_outputs, favour_two_tokens, randomize_norms,
                      rel_err)
from dflash_jax.cli import main
from dflash_jax.config import ConfigError, parse_config
from dflash_jax.formats.export_hf import export_hf
from pallas_kernels.grouped_matmul import grouped_tiling
from test_generate import PROMPTS

IDS = np.random.default_rng(0).integers(0, 96, 40)


MOE_CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
                  norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False)


def raw_config(**changes) -> dict:
    """The tiny model's config.json as transformers writes it, with `changes` (None: drop)."""
    raw = {**transformers.Qwen3MoeConfig(**MOE_CONFIG).to_dict(), "architectures": ["Qwen3MoeForCausalLM"], **changes}
    return {k: v for k, v in raw.items() if v is not None}


def make_hf_moe(seed=0):
    """A tiny random Qwen3-MoE in float32: 8 experts, top 2, layers 0 and 2 sparse, layer 1
    dense; a sharp router (so tokens really pick different experts) and an LM head dominated
    by two tokens (so a random drafter's guesses are often right)."""
    torch.manual_seed(seed)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**MOE_CONFIG))
    randomize_norms(hf, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.5, generator=gen)
    favour_two_tokens(hf, gen)
    return hf.float().eval()


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(transformers model, its folder, the CLI-converted target, a drafter for it)."""
    tmp = tmp_path_factory.mktemp("moe")
    hf = make_hf_moe()
    return hf, *converted_pair(hf, tmp)


def test_config_names_the_sparse_layers():
    cfg = parse_config(raw_config())  # written by transformers 5 as num_local_experts
    assert cfg.experts.layers == (0, 2) and cfg.experts.top_k == 2 and cfg.experts.num_experts == 8
    assert cfg.layer_experts(1) is None and cfg.layer_experts(2) == cfg.experts


def test_logits_and_hidden_states_match_transformers(moe):
    hf, folder, converted, _ = moe
    with torch.no_grad():
        out = hf(torch.tensor(IDS)[None], output_hidden_states=True)
    for target in (converted, dflash_jax.load_target(folder)):
        logits, features = dflash_jax.target_forward(target, IDS, layer_ids=(1, 0))  # a dense and a sparse layer
        assert rel_err(logits, out.logits[0].numpy()) <= 1e-5
        expected = np.concatenate([out.hidden_states[2][0].numpy(), out.hidden_states[1][0].numpy()], axis=-1)
        assert rel_err(features, expected) <= 1e-5


def test_a_batch_of_sequences_under_vmap_as_each_alone(moe):
    """The trainer maps the target over a batch of sequences (`ragged_dot` itself cannot be)."""
    import jax

    from dflash_jax.train.forward import target_logits_and_features

    _, _, target, _ = moe
    batch = np.stack([IDS[:20], IDS[20:]])
    logits, features = jax.vmap(lambda ids: target_logits_and_features(target, ids, (0, 1)))(batch)
    for row, ids in enumerate(batch):
        alone = target_logits_and_features(target, ids, (0, 1))
        assert rel_err(logits[row], alone[0]) <= 1e-6 and rel_err(features[row], alone[1]) <= 1e-6


@pytest.mark.slow
def test_greedy_dflash_equals_autoregressive_and_transformers(moe):
    hf, _, target, drafter = moe
    assert_greedy_dflash_exact(hf, target, drafter, PROMPTS)


def test_the_grouped_expert_kernel_decodes_the_same_tokens(moe):
    """The Pallas experts' product (interpret mode here) computes the reference's logits, and
    greedy DFlash through it equals autoregressive decoding through it."""
    _, _, target, drafter = moe
    pallas = dflash_jax.Kernels(experts="pallas")
    reference = dflash_jax.target_forward(target, IDS)[0]
    assert rel_err(dflash_jax.target_forward(target, IDS, kernels=pallas)[0], reference) <= 1e-5
    ar = dflash_jax.generate_autoregressive(target, PROMPTS, max_new_tokens=12, kernels=pallas)
    spec = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=12, block_size=4, kernels=pallas)
    assert spec.token_ids == ar.token_ids
    assert any(n > 1 for lengths in spec.accepted_lengths for n in lengths)


def test_export_gives_the_checkpoint_back(moe, tmp_path):
    hf, _, target, _ = moe
    export_hf(target, tmp_path / "exported")
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["mlp_only_layers"] == [1]
    again = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "exported").float().eval()
    with torch.no_grad():
        assert rel_err(again(torch.tensor(IDS)[None]).logits[0].numpy(),
                       hf(torch.tensor(IDS)[None]).logits[0].numpy()) <= 1e-6


@pytest.mark.parametrize("change,message", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok must be an integer in \\[1, num_experts = 8\\]"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
    ({"moe_intermediate_size": None}, "config.json has no 'moe_intermediate_size'"),
])
def test_malformed_configs_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw_config(**change))


def experts_dtypes(folder) -> set[str]:
    """The dtypes of the sparse layers' experts in a converted folder, as orbax wrote them."""
    import orbax.checkpoint as ocp

    params = ocp.StandardCheckpointer().restore((folder / "params").absolute())
    return {str(np.dtype(params["layers"][layer]["mlp"][name].dtype)) for layer in ("0", "2")
            for name in ("gate_up", "down")}


@pytest.mark.parametrize("layout", ["qwen", "compressed-tensors"])
def test_a_published_fp8_moe_checkpoint_stays_8_bit(moe, tmp_path, layout):
    """Every projection in e4m3, the experts' included, with Qwen's block `weight_scale_inv` or
    compressed-tensors' per-channel `weight_scale`, the router and LM head in float (as the
    published MoE FP8 checkpoints are): loaded and converted with the experts' values and scales
    kept 8-bit, computing transformers' logits of the dequantized weights; greedy DFlash on it
    equals its autoregressive decoding, through the grouped-expert kernel too (per-channel
    scales; Qwen's blocks here are 24 rows, which no kernel step fits: the reference); a damaged
    expert tensor is refused by name and nothing is written."""
    from safetensors.torch import load_file, save_file

    from conftest import write_published_fp8
    from dflash_jax.formats.hf_reader import ConversionError
    from dflash_jax.formats.hf_to_nnx import convert_checkpoint

    _, folder, _, drafter = moe
    write_published_fp8(Path(folder), tmp_path / "fp8", tmp_path / "reference", layout)
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    reference = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "reference").float().eval()
    with torch.no_grad():
        want = reference(torch.tensor(IDS)[None]).logits[0].numpy()
    convert_checkpoint(tmp_path / "fp8", tmp_path / "converted")
    assert experts_dtypes(tmp_path / "converted") == {"float8_e4m3fn"}
    converted = dflash_jax.load_target(tmp_path / "converted")
    for target in (converted, dflash_jax.load_target(tmp_path / "fp8")):
        assert target.cfg.quantization is not None and target.layers[0].mlp.gate_up.dtype == np.dtype("float8_e4m3fn")
        assert rel_err(dflash_jax.target_forward(target, IDS)[0], want) <= 1e-5
    ar = dflash_jax.generate_autoregressive(converted, PROMPTS, max_new_tokens=12)
    assert dflash_jax.generate(converted, drafter, PROMPTS, max_new_tokens=12, block_size=4).token_ids == ar.token_ids
    # per-channel scales take the kernel; 24-row scale blocks fit no 16-row step of the 64 inputs: the reference
    fits = grouped_tiling(64, 64, 2, converted.cfg.quantization.block_in) is not None
    assert fits == (layout == "compressed-tensors")
    pallas = dflash_jax.Kernels(experts="pallas")
    assert rel_err(dflash_jax.target_forward(converted, IDS, kernels=pallas)[0], want) <= 1e-5
    spec = dflash_jax.generate(converted, drafter, PROMPTS, max_new_tokens=12, block_size=4, kernels=pallas)
    assert spec.token_ids == dflash_jax.generate_autoregressive(converted, PROMPTS, max_new_tokens=12,
                                                                kernels=pallas).token_ids
    damaged = "model.layers.0.mlp.experts.3.down_proj.weight"
    save_file({**tensors, damaged: tensors[damaged].float()}, tmp_path / "fp8" / "model.safetensors")
    with pytest.raises(ConversionError, match=f"{damaged}' is float32, not the float8_e4m3fn values"):
        convert_checkpoint(tmp_path / "fp8", tmp_path / "damaged")
    scale = next(name for name in tensors if name.startswith(damaged.removesuffix("weight")) and name != damaged)
    save_file({k: v for k, v in tensors.items() if k != scale}, tmp_path / "fp8" / "model.safetensors")
    with pytest.raises(ConversionError, match=f"{damaged}' is float8_e4m3fn but has no weight_scale"):
        convert_checkpoint(tmp_path / "fp8", tmp_path / "damaged")
    assert not (tmp_path / "damaged").exists()


def test_an_fp8_moe_checkpoint_leaving_attention_float_loads_as_its_dequantized_float_model(moe, tmp_path):
    """A compressed-tensors checkpoint whose `ignore` keeps the attention products float (its
    experts 8-bit): the library holds a layer's products all 8-bit or all float, so it reads
    the float model of the dequantized weights, transformers' logits from them."""
    from conftest import write_published_fp8

    _, folder, _, _ = moe
    write_published_fp8(Path(folder), tmp_path / "fp8", tmp_path / "reference", "compressed-tensors",
                        keep_float=("self_attn",))
    reference = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "reference").float().eval()
    target = dflash_jax.load_target(tmp_path / "fp8")
    assert target.cfg.quantization is None
    with torch.no_grad():
        want = reference(torch.tensor(IDS)[None]).logits[0].numpy()
    assert rel_err(dflash_jax.target_forward(target, IDS)[0], want) <= 1e-5


@pytest.mark.parametrize("weights", ["int8", "fp8"])
def test_convert_quantize_keeps_a_moe_target_8_bit_and_decodes_exactly(moe, tmp_path, weights):
    """`convert --quantize` on a MoE target: its experts (each alone) and attention products
    stored 8-bit, logits those of the float model holding the dequantized weights and near the
    float original's; greedy DFlash equals autoregressive decoding (some drafts accepted, some
    not), in `generate`, through the grouped-expert kernel, and in the Engine."""
    from test_quantization import dequantized

    hf, folder, _, drafter = moe
    assert main(["convert", folder, str(tmp_path / "q"), "--quantize", weights, "--quantize-block", "32"]) == 0
    assert experts_dtypes(tmp_path / "q") == {"int8" if weights == "int8" else "float8_e4m3fn"}
    target = dflash_jax.load_target(tmp_path / "q")
    assert target.layers[0].mlp.gate_up_scale.shape == (8, 2, 64)  # 64 input rows in blocks of 32
    assert grouped_tiling(64, 64, 2, 32) is not None  # the kernel runs below, scaling per block
    logits = np.asarray(dflash_jax.target_forward(target, IDS)[0])
    assert rel_err(logits, dflash_jax.target_forward(dequantized(target), IDS)[0]) <= 1e-5
    with torch.no_grad():
        assert rel_err(logits, hf(torch.tensor(IDS)[None]).logits[0].numpy()) <= (0.03 if weights == "int8" else 0.1)
    ar = dflash_jax.generate_autoregressive(target, PROMPTS, max_new_tokens=12)
    spec = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=12, block_size=4)
    assert spec.token_ids == ar.token_ids
    assert any(n > 1 for lengths in spec.accepted_lengths for n in lengths)
    pallas = dflash_jax.Kernels(experts="pallas")
    assert rel_err(dflash_jax.target_forward(target, IDS, kernels=pallas)[0], logits) <= 1e-5
    assert dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=12, block_size=4,
                               kernels=pallas).token_ids == ar.token_ids
    if weights == "int8":
        assert engine_outputs(target, drafter, PROMPTS, 12) == ar.token_ids
