"""8-bit weights: quantizing, reading published FP8 layouts, `convert --quantize`, and
exactness: a quantized target computes what a float target holding its dequantized weights
computes, stays 8-bit on disk, and greedy DFlash on it equals its own greedy autoregressive
decoding."""

import dataclasses
import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from safetensors.torch import save_file

import dflash_jax
from conftest import drafter_config_dict, engine_outputs, make_zlab_drafter, rel_err, save_hf, write_published_fp8
from dflash_jax.checkpoint import save_checkpoint
from dflash_jax.config import ConfigError
from dflash_jax.formats.export_hf import export_hf
from dflash_jax.formats.hf_reader import ConversionError
from dflash_jax.formats.hf_to_nnx import convert_checkpoint
from dflash_jax.generate import generate, generate_autoregressive
from dflash_jax.kernels import Kernels
from dflash_jax.models import model_from_params
from dflash_jax.quantization import (QuantizationError, WeightQuantization, dequantize, params_of, parse_quantization,
                                     quantize, to_output_major)
from dflash_jax.train.trainer import _cast
from test_generate import PROMPTS, biased_target

IDS = np.random.default_rng(0).integers(0, 96, 40)


@pytest.fixture(scope="module")
def float_pair(tmp_path_factory):
    """(the float HF target, its folder, a drafter for it)."""
    tmp = tmp_path_factory.mktemp("quantization")
    hf = biased_target(seed=4)
    config = drafter_config_dict(hf.config.to_dict(), dflash_config={"mask_token_id": 95, "block_size": 4})
    drafter = dflash_jax.load_drafter(save_hf(make_zlab_drafter(config, seed=5), tmp / "drafter", config))
    return hf, save_hf(hf, tmp / "float"), drafter


def logits_of(target):
    return np.asarray(dflash_jax.target_forward(target, IDS)[0])


def dequantized(target):
    """A float target whose products (routed experts too) hold `target`'s 8-bit weights
    dequantized (the reference)."""
    params = jax.device_get(params_of(target))

    block_in = target.cfg.quantization.block_in

    def walk(tree):
        for key in list(tree):
            value = tree[key]
            if isinstance(value, dict) and "scale" in value:
                value["kernel"] = np.asarray(dequantize(value.pop("kernel"), value.pop("scale"), block_in, np.float32))
            elif isinstance(value, dict):
                walk(value)
            elif key.endswith("_scale"):  # routed experts [E, in, out], each expert's own scales
                name = key.removesuffix("_scale")
                tree[name] = np.asarray(jax.vmap(lambda v, s: dequantize(v, s, block_in, np.float32))(
                    tree[name], tree.pop(key)))

    walk(params)
    cfg = dataclasses.replace(target.cfg, quantization=None)
    return model_from_params(cfg, target.dtype, params)


def stored_dtypes(folder) -> set[str]:
    """The dtypes of the decoder layers' kernels in a converted folder, as orbax wrote them."""
    params = ocp.StandardCheckpointer().restore((folder / "params").absolute())
    return {str(np.dtype(layer[part][proj]["kernel"].dtype)) for layer in params["layers"].values()
            for part, proj in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                               ("mlp", "down_proj"))}


@pytest.mark.parametrize("weights", ["int8", "fp8"])
@pytest.mark.parametrize("block_in", [None, 24])
def test_quantized_weights_are_within_half_a_step_of_the_float_ones(weights, block_in):
    w = np.random.default_rng(1).normal(size=(64, 40)).astype(np.float32) * np.linspace(0.1, 3, 40)
    w[:, 7] = 0  # a zero column keeps a finite scale
    values, scale = quantize(w, WeightQuantization(weights, block_in))
    assert values.dtype == WeightQuantization(weights).dtype and scale.shape == ((1 if block_in is None else 3), 40)
    error = np.abs(np.asarray(dequantize(values, scale, block_in, np.float32)) - w)
    rows = np.repeat(scale, block_in or 64, axis=0)[:64]
    bound = 0.5 * rows if weights == "int8" else np.abs(w) / 16 + rows * 2.0 ** -9  # e4m3: 3 mantissa bits
    assert np.all(error <= bound * (1 + 1e-6)) and np.all(error[:, 7] == 0)


def test_quantization_configs_are_read_or_refused_with_the_reason():
    assert parse_quantization(None) is None
    qwen = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 64]}
    assert parse_quantization(qwen) == WeightQuantization("fp8", 64, "weight_scale_inv", 128)
    channel = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}
    assert parse_quantization(channel) == WeightQuantization("fp8", None, "weight_scale")
    own = WeightQuantization("int8", 32)
    assert parse_quantization(own.to_config()) == own
    for raw, message in [({"quant_method": "awq"}, "'awq' is not supported"),
                         ({"quant_method": "fp8"}, "weight_block_size"),
                         ({**qwen, "fmt": "e5m2"}, "only e4m3"),
                         ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
                             "num_bits": 4, "type": "int", "strategy": "group"}}}}, "8-bit float weights")]:
        with pytest.raises(QuantizationError, match=message):
            parse_quantization(raw)


@pytest.mark.parametrize("weights", ["int8", "fp8"])
def test_convert_quantize_keeps_8_bit_weights_and_decodes_exactly(float_pair, tmp_path, weights):
    hf, float_dir, drafter = float_pair
    block = 48 if weights == "int8" else None  # 112 MLP rows: blocks of 48, 48 and 16
    convert_checkpoint(float_dir, tmp_path / "q", quantize=weights, quantize_block=block)
    assert stored_dtypes(tmp_path / "q") == {"int8" if weights == "int8" else "float8_e4m3fn"}
    target = dflash_jax.load_target(tmp_path / "q")
    assert target.cfg.quantization == WeightQuantization(weights, block)
    logits = logits_of(target)
    assert rel_err(logits, logits_of(dequantized(target))) <= 1e-5
    with torch.no_grad():
        float_logits = hf(torch.tensor(IDS)[None]).logits[0].numpy()
    assert rel_err(logits, float_logits) <= (0.02 if weights == "int8" else 0.1)
    ar = generate_autoregressive(target, PROMPTS, max_new_tokens=16)
    spec = generate(target, drafter, PROMPTS, max_new_tokens=16, block_size=4)
    assert spec.token_ids == ar.token_ids
    assert any(n > 1 for lengths in spec.accepted_lengths for n in lengths)  # drafts were accepted, some not
    # the Pallas product (interpret mode here) decodes the same tokens, DFlash and AR alike
    pallas = Kernels(quantized="pallas")
    assert rel_err(np.asarray(dflash_jax.target_forward(target, IDS, kernels=pallas)[0]), logits) <= 1e-5
    assert generate(target, drafter, PROMPTS, max_new_tokens=16, block_size=4, kernels=pallas).token_ids == ar.token_ids
    if block is None:  # the GPU's default: one-token steps through XLA, verify blocks through the kernel
        mixed = Kernels(quantized="pallas_or_xla")
        assert generate(target, drafter, PROMPTS, max_new_tokens=16, block_size=4, kernels=mixed).token_ids == ar.token_ids
    if weights == "int8":
        assert engine_outputs(target, drafter, PROMPTS, 16) == ar.token_ids
        with pytest.raises(ValueError, match="export writes float HF checkpoints only"):
            export_hf(target, tmp_path / "exported")


def test_a_target_holding_its_8_bit_kernels_output_major_decodes_and_saves_alike(float_pair, tmp_path,
                                                                                   monkeypatch):
    """What `load_target` does on one GPU (`to_output_major`: kernels [out, in], the layout the
    Pallas kernel reads fastest): the same logits and tokens through both products, DFlash equal
    to autoregressive decoding, and the checkpoint layout back for saving."""
    hf, float_dir, drafter = float_pair
    convert_checkpoint(float_dir, tmp_path / "q", quantize="int8", quantize_block=48)
    target = dflash_jax.load_target(tmp_path / "q")
    before, logits = jax.device_get(params_of(target)), logits_of(target)
    ar = generate_autoregressive(target, PROMPTS, max_new_tokens=16).token_ids
    with pytest.raises(ValueError, match="has run already"):  # its programs would keep the old layout
        to_output_major(target)
    with pytest.raises(ValueError, match="a drafter keeps"):
        to_output_major(drafter)
    with monkeypatch.context() as patched:  # loaded as on one GPU
        patched.setattr(jax, "default_backend", lambda: "gpu")
        target = dflash_jax.load_target(tmp_path / "q")
    mlp = target.layers[0].mlp
    assert mlp.down_proj.output_major and mlp.down_proj.kernel.shape == (hf.config.hidden_size, 112)
    pallas = Kernels(quantized="pallas")
    for kernels in (Kernels(), pallas):
        assert rel_err(np.asarray(dflash_jax.target_forward(target, IDS, kernels=kernels)[0]), logits) <= 1e-6
        assert generate(target, drafter, PROMPTS, max_new_tokens=16, block_size=4, kernels=kernels).token_ids == ar
        assert generate_autoregressive(target, PROMPTS, max_new_tokens=16, kernels=kernels).token_ids == ar
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params_of(target)), before)
    save_checkpoint(target, json.loads((tmp_path / "q" / "config.json").read_text()), tmp_path / "saved")
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params_of(dflash_jax.load_target(tmp_path / "saved"))),
                 before)
    # the trainer's frozen target in its compute dtype: [in, out] again, 8-bit values and float32 scales kept
    cast = _cast(target, "bfloat16").layers[0].mlp.down_proj
    assert (cast.kernel.dtype, cast.scale.dtype, cast.kernel.shape) == (np.int8, np.float32, (112, hf.config.hidden_size))


def write_fp8_checkpoint(hf, folder, layout: str):
    """`hf` saved as a published FP8 checkpoint (`conftest.write_published_fp8`); returns the
    transformers model of the dequantized weights (the reference)."""
    save_hf(hf, folder.with_name(f"{folder.name}-float"))
    write_published_fp8(folder.with_name(f"{folder.name}-float"), folder, folder.with_name(f"{folder.name}-reference"),
                        layout)
    return type(hf).from_pretrained(folder.with_name(f"{folder.name}-reference")).float().eval()


@pytest.mark.parametrize("layout", ["qwen", "compressed-tensors"])
def test_published_fp8_checkpoints_load_and_convert_as_8_bit(float_pair, tmp_path, layout):
    hf, _, drafter = float_pair
    reference = write_fp8_checkpoint(hf, tmp_path / "fp8", layout)
    direct = dflash_jax.load_target(tmp_path / "fp8")
    convert_checkpoint(tmp_path / "fp8", tmp_path / "converted")
    assert stored_dtypes(tmp_path / "converted") == {"float8_e4m3fn"}
    converted = dflash_jax.load_target(tmp_path / "converted")
    logits = logits_of(direct)
    assert np.array_equal(logits, logits_of(converted))
    with torch.no_grad():
        assert rel_err(logits, reference(torch.tensor(IDS)[None]).logits[0].numpy()) <= 1e-5
    ar = generate_autoregressive(converted, PROMPTS, max_new_tokens=12)
    assert generate(converted, drafter, PROMPTS, max_new_tokens=12, block_size=4).token_ids == ar.token_ids
    with pytest.raises(ConversionError, match="8-bit already"):
        convert_checkpoint(tmp_path / "fp8", tmp_path / "again", quantize="int8")
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("stored", [torch.float32, torch.float8_e5m2])
def test_an_fp8_checkpoint_with_a_weight_in_another_dtype_is_refused(float_pair, tmp_path, stored):
    """Cast to e4m3, a float32 weight overflows to NaN and an e5m2 one loses its values: a
    damaged file, refused before anything is written."""
    from safetensors.torch import load_file

    write_fp8_checkpoint(float_pair[0], tmp_path / "fp8", "qwen")
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = (tensors[name].float() * 3).to(stored)
    save_file(tensors, tmp_path / "fp8" / "model.safetensors")
    with pytest.raises(ConversionError, match=f"{name}.*not the float8_e4m3fn values its config describes"):
        convert_checkpoint(tmp_path / "fp8", tmp_path / "converted")
    assert not (tmp_path / "converted").exists()


@pytest.mark.parametrize("layout,exclusion", [("qwen", {"modules_to_not_convert": ["lm_head", "layers.1.mlp.down_proj"]}),
                                              ("compressed-tensors", {"ignore": ["lm_head", "re:.*layers[.]1[.]mlp.down_proj"]})])
def test_a_decoder_product_left_in_float_is_refused_by_name(float_pair, tmp_path, layout, exclusion):
    """Published configs may keep some products in float; the library runs a layer's products
    all 8-bit or all float, and says which product it met rather than that a scale is missing."""
    from safetensors.torch import load_file

    write_fp8_checkpoint(float_pair[0], tmp_path / "fp8", layout)
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    module = "model.layers.1.mlp.down_proj"
    tensors[f"{module}.weight"] = float_pair[0].state_dict()[f"{module}.weight"]
    del tensors[f"{module}.{'weight_scale_inv' if layout == 'qwen' else 'weight_scale'}"]
    save_file(tensors, tmp_path / "fp8" / "model.safetensors")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"].update(exclusion)
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=f"'{module}' .* stays in float .* convert the float original"):
        convert_checkpoint(tmp_path / "fp8", tmp_path / "converted")
    assert not (tmp_path / "converted").exists()


def test_8_bit_drafters_draft_what_their_dequantized_weights_draft(float_pair, tmp_path):
    """`convert --quantize` on a drafter: fc and layer weights 8-bit (context K/V from the
    stacked 8-bit columns), drafting as a float drafter holding the dequantized weights does."""
    hf, float_dir, _ = float_pair
    config = drafter_config_dict(hf.config.to_dict(), dflash_config={"mask_token_id": 95, "block_size": 4})
    save_hf(make_zlab_drafter(config, seed=5), tmp_path / "drafter", config)
    convert_checkpoint(tmp_path / "drafter", tmp_path / "q", quantize="int8")
    drafter = dflash_jax.load_drafter(tmp_path / "q")
    assert drafter.cfg.quantization == WeightQuantization("int8", 128)
    assert stored_dtypes(tmp_path / "q") == {"int8"}
    features = np.random.default_rng(3).normal(size=(9, drafter.cfg.fc_in_features)).astype(np.float32)
    positions = np.arange(9)
    for (k, v), (k_ref, v_ref) in zip(drafter.context_kv(features, positions),
                                      dequantized(drafter).context_kv(features, positions)):
        assert rel_err(k, k_ref) <= 1e-5 and rel_err(v, v_ref) <= 1e-5
    target = dflash_jax.load_target(float_dir)
    spec = generate(target, drafter, PROMPTS, max_new_tokens=16, block_size=4)
    reference = generate(target, dequantized(drafter), PROMPTS, max_new_tokens=16, block_size=4)
    assert spec.token_ids == reference.token_ids == generate_autoregressive(target, PROMPTS, max_new_tokens=16).token_ids
    assert spec.accepted_lengths == reference.accepted_lengths


def test_what_cannot_be_quantized_is_refused(float_pair, tmp_path):
    config = drafter_config_dict({"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 6})
    folder = tmp_path / "drafter"
    save_hf(make_zlab_drafter(config, seed=1), folder, config)
    with pytest.raises(ConversionError, match="choose one of int8, fp8"):
        convert_checkpoint(folder, tmp_path / "out", quantize="int4")
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": fp8}))
    with pytest.raises(ConfigError, match="published quantized drafters are not supported"):
        dflash_jax.load_drafter(folder)
    assert not (tmp_path / "out").exists()


def test_the_agreement_benchmark_rounds_the_lm_head_only_when_asked(float_pair):
    from bench.acceptance.quantized_agreement import Variant, parse_variant, quantized_variant

    assert parse_variant("int8/16+head/8") == Variant(WeightQuantization("int8", 16), WeightQuantization("int8", 8))
    assert parse_variant("fp8+head") == Variant(WeightQuantization("fp8"), WeightQuantization("fp8"))
    assert parse_variant("int8") == Variant(WeightQuantization("int8"))
    for bad in ("int4", "int8/x", "int8+tail/8", "fp8+head/3.5", "int8@down_proj", "int8@/16"):
        with pytest.raises(ValueError, match="WEIGHTS"):
            parse_variant(bad)
    _, folder, _ = float_pair
    target = dflash_jax.load_target(folder, dtype="float32")
    eye = np.eye(target.cfg.hidden_size, dtype=np.float32)
    float_head = np.asarray(target.unembed(eye))
    np.testing.assert_array_equal(np.asarray(quantized_variant(target, "int8/16").unembed(eye)), float_head)
    rounded = np.asarray(quantized_variant(target, "int8/16+head/8").unembed(eye))
    values, scales = quantize(float_head, WeightQuantization("int8", 8))
    np.testing.assert_array_equal(rounded, np.asarray(dequantize(values, scales, 8, np.float32)))
    assert not np.array_equal(rounded, float_head)


def test_the_agreement_benchmark_gives_named_matrices_their_own_blocks(float_pair):
    """"@MATRIX/B" variants round every 8-bit matrix in float, the named ones per B rows: with
    every matrix named alike they compute what the 8-bit target computes."""
    from bench.acceptance.quantized_agreement import parse_variant, quantized_variant
    from dflash_jax.dense import target_forward

    assert parse_variant("int8@down_proj/16@o_proj/32").matrices == (
        ("down_proj", WeightQuantization("int8", 16)), ("o_proj", WeightQuantization("int8", 32)))
    _, folder, _ = float_pair
    target = dflash_jax.load_target(folder, dtype="float32")
    ids = np.arange(1, 25, dtype=np.int32) % target.cfg.vocab_size
    logits = {name: np.asarray(target_forward(quantized_variant(target, name), ids)[0])
              for name in ("int8/16", "int8/16@down_proj/16", "int8", "int8@down_proj/16")}
    np.testing.assert_allclose(logits["int8/16@down_proj/16"], logits["int8/16"], atol=1e-4)
    mixed_moves = np.abs(logits["int8@down_proj/16"] - logits["int8"]).max()
    assert mixed_moves > 1e-3  # the named matrix's rounding changed
    with pytest.raises(ValueError, match="no 8-bit form"):
        quantized_variant(target, "int8@lm_head/16")


def test_the_activation_probe_rounds_each_token_on_its_own():
    """The W8A8 probe's rounding: each token's group of channels on one int8 scale (the last
    partial group too), the same numbers whatever tokens share the call."""
    from bench.acceptance.activation_rounding import rounded_through_int8

    x = np.random.default_rng(0).normal(size=(6, 40)).astype(np.float32)
    x[2, 3] = 50.0  # one outlier widens its own group's step only
    rounded = np.asarray(rounded_through_int8(x, 16))
    for lo in (0, 16, 32):
        group = x[:, lo:lo + 16]
        step = np.abs(group).max(axis=1, keepdims=True) / 127
        assert np.all(np.abs(rounded[:, lo:lo + 16] - group) <= step / 2 + 1e-6)
    np.testing.assert_array_equal(np.asarray(rounded_through_int8(x[2:3], 16)), rounded[2:3])
    assert np.abs(rounded[2, 16:] - x[2, 16:]).max() < 0.05 < np.abs(rounded[2, :16] - x[2, :16]).max()
    whole = np.asarray(rounded_through_int8(x, 0))
    assert np.abs(whole[2] - x[2]).max() > np.abs(rounded[2, 16:] - x[2, 16:]).max()


def test_the_activation_probe_rounds_only_the_8_bit_products_inputs(float_pair):
    """`with_rounded_inputs` moves an 8-bit target's logits a little (both scale layouts, the
    whole row's scale more than a group's), and leaves a float target's alone."""
    from bench.acceptance.activation_rounding import with_rounded_inputs
    from bench.acceptance.quantized_agreement import quantized_variant

    _, folder, _ = float_pair
    target = dflash_jax.load_target(folder, dtype="float32")
    for name in ("int8/16", "int8"):
        weights_only = logits_of(quantized_variant(target, name))
        moved = {group: np.abs(logits_of(with_rounded_inputs(quantized_variant(target, name), group))
                               - weights_only).max() for group in (16, 0)}
        assert 1e-4 < moved[16] < moved[0] < 0.1 * np.abs(weights_only).max()
    float_logits = logits_of(target)
    np.testing.assert_array_equal(logits_of(with_rounded_inputs(dflash_jax.load_target(folder, dtype="float32"), 16)),
                                  float_logits)
