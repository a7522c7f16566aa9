"""A new drafter for a given target: its config, and the mask token when none is given.

Shapes follow the target (hidden size, heads, head dim, RoPE) because the drafter shares the
target's embedding and LM head and reads its hidden states; depth, block size, FFN width and
the target layers it reads are choices. All layers are full (non-causal) attention, as in the
published Qwen3 drafters. Weights start random (`Drafter(cfg, rngs=...)`), as in z-lab's and
SpecForge's recipes; copying target layers in is not done, since the drafter's layers see a
different input (block embeddings plus projected multi-layer features).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from dflash_jax.config import DFlash2Config, DrafterConfig, LayerAttention, TargetConfig, default_target_layer_ids
from dflash_jax.models import Drafter


def new_drafter_config(
    target: TargetConfig,
    *,
    mask_token_id: int,
    num_layers: int = 5,
    block_size: int = 16,
    intermediate_size: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
    dflash2: DFlash2Config | None = None,
) -> DrafterConfig:
    """DrafterConfig for `target`; layer ids default to spec section 3's uniform rule; with
    `dflash2`, a DFlash 2 drafter (start its parts with `start_dflash2_parts`)."""
    if num_layers < 1 or block_size < 2:
        raise ValueError(f"need num_layers >= 1 and block_size >= 2, got {num_layers} and {block_size}.")
    if not 0 <= mask_token_id < target.vocab_size:
        raise ValueError(
            f"mask_token_id {mask_token_id} is outside the target's vocabulary [0, {target.vocab_size})."
        )
    ids = tuple(target_layer_ids or default_target_layer_ids(target.num_layers, num_layers))
    if any(not 0 <= i < target.num_layers for i in ids):
        raise ValueError(f"target_layer_ids {list(ids)} must lie in [0, {target.num_layers}).")
    return DrafterConfig(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_layers=num_layers,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps,
        rope=target.rope,
        max_position_embeddings=target.max_position_embeddings,
        attention_bias=False,
        target_layer_ids=ids,
        target_hidden_size=target.hidden_size,
        num_target_layers=target.num_layers,
        mask_token_id=mask_token_id,
        trained_block_size=block_size,
        layers=(LayerAttention(causal=False),) * num_layers,
        dflash2=dflash2,
    )


def default_mask_token_id(target_dir: str | Path, vocab_size: int) -> int:
    """The first embedding row past the tokenizer's vocabulary: a padded row no text produces.

    Qwen3 pads 151669 tokens to 151936 rows, so this gives 151669, the published drafters'
    choice. Targets without padding rows (or without a tokenizer.json) need an explicit id.
    """
    path = Path(target_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"{target_dir} has no tokenizer.json to pick a mask token from; pass --mask-token-id "
            "(an id the tokenizer never produces, e.g. a padded vocabulary row or an unused special token)."
        )
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer.get("model", {}).get("vocab", {})  # BPE: {token: id}; Unigram: [[token, score]]
    used = {int(i) for i in vocab.values()} if isinstance(vocab, dict) else set(range(len(vocab)))
    used |= {int(t["id"]) for t in tokenizer.get("added_tokens", [])}
    first_free = max(used, default=-1) + 1
    if first_free >= vocab_size:
        raise ValueError(
            f"the tokenizer uses every one of the target's {vocab_size} rows; pass --mask-token-id "
            "(e.g. an unused reserved special token)."
        )
    return first_free


def with_dflash2(drafter: Drafter, dflash2: DFlash2Config, *, seed: int = 0) -> Drafter:
    """A DFlash 2 drafter that drafts exactly as `drafter` (DFlash-1) does before training:
    the same backbone weights, convolutions that pass their input through and a selector
    whose pairing term is zero (`start_dflash2_parts`)."""
    if drafter.cfg.dflash2 is not None:
        raise ValueError("the drafter is a DFlash 2 drafter already; train it as it is.")
    grown = Drafter(dataclasses.replace(drafter.cfg, dflash2=dflash2), dtype=drafter.dtype, rngs=nnx.Rngs(seed))
    nnx.update(grown, nnx.state(drafter, nnx.Param))
    start_dflash2_parts(grown)
    return grown


def start_dflash2_parts(drafter: Drafter) -> None:
    """DFlash 2's parts set to leave the DFlash-1 path unchanged, in place: each convolution's
    base kernel one at the current position and zero elsewhere, no predicted kernel; the
    selector's hidden projection zero, so its pairing term starts at zero while the random
    codebooks still give that projection a gradient."""
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            base = jnp.zeros_like(conv.base_kernel[...])
            conv.base_kernel[...] = base.at[:, 0, :].set(1)
            conv.kernel_projection.kernel[...] = jnp.zeros_like(conv.kernel_projection.kernel[...])
    projection = drafter.candidate_selector.hidden_projection.kernel
    projection[...] = jnp.zeros_like(projection[...])
