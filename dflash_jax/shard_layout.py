"""The per-shard column layout of the fused matrices, for tensor parallelism over S shards.

A one-device `qkv_proj` holds its columns as [q heads | k heads | v heads] and `gate_up_proj`
as [gate | up]. Cut into S equal column blocks, those layouts would give a shard some query
heads and no keys; so on a mesh the columns are reordered on the host, before placement, into
S groups, each in the one-device layout of its own heads (`layers.Attention`, `layers.MLP`):

    qkv, N = 4 query heads, K = 2 kv heads, S = 2:  [q0 q1 q2 q3 k0 k1 v0 v1]
                                                 -> [q0 q1 k0 v0 | q2 q3 k1 v1]
    gate_up, S = 2:                    [g0 g1 g2 g3 u0 u1 u2 u3] -> [g0 g1 u0 u1 | g2 g3 u2 u3]

With fewer kv heads than shards each kv head is repeated for the shards whose query heads
read it (K = 2, S = 4: kv heads [k0 k0 k1 k1], one per shard); the model then has S kv heads,
two of each, and computes exactly what it did with two.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dflash_jax.config import ConfigError, DrafterConfig, TargetConfig


def kv_heads_on(cfg: TargetConfig | DrafterConfig, shards: int) -> int:
    """The kv heads a model has on `shards` tensor-parallel shards (its own, or one per
    shard when it has fewer), or ConfigError if its heads cannot be split that way."""
    what = "target" if isinstance(cfg, TargetConfig) else "drafter"
    experts = getattr(cfg, "experts", None)
    shared = (experts.shared_intermediate_size or 0) if experts is not None else 0  # a shared expert's MLP width
    if cfg.num_heads % shards or cfg.intermediate_size % shards or shared % shards:
        raise ConfigError(
            f"the {what}'s {cfg.num_heads} attention heads and {cfg.intermediate_size} MLP columns"
            f"{f' (shared expert: {shared})' if shared else ''} must all divide by the tensor-parallel size "
            f"{shards}; pick a size that divides them."
        )
    if cfg.num_kv_heads % shards == 0:
        return cfg.num_kv_heads
    if shards % cfg.num_kv_heads == 0:
        return shards
    raise ConfigError(
        f"the {what}'s {cfg.num_kv_heads} kv heads and the tensor-parallel size {shards} must divide one "
        "another; pick a size that divides them or that they divide."
    )


def sharded_config(cfg: TargetConfig | DrafterConfig, shards: int):
    """`cfg` as the model on `shards` shards sees it: kv heads repeated up to one per shard."""
    return dataclasses.replace(cfg, num_kv_heads=kv_heads_on(cfg, shards))


def qkv_columns(cfg: TargetConfig | DrafterConfig, shards: int) -> np.ndarray:
    """Indices into a one-device `qkv_proj`'s columns, in the order of the `shards` layout
    (the module docstring's example)."""
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kv_heads = kv_heads_on(cfg, shards)
    repeats = kv_heads // k
    heads = []
    for shard in range(shards):
        own_kv = [head // repeats for head in range(shard * kv_heads // shards, (shard + 1) * kv_heads // shards)]
        heads += list(range(shard * n // shards, (shard + 1) * n // shards))
        heads += [n + head for head in own_kv] + [n + k + head for head in own_kv]
    return (np.asarray(heads)[:, None] * h + np.arange(h)).reshape(-1)


def linear_attention_shards(cfg: TargetConfig | DrafterConfig, shards: int) -> int:
    """The groups a target's gated-delta-net heads split into on `shards` shards: `shards`
    when its key and value heads both divide by it, else 1 (those layers then run whole on
    every shard, as XLA partitions them)."""
    la = getattr(cfg, "linear_attention", None)
    return shards if la is not None and la.num_key_heads % shards == 0 == la.num_value_heads % shards else 1


def conv_columns(cfg: TargetConfig, shards: int) -> np.ndarray:
    """Indices into a one-device gated-delta-net `in_proj_qkv`'s columns (and its convolution's
    channels), [q | k | v], in the order of the `shards` layout: per shard the q, k and v
    columns of its key and value heads."""
    la = cfg.linear_attention
    q_width, v_width = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
    q_step, v_step = q_width // shards, v_width // shards
    return np.concatenate([np.r_[s * q_step: (s + 1) * q_step, q_width + s * q_step: q_width + (s + 1) * q_step,
                                 2 * q_width + s * v_step: 2 * q_width + (s + 1) * v_step] for s in range(shards)])


def gate_up_columns(intermediate: int, shards: int) -> np.ndarray:
    """Indices into a one-device `gate_up_proj`'s columns, in the order of the `shards` layout."""
    width = intermediate // shards
    return np.concatenate([
        np.r_[shard * width : (shard + 1) * width, intermediate + shard * width : intermediate + (shard + 1) * width]
        for shard in range(shards)
    ])


def to_shard_layout(cfg: TargetConfig | DrafterConfig, params: dict, shards: int) -> dict:
    """A nested parameter dict (`nnx.to_pure_dict` layout, host arrays) with its fused columns
    in the `shards` layout; other parameters are the same arrays."""
    if shards == 1:
        return params
    qkv = qkv_columns(cfg, shards)
    conv = conv_columns(cfg, linear_attention_shards(cfg, shards)) if getattr(cfg, "linear_attention", None) else None

    def reorder(tree: dict, name: str | None = None) -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out[key] = reorder(value, key)
            elif name == "qkv_proj":
                out[key] = np.asarray(value)[..., qkv]
            elif name == "gate_up_proj":  # a dense layer's, or a shared expert's of its own width
                out[key] = np.asarray(value)[..., gate_up_columns(np.shape(value)[-1] // 2, shards)]
            elif name == "in_proj_qkv":
                out[key] = np.asarray(value)[..., conv]
            elif key == "conv1d_weight":
                out[key] = np.asarray(value)[conv]
            else:
                out[key] = value
        return out

    return reorder(params)
