"""HF tensor name -> parameter path tables, one per model family.

Each rule says where a HF tensor goes in the NNX parameter tree, whether it is a PyTorch
`Linear` weight (`[out, in]`, transposed to our `[in, out]` kernels), and, for a fused
parameter, which columns (last-axis range) it fills: HF's q_proj, k_proj and v_proj are the
three column blocks of our `qkv_proj`, gate_proj and up_proj the two of `gate_up_proj`; an
expert's tensors fill one index of the experts' stacked parameters.
Shapes are checked against the model built from the config, so the tables hold no shapes of
their own.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from dflash_jax.config import VISION_LANGUAGE_ARCHITECTURES, ConfigError, DrafterConfig, ExpertsConfig, TargetConfig


@dataclasses.dataclass(frozen=True)
class WeightRule:
    hf_name: str
    path: tuple[str | int, ...]
    transpose: bool
    columns: tuple[int, int] | None = None  # [start, stop) of the parameter's last axis; None: all
    scales: bool = False  # a quantized weight's scale tensor (`quantization.hf_scales` lays it out)
    expert: int | None = None  # the index of the parameter's first (experts) axis it fills; None: all
    vocab_offsets: bool = False  # integer offsets i -> i + offset[i] (speculators' d2t), stored as target ids
    plus_one: bool = False  # a zero-centred norm's weight w (Qwen3.5), held as 1 + w
    head_part: tuple[int, int, int] | None = None  # (parts, index, head dim): the HF rows are per head
    # [part 0 | part 1 | ...] of head dim rows each, and this rule takes part `index` (Qwen3.5's q_proj: [q | gate])

    def hf_part(self, array):
        """This rule's piece of the HF tensor (all of it unless `head_part`)."""
        if self.head_part is None:
            return array
        parts, index, head_dim = self.head_part
        return array.reshape(-1, parts, head_dim, *array.shape[1:])[:, index].reshape(-1, *array.shape[1:])

    def hf_part_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape if self.head_part is None else (shape[0] // self.head_part[0], *shape[1:])

    @property
    def weight_path(self) -> tuple:
        """A scale tensor's weight: a `QuantizedLinear`'s kernel beside its scale, or the routed
        experts' `gate_up` / `down` beside `gate_up_scale` / `down_scale`."""
        *module, name = self.path
        return (*module, "kernel") if name == "scale" else (*module, name.removesuffix("_scale"))

    @property
    def region(self) -> tuple:
        """The index of this rule's piece within its (our-layout) parameter."""
        lead = () if self.expert is None else (self.expert,)
        return (*lead, Ellipsis, slice(*self.columns) if self.columns is not None else slice(None))

    def part(self, param):
        """This rule's piece of the (our-layout) parameter `param`."""
        return param[self.region]

    def part_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = shape if self.expert is None else shape[1:]
        return shape if self.columns is None else (*shape[:-1], self.columns[1] - self.columns[0])


# Buffers some exporters save next to the weights; they carry no learned values.
IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _linear(hf_prefix: str, path: tuple, *, bias: bool, columns: tuple[int, int] | None = None,
            scale_name: str | None = None) -> list[WeightRule]:
    rules = [WeightRule(f"{hf_prefix}.weight", (*path, "kernel"), True, columns)]
    if scale_name is not None:
        rules.append(WeightRule(f"{hf_prefix}.{scale_name}", (*path, "scale"), False, columns, scales=True))
    if bias:
        rules.append(WeightRule(f"{hf_prefix}.bias", (*path, "bias"), False, columns))
    return rules


def _norm(hf_prefix: str, path: tuple, plus_one: bool = False) -> WeightRule:
    return WeightRule(f"{hf_prefix}.weight", (*path, "weight"), False, plus_one=plus_one)


def _decoder_layer(hf: str, path: tuple, cfg, *, mlp_bias: bool, qk_norm: bool,
                   experts: ExpertsConfig | None = None, sinks: bool = False):
    zero_centered = getattr(cfg, "zero_centered_norms", False)
    rules = [
        _norm(f"{hf}.input_layernorm", (*path, "input_layernorm"), zero_centered),
        _norm(f"{hf}.post_attention_layernorm", (*path, "post_attention_layernorm"), zero_centered),
    ]
    scale_name = cfg.quantization and cfg.quantization.hf_scale
    linear = functools.partial(_linear, scale_name=scale_name)
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if getattr(cfg, "is_linear_attention", lambda _: False)(int(path[-1])):
        rules += _gated_delta_net(f"{hf}.linear_attn", (*path, "linear_attn"), linear)
    else:
        gated = getattr(cfg, "attention_output_gate", False)
        starts = {"q_proj": 0, "k_proj": q_width, "v_proj": q_width + kv_width}
        for proj, start in starts.items():
            width = q_width if proj == "q_proj" else kv_width
            rules += [_head_part(rule, 0, cfg) if gated and proj == "q_proj" else rule
                      for rule in linear(f"{hf}.self_attn.{proj}", (*path, "self_attn", "qkv_proj"),
                                         bias=cfg.attention_bias, columns=(start, start + width))]
        if gated:  # Qwen3.5's q_proj holds [q | gate] per head
            rules += [_head_part(rule, 1, cfg) for rule in linear(f"{hf}.self_attn.q_proj", (*path, "self_attn", "gate_proj"),
                                                                  bias=cfg.attention_bias)]
        rules += linear(f"{hf}.self_attn.o_proj", (*path, "self_attn", "o_proj"), bias=cfg.attention_bias)
        if qk_norm:
            rules += [_norm(f"{hf}.self_attn.{n}", (*path, "self_attn", n), zero_centered) for n in ("q_norm", "k_norm")]
    if sinks:
        rules.append(WeightRule(f"{hf}.self_attn.sinks", (*path, "self_attn", "sinks"), False))
    if experts is not None and experts.interleaved:
        return rules + _gpt_oss_experts(f"{hf}.mlp", (*path, "mlp"))
    if experts is not None and experts.shared_intermediate_size:  # Qwen3.5-MoE: and one shared, gated expert
        return (rules + _routed_experts(f"{hf}.mlp", (*path, "mlp"), experts, scale_name)
                + _swiglu(f"{hf}.mlp.shared_expert", (*path, "mlp", "shared_expert"), experts.shared_intermediate_size,
                          bias=False, linear=linear)
                + _linear(f"{hf}.mlp.shared_expert_gate", (*path, "mlp", "shared_expert_gate"), bias=False))
    if experts is not None:
        return rules + _routed_experts(f"{hf}.mlp", (*path, "mlp"), experts, scale_name)
    return rules + _swiglu(f"{hf}.mlp", (*path, "mlp"), cfg.intermediate_size, bias=mlp_bias, linear=linear)


def _head_part(rule: WeightRule, index: int, cfg) -> WeightRule:
    """`rule` taking part `index` of each head's [q | gate] rows; a block scale's rows are
    blocks of `block_out` weight rows, so its heads are head_dim / block_out rows each."""
    rows = cfg.head_dim
    if rule.scales:
        if cfg.head_dim % cfg.quantization.block_out:
            raise ConfigError(f"8-bit scales in blocks of {cfg.quantization.block_out} rows straddle the "
                              f"{cfg.head_dim}-row halves of the gated q_proj's heads; convert the float checkpoint.")
        rows //= cfg.quantization.block_out
    return dataclasses.replace(rule, head_part=(2, index, rows))


def _swiglu(hf: str, path: tuple, inter: int, *, bias: bool, linear) -> list[WeightRule]:
    """A SwiGLU's gate_proj and up_proj as the two column blocks of our gate_up_proj, and its down_proj."""
    rules = []
    for proj, start in (("gate_proj", 0), ("up_proj", inter)):
        rules += linear(f"{hf}.{proj}", (*path, "gate_up_proj"), bias=bias, columns=(start, start + inter))
    return rules + linear(f"{hf}.down_proj", (*path, "down_proj"), bias=bias)


def _gated_delta_net(hf: str, path: tuple, linear) -> list[WeightRule]:
    """Qwen3.5's linear-attention mixer, tensor for tensor; `linear` (with scales where the
    config is 8-bit) for its wide products, b and a always float (`GatedDeltaNet`)."""
    rules = [rule for name in ("in_proj_qkv", "in_proj_z", "out_proj")
             for rule in linear(f"{hf}.{name}", (*path, name), bias=False)]
    rules += [rule for name in ("in_proj_b", "in_proj_a") for rule in _linear(f"{hf}.{name}", (*path, name), bias=False)]
    return rules + [WeightRule(f"{hf}.conv1d.weight", (*path, "conv1d_weight"), False),
                    WeightRule(f"{hf}.dt_bias", (*path, "dt_bias"), False),
                    WeightRule(f"{hf}.A_log", (*path, "A_log"), False),
                    _norm(f"{hf}.norm", (*path, "norm"))]


def _routed_experts(hf: str, path: tuple, experts: ExpertsConfig, scale_name: str | None) -> list[WeightRule]:
    """Qwen3-MoE's `gate` (the router) and per-expert `experts.{e}.{gate,up,down}_proj`, with
    the scale tensor beside each (`scale_name`) where the experts are 8-bit."""
    rules = [WeightRule(f"{hf}.gate.weight", (*path, "router", "kernel"), True)]
    inter = experts.intermediate_size
    for e in range(experts.num_experts):
        for proj, name, columns in (("gate_proj", "gate_up", (0, inter)), ("up_proj", "gate_up", (inter, 2 * inter)),
                                    ("down_proj", "down", None)):
            prefix = f"{hf}.experts.{e}.{proj}"
            rules.append(WeightRule(f"{prefix}.weight", (*path, name), True, columns, expert=e))
            if scale_name is not None:
                rules.append(WeightRule(f"{prefix}.{scale_name}", (*path, f"{name}_scale"), False, columns,
                                        scales=True, expert=e))
    return rules


def _gpt_oss_experts(hf: str, path: tuple) -> list[WeightRule]:
    """gpt-oss's `router` (with bias) and its experts stacked as transformers writes them:
    `gate_up_proj` [E, D, 2I] (gate and up columns interleaved), `down_proj` [E, I, D], and
    their biases; a published checkpoint's MXFP4 blocks are read as these (`hf_reader`)."""
    rules = [WeightRule(f"{hf}.router.weight", (*path, "router", "kernel"), True),
             WeightRule(f"{hf}.router.bias", (*path, "router", "bias"), False)]
    for name in ("gate_up", "down"):
        rules += [WeightRule(f"{hf}.experts.{name}_proj", (*path, name), False),
                  WeightRule(f"{hf}.experts.{name}_proj_bias", (*path, f"{name}_bias"), False)]
    return rules


def target_rules(cfg: TargetConfig) -> list[WeightRule]:
    """`Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` / `GptOssForCausalLM` / `LlamaForCausalLM` /
    `Qwen3_5ForCausalLM` names (`model.` prefix, `lm_head` unless tied), and a Qwen3.5
    vision-language checkpoint's text model (`model.language_model.`)."""
    model = "model.language_model" if cfg.architecture in VISION_LANGUAGE_ARCHITECTURES else "model"
    rules = [WeightRule(f"{model}.embed_tokens.weight", ("embed_tokens", "embedding"), False)]
    for i in range(cfg.num_layers):
        rules += _decoder_layer(f"{model}.layers.{i}", ("layers", i), cfg, mlp_bias=cfg.mlp_bias, qk_norm=cfg.qk_norm,
                                experts=cfg.layer_experts(i), sinks=cfg.attention_sinks)
    rules.append(_norm(f"{model}.norm", ("norm",), cfg.zero_centered_norms))
    if not cfg.tie_word_embeddings:
        rules += _linear("lm_head", ("lm_head",), bias=False)
    return rules


def target_ignored(cfg: TargetConfig, name: str) -> bool:
    """A tied model may still ship `lm_head.weight` (a copy of the embedding): not used; nor
    are an 8-bit checkpoint's activation scales (its products run on unquantized activations)."""
    return (bool(IGNORED_TENSORS.search(name)) or (cfg.tie_word_embeddings and name == "lm_head.weight")
            or (cfg.quantization is not None and name.endswith(".input_scale"))
            or (cfg.linear_attention is not None and name.startswith(QWEN3_5_UNUSED)))


# Qwen3.5 checkpoints' vision tower and multi-token-prediction head: not part of the text model.
QWEN3_5_UNUSED = ("model.visual.", "mtp.")


def drafter_rules(cfg: DrafterConfig) -> list[WeightRule]:
    """z-lab DFlash-1 and DFlash 2 names (spec section 3), as `drafter_plain_name` spells them."""
    rules = _linear("fc", ("fc",), bias=False) + [_norm("hidden_norm", ("hidden_norm",))]
    for i in range(cfg.num_layers):
        rules += _decoder_layer(f"layers.{i}", ("layers", i), cfg, mlp_bias=False, qk_norm=True)
        for conv in ("attention_conv", "mlp_conv") if cfg.dflash2 else ():
            rules.append(WeightRule(f"layers.{i}.{conv}.base_kernel", ("layers", i, conv, "base_kernel"), False))
            rules += _linear(f"layers.{i}.{conv}.kernel_projection", ("layers", i, conv, "kernel_projection"),
                             bias=False)
    rules.append(_norm("norm", ("norm",)))
    if cfg.dflash2:
        selector = ("candidate_selector",)
        rules += [WeightRule(f"candidate_selector.{name}", (*selector, name), False)
                  for name in ("predecessor_codebook", "successor_codebook")]
        rules += _linear("candidate_selector.hidden_projection", (*selector, "hidden_projection"), bias=False)
    if cfg.draft_vocab_size is not None:  # the speculators format's reduced vocabulary: its head, its ids
        rules += _linear("lm_head", ("draft_head",), bias=False)
        rules.append(WeightRule("d2t", ("draft_to_target",), False, vocab_offsets=True))
    return rules


def drafter_plain_name(name: str) -> str:
    """A drafter tensor's name as the rules spell it: without an optional `model.` prefix, and
    DFlash 2's codebooks bare (as z-lab publishes them; transformers' save adds `.weight`)."""
    name = name.removeprefix("model.")
    return name.removesuffix(".weight") if name.endswith("_codebook.weight") else name


# The speculators format's copies of the target's tables (the drafter reads the target's own),
# and its target-to-draft mask (d2t says the same).
SPECULATORS_COPIES = ("embed_tokens.weight", "lm_head.weight", "t2d")


def drafter_ignored(cfg: DrafterConfig, name: str) -> bool:
    return bool(IGNORED_TENSORS.search(name)) or name in SPECULATORS_COPIES


def get_path(tree: dict, path: tuple):
    """The leaf of a nested parameter dict at `path`."""
    for key in path:
        tree = tree[key]
    return tree


def set_path(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
