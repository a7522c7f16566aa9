"""HF checkpoint folder (or llama.cpp GGUF file) -> NNX model, and -> orbax folder (atomically).

Every tensor is checked before it is placed: a missing or unexpected name, or a shape that
differs from the model the config describes, stops the conversion with the tensor's name.
The orbax folder is written in a staging folder beside OUT_DIR and renamed in at the end
(`dflash_jax.staging`), so a failure, Ctrl-C or SIGTERM leaves nothing behind, a folder that
appears at OUT_DIR meanwhile is never replaced, and an existing OUT_DIR is replaced only when
asked, by a swap that never shows a half-deleted folder.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from dflash_jax.checkpoint import save_checkpoint
from dflash_jax.config import DrafterConfig, TargetConfig, parse_config, read_config_json
from dflash_jax.formats.gguf_reader import gguf_target_rules, is_gguf_file, open_gguf
from dflash_jax.formats.gguf_tokenizer import gguf_tokenizer_files
from dflash_jax.formats.hf_reader import ConversionError, open_checkpoint
from dflash_jax.formats.weight_map import (
    drafter_ignored, drafter_plain_name, drafter_rules, get_path, set_path, target_ignored, target_rules,
)
from dflash_jax.models import abstract_model, model_from_params, quantize_model
from dflash_jax.placement import place_model
from dflash_jax.quantization import (DEFAULT_QUANTIZE_BLOCK, QUANTIZE_CHOICES, WeightQuantization, dequantized_on_read,
                                     hf_dequantized, hf_scale_shape, hf_scales, left_in_float,
                                     published_quantization_config, without_quantization)
from dflash_jax.staging import StagedOutput, refuse_overlap, terminate_raises

# Files copied next to the converted weights when present: tokenizer and generation defaults.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def model_from_hf(hf_dir: str | Path, dtype=None, *, progress: bool = False, mesh=None):
    """(raw config, model) from a HF folder or a .gguf file; `dtype` None keeps the stored dtype.
    With a `mesh` (`dflash_jax.sharding.make_mesh`) the tensors are assembled on the host and
    each device receives its shards of them (`dflash_jax.placement.place_model`).

    A GGUF file's tensors keep their llama.cpp names (so errors name what is in the file) and
    come dequantized to float32, which is then the default dtype.
    """
    hf_dir = Path(hf_dir)
    gguf = is_gguf_file(hf_dir)
    if gguf:
        raw_config, source = open_gguf(hf_dir)
        cfg = parse_config(raw_config)
    else:
        raw_config = read_config_json(hf_dir)
        cfg = parse_config(raw_config)
        if cfg.quantization is not None and cfg.quantization.hf_scale is None:
            raise ConversionError(f"{hf_dir} was written by `convert --quantize`: it is converted already and loads "
                                  "as it is; to convert again, start from the float HF checkpoint.")
        source = open_checkpoint(hf_dir)
    dequantized = None if gguf or isinstance(cfg, DrafterConfig) else dequantized_on_read(raw_config, cfg)
    if dequantized is not None:  # a float model from here on: its config.json says so
        raw_config = without_quantization(raw_config)
    shapes = dict(source.shapes)
    scale_of = {}  # a weight read dequantized -> the name of the scale tensor beside it
    aliases = {}
    if isinstance(cfg, DrafterConfig):
        # Drafter tensors may be spelled otherwise (`drafter_plain_name`); map each to its plain name.
        aliases = {drafter_plain_name(name): name for name in shapes}
        shapes = {drafter_plain_name(name): shape for name, shape in shapes.items()}
        cfg, raw_config = _resolve_fc_width(cfg, raw_config, shapes)
        rules, ignored = drafter_rules(cfg), drafter_ignored
    else:
        rules, ignored = (gguf_target_rules(cfg) if gguf else target_rules(cfg)), target_ignored

    if (not gguf and (getattr(cfg, "linear_attention", None) is not None or getattr(cfg, "experts", None) is not None)
            and any(rule.scales and rule.hf_name not in shapes for rule in rules)):
        # a hybrid or MoE checkpoint that stores products this model holds 8-bit without scales
        # (community FP8 checkpoints leave every linear_attn module float, or attention): one
        # float model, read dequantized, as such checkpoints loaded before their 8-bit forms
        cfg = dataclasses.replace(cfg, quantization=None)
        dequantized, raw_config = dequantized_on_read(raw_config, cfg), without_quantization(raw_config)
        rules = target_rules(cfg)
    float_products = [rule.hf_name.rsplit(".", 1)[0] for rule in rules if rule.scales and rule.hf_name not in shapes
                      and left_in_float(published_quantization_config(raw_config), rule.hf_name.rsplit(".", 1)[0])]
    # published 8-bit weights read as float: every one of a model read dequantized, else those
    # this model holds in float (Qwen3.5's b and a projections)
    reading = dequantized or (cfg.quantization if cfg.quantization is not None and cfg.quantization.hf_scale else None)
    if reading is not None:
        held = {rule.hf_name for rule in rules if rule.scales}  # scale tensors this model reads as scales
        beside = {rule.hf_name: rule.hf_name.removesuffix("weight") + reading.hf_scale for rule in rules}
        scale_of = {name: scale for name, scale in beside.items() if scale in shapes and scale not in held}
    expected = {rule.hf_name for rule in rules} | set(scale_of.values())
    if dequantized is not None:
        expected |= {name for name in shapes if name.endswith(".input_scale")}  # unused
    unexpected = sorted(n for n in shapes if n not in expected and not ignored(cfg, n))
    if unexpected:
        raise ConversionError(
            f"unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all) for {type(cfg).__name__} "
            "with this config.json; check that config and weights belong together."
        )
    missing = [rule.hf_name for rule in rules if rule.hf_name not in shapes]
    if float_products:
        raise ConversionError(
            f"{float_products[0]!r} ({len(float_products)} in all) stays in float "
            "(the quantization_config's modules_to_not_convert or ignore list) while the other decoder products "
            "are 8-bit; checkpoints that mix float and 8-bit decoder products are not supported: convert the "
            "float original with --quantize instead.")
    if missing:
        raise ConversionError(f"missing tensor {missing[0]!r} ({len(missing)} in all) in {hf_dir}.")

    for rule in rules:  # before any tensor is read: a non-float parameter means a wrong file
        stored = source.dtypes.get(aliases.get(rule.hf_name, rule.hf_name))
        if stored is not None and not stored.startswith(("float", "bfloat")) and not rule.vocab_offsets:
            raise ConversionError(_not_float(rule.hf_name, stored))
        if reading is not None and rule.hf_name in scale_of and stored != jnp.dtype(reading.dtype).name:
            raise ConversionError(f"tensor {rule.hf_name!r} is {stored} with a {reading.hf_scale} beside it; the "
                                  "checkpoint is damaged.")
        if (reading is not None and stored == jnp.dtype(reading.dtype).name and rule.hf_name not in scale_of
                and beside[rule.hf_name] not in held):
            raise ConversionError(f"tensor {rule.hf_name!r} is {stored} but has no {reading.hf_scale} beside it; "
                                  "the checkpoint is damaged.")
    if dtype is None:
        first = rules[0].hf_name
        dtype = _float_tensor(first, source.get(aliases.get(first, first))).dtype
    dtype = float_dtype(dtype)
    abstract_params = nnx.to_pure_dict(nnx.state(abstract_model(cfg, dtype), nnx.Param))
    for rule in rules:
        want = rule.part_shape(get_path(abstract_params, rule.path).shape)
        want_hf = tuple(reversed(want)) if rule.transpose else tuple(want)
        if rule.scales:  # beside a weight [out, in]: per block, per output channel, or one value
            weight = rule.part_shape(get_path(abstract_params, rule.weight_path).shape)
            want_hf = hf_scale_shape(cfg.quantization, *weight)
            if math.prod(shapes[rule.hf_name]) == 1:
                continue
        if rule.hf_name in scale_of:
            out, inp = shapes[rule.hf_name]
            got, want_scale = tuple(shapes[scale_of[rule.hf_name]]), hf_scale_shape(reading, inp, out)
            if math.prod(got) != 1 and got != want_scale and not (want_scale[1] == 1 and got == want_scale[:1]):
                raise ConversionError(f"shape mismatch for {scale_of[rule.hf_name]!r}: expected {list(want_scale)} "
                                      f"beside a weight [{out}, {inp}], got {list(got)}.")
        if rule.hf_part_shape(tuple(shapes[rule.hf_name])) != want_hf:
            raise ConversionError(
                f"shape mismatch for {rule.hf_name!r}: expected {list(want_hf)}"
                f"{' per half (its rows are [q | gate] per head)' if rule.head_part else ''}, "
                f"got {list(shapes[rule.hf_name])}."
            )

    xp = jnp if mesh is None else np  # on a mesh: host arrays, then shards
    params: dict[str, Any] = {}
    for rule in tqdm(rules, desc="converting", unit="tensor", disable=not progress):
        abstract = get_path(abstract_params, rule.path)  # its dtype: `dtype`, or 8-bit values and float32 scales
        array = source.get(aliases.get(rule.hf_name, rule.hf_name))
        if rule.vocab_offsets:
            array = _target_ids(rule.hf_name, array, cfg.vocab_size)
        elif rule.hf_name in scale_of:
            array = rule.hf_part(hf_dequantized(array, source.get(scale_of[rule.hf_name]), reading))
        elif rule.scales and np.size(array) == 1:  # one scale for the whole weight: no part to take
            array = _stored_as(rule.hf_name, array, abstract.dtype)
        else:
            array = rule.hf_part(_stored_as(rule.hf_name, array, abstract.dtype))
        if rule.plus_one:  # a zero-centred norm weight, in float32 before the cast
            array = np.asarray(array, np.float32) + 1
        if rule.scales:
            array = hf_scales(array, cfg.quantization, rule.part_shape(abstract.shape)[-1])
        array = xp.asarray(array)
        array = (array.T if rule.transpose else array).astype(abstract.dtype)
        if rule.columns is not None or rule.expert is not None:  # a piece of a fused parameter: fill it in place
            whole = _get_or_none(params, rule.path)
            if whole is None:
                whole = xp.zeros(abstract.shape, abstract.dtype)
            if mesh is None:
                array = whole.at[rule.region].set(array)
            else:
                whole[rule.region] = array
                array = whole
        set_path(params, rule.path, array)
    if mesh is not None:
        return raw_config, place_model(cfg, dtype, params, mesh)
    return raw_config, model_from_params(cfg, dtype, params)


def float_dtype(dtype) -> jnp.dtype:
    """`dtype` as a numpy dtype, or ConversionError unless it is a floating-point type."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise ConversionError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32.") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ConversionError(f"dtype {dtype.name} is not a floating-point type; use bfloat16, float16 or float32.")
    return dtype


def _float_tensor(name: str, array):
    """Every parameter is a float: a tensor stored as integers or bools means a wrong or
    damaged file, and casting it would silently give a broken model."""
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise ConversionError(_not_float(name, array.dtype))
    return array


def _stored_as(name: str, array, dtype):
    """`array`, checked against the parameter's dtype: 8-bit values must be stored in their
    8-bit type (a GGUF file's Q8_0 rows as int8, a published FP8 checkpoint's weights as
    float8_e4m3fn: a float there would be cast out of range), every other parameter as a float."""
    if jnp.dtype(dtype).itemsize != 1:
        return _float_tensor(name, array)
    if jnp.dtype(array.dtype) != jnp.dtype(dtype):
        raise ConversionError(f"tensor {name!r} is {array.dtype}, not the {jnp.dtype(dtype).name} values its config "
                              "describes; the checkpoint is damaged.")
    return array


def _target_ids(name: str, offsets, vocab_size: int):
    """int32 target ids i + offsets[i] of a reduced draft vocabulary, each checked to lie in
    the target's vocabulary and to be distinct (two draft rows for one token mean a broken map)."""
    offsets = np.asarray(offsets)
    if not np.issubdtype(offsets.dtype, np.integer):
        raise ConversionError(f"tensor {name!r} is stored as {offsets.dtype}; the draft-to-target map holds integer "
                              "offsets (the speculators format's d2t).")
    ids = np.arange(offsets.shape[0]) + offsets.astype(np.int64)
    if ids.min(initial=0) < 0 or ids.max(initial=0) >= vocab_size or len(np.unique(ids)) != len(ids):
        raise ConversionError(f"tensor {name!r} maps draft tokens outside the target's {vocab_size} ids or two onto "
                              "one; the checkpoint's d2t does not belong to this vocabulary.")
    return ids.astype(np.int32)


def _not_float(name: str, dtype) -> str:
    return (f"tensor {name!r} is stored as {dtype}, not a floating-point type; the checkpoint is damaged "
            "or is not a model of this kind.")


def _get_or_none(tree: dict, path: tuple):
    try:
        return get_path(tree, path)
    except KeyError:
        return None


def convert_checkpoint(
    hf_dir: str | Path, out_dir: str | Path, *, dtype=None, force: bool = False, progress: bool = False,
    quantize: str | None = None, quantize_block: int | None = DEFAULT_QUANTIZE_BLOCK,
) -> tuple[TargetConfig | DrafterConfig, jnp.dtype]:
    """Convert `hf_dir` (folder or .gguf file) into an orbax folder at `out_dir`; `quantize`
    ("int8" or "fp8") stores a float model's product weights in 8 bits, a scale per output
    channel and `quantize_block` input rows (None: per output channel).

    Returns (config, dtype written). A GGUF file's tokenizer is rebuilt from its metadata
    first, so an unsupported tokenizer stops the conversion before any weight is read.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    refuse_overlap(hf_dir, out_dir)
    if dtype is not None:
        dtype = float_dtype(dtype)
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ConversionError(f"cannot quantize to {quantize!r}; choose one of {', '.join(QUANTIZE_CHOICES)}.")
    if quantize_block is not None and (not isinstance(quantize_block, int) or quantize_block < 1):
        raise ConversionError(f"the quantization block must be a positive number of input rows, got "
                              f"{quantize_block!r}.")
    with terminate_raises(), StagedOutput(out_dir, force=force, what="conversion") as staged:
        tokenizer_files = gguf_tokenizer_files(hf_dir) if is_gguf_file(hf_dir) else {}
        raw_config, model = model_from_hf(hf_dir, dtype, progress=progress)
        if quantize is not None:
            raw_config, model = _quantized(raw_config, model, WeightQuantization(quantize, quantize_block))
        save_checkpoint(model, raw_config, staged.path)
        for name in SIDE_FILES:
            if (hf_dir / name).is_file():
                shutil.copy2(hf_dir / name, staged.path / name)
        for name, text in tokenizer_files.items():
            (staged.path / name).write_text(text)
        staged.commit()
    return model.cfg, model.dtype


def _quantized(raw_config: dict, model, quantization: WeightQuantization):
    """(config.json naming the quantization, the model with 8-bit weights in its products)."""
    if model.cfg.quantization is not None:
        raise ConversionError("this checkpoint's weights are 8-bit already and stay so; convert it without --quantize.")
    if isinstance(model.cfg, DrafterConfig) and model.cfg.dflash2 is not None:
        raise ConversionError("8-bit DFlash 2 drafters are not supported yet; convert without --quantize.")
    return {**raw_config, "quantization_config": quantization.to_config()}, quantize_model(model, quantization)


def _resolve_fc_width(cfg: DrafterConfig, raw_config: dict, shapes: dict):
    """`fc` input width = len(target_layer_ids) * target hidden size: infer or check it."""
    fc_shape = shapes.get("fc.weight")
    if fc_shape is None or len(fc_shape) != 2:
        return cfg, raw_config
    width, n = fc_shape[1], len(cfg.target_layer_ids)
    if width % n:
        raise ConversionError(
            f"fc.weight takes {width} inputs, not a multiple of len(target_layer_ids) = {n}; "
            "the drafter's target_layer_ids do not match its weights."
        )
    if width == cfg.fc_in_features:
        return cfg, raw_config
    if "target_hidden_size" in raw_config or "target_hidden_size" in raw_config.get("dflash_config", {}):
        raise ConversionError(
            f"fc.weight takes {width} inputs but len(target_layer_ids) * target_hidden_size = "
            f"{n} * {cfg.target_hidden_size} = {cfg.fc_in_features}; fix the drafter's config.json."
        )
    raw_config = json.loads(json.dumps(raw_config))
    raw_config.setdefault("dflash_config", {})["target_hidden_size"] = width // n
    return dataclasses.replace(cfg, target_hidden_size=width // n), raw_config
