"""The dense, uncached API: one sequence, no KV cache. For experiments and parity tests.

Each call hands the models to a `jax.jit`-compiled function as pytrees (NNX modules are),
so repeated calls with the same shapes do not retrace and always read the current parameters.
Sequence lengths are padded to a power of two (at least `MIN_LENGTH_BUCKET`) behind masks, so
a caller walking a growing sequence (a replay of decoding, one call per step) compiles one
program per bucket rather than one per length.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dflash_jax.attention import dense_attention, target_attend
from dflash_jax.config import check_drafter_fits_target
from dflash_jax.kernels import Kernels
from dflash_jax.layers import finishing
from dflash_jax.models import Drafter, Target
from dflash_jax.placement import on_one_mesh
from pallas_kernels.attention_mask import position_mask
from pallas_kernels.common import next_pow2

MIN_LENGTH_BUCKET = 16


def _token_ids(token_ids, vocab_size: int, what: str) -> jax.Array:
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{what} must be a non-empty 1-D sequence of integer token ids, got shape {ids.shape}.")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{what} holds ids outside the vocabulary [0, {vocab_size}).")
    return jnp.asarray(ids, jnp.int32)


def _padded_length(length: int) -> int:
    return max(MIN_LENGTH_BUCKET, next_pow2(length))


def target_forward(target: Target, token_ids, *, layer_ids: Sequence[int] = (), kernels: Kernels = Kernels(),
                   mesh: Mesh | None = None):
    """(logits [T, V] float32, features [T, F], F = len(layer_ids) * D) for positions 0..T-1.

    `features` concatenates the outputs of the listed decoder layers (0-based, before the
    final norm: HF `hidden_states[id + 1]`), in the order given. Of `kernels` the dense path
    uses the norm's and the 8-bit product's (attention here is dense, with no cache to write). `mesh` as for
    `generate` (XLA partitions the whole forward; the norm kernel runs unsharded).
    """
    (target,) = on_one_mesh((target,), mesh)
    ids = _token_ids(token_ids, target.cfg.vocab_size, "token_ids")
    layer_ids = tuple(int(i) for i in layer_ids)
    if any(not 0 <= i < target.cfg.num_layers for i in layer_ids):
        raise ValueError(f"layer_ids {list(layer_ids)} must lie in [0, {target.cfg.num_layers}).")
    num_tokens = ids.shape[0]
    ids_T = jnp.pad(ids, (0, _padded_length(num_tokens) - num_tokens))  # causal: the tail sees the rest, not back
    logits_TV, features_TF = _target_forward(target, ids_T, layer_ids, kernels.resolve(target.mesh))
    return logits_TV[:num_tokens], features_TF[:num_tokens]


@functools.partial(jax.jit, static_argnames=("layer_ids", "kernels"))
def _target_forward(target, ids_T, layer_ids, kernels):
    positions_T = jnp.arange(ids_T.shape[0], dtype=jnp.int32)
    attend = target_attend(target.cfg, positions_T)
    hidden_TD, features_TF = target(ids_T, positions_T, attend, layer_ids=layer_ids, kernels=kernels)
    return target.unembed(hidden_TD), features_TF


def draft_logits(target: Target, drafter: Drafter, features, block_token_ids, *, kernels: Kernels = Kernels(),
                 mesh: Mesh | None = None):
    """float32 logits [B - 1, V] of block slots 1..B-1.

    `features` [S, n * H] are target features of positions 0..S-1 (as `target_forward`
    returns them for the drafter's `target_layer_ids`); the block sits at positions
    S..S+B-1, slot 0 the anchor and the rest normally the mask token. `mesh` as for
    `target_forward`.
    """
    target, drafter, *inputs = _draft_inputs(target, drafter, features, block_token_ids, mesh)
    return _draft_logits(target, drafter, *inputs, kernels.resolve(target.mesh))[1]


def draft_path(target: Target, drafter: Drafter, features, block_token_ids, *, kernels: Kernels = Kernels(),
               mesh: Mesh | None = None):
    """A DFlash 2 drafter's greedy drafts for block slots 1..B-1 (`draft_logits`'s arguments):
    (the drafts [B - 1], each slot's top-K candidates [B - 1, K], their logits [B - 1, V]),
    the candidate selector walking the block from its anchor, slot 0."""
    if drafter.cfg.dflash2 is None:
        raise ValueError("draft_path needs a DFlash 2 drafter (a DFlash2DraftModel checkpoint); a DFlash-1 drafter's "
                         "drafts are the argmax of draft_logits.")
    target, drafter, *inputs = _draft_inputs(target, drafter, features, block_token_ids, mesh)
    hidden, logits = _draft_logits(target, drafter, *inputs, kernels.resolve(target.mesh))
    drafts, candidates = _greedy_path(drafter, hidden, logits, inputs[-1][0])
    return drafts, candidates, logits


def _draft_inputs(target, drafter, features, block_token_ids, mesh):
    """(target, drafter, features padded to a bucket, their real rows, the block's ids), checked."""
    target, drafter = on_one_mesh((target, drafter), mesh)
    check_drafter_fits_target(target.cfg, drafter.cfg)
    block = _token_ids(block_token_ids, target.cfg.vocab_size, "block_token_ids")
    if block.shape[0] < 2:
        raise ValueError("block_token_ids needs at least 2 slots: the anchor and one to draft.")
    features = jnp.asarray(features)
    if features.ndim != 2 or features.shape[1] != drafter.cfg.fc_in_features:
        raise ValueError(
            f"features must be [S, {drafter.cfg.fc_in_features}] (target layers "
            f"{list(drafter.cfg.target_layer_ids)} concatenated), got {list(features.shape)}."
        )
    num_ctx = features.shape[0]
    features_LF = jnp.pad(features, ((0, _padded_length(num_ctx) - num_ctx), (0, 0)))
    return target, drafter, features_LF, jnp.int32(num_ctx), block


@jax.jit
def _greedy_path(drafter, hidden_PD, logits_PV, anchor):
    return drafter.candidate_selector.greedy_path(hidden_PD, logits_PV, anchor)


@functools.partial(jax.jit, static_argnames=("kernels",))
def _draft_logits(target, drafter, features_LF, num_ctx, block_B, kernels):
    """(hidden [B - 1, D], float32 logits [B - 1, V]) of block slots 1..B-1. Context features
    padded to L rows, of which the first `num_ctx` are real: the padding's keys are masked out
    and the block sits right after the real context."""
    ctx_positions_L = jnp.arange(features_LF.shape[0], dtype=jnp.int32)
    block_positions_B = num_ctx + jnp.arange(block_B.shape[0], dtype=jnp.int32)
    context_kv = drafter.context_kv(features_LF, ctx_positions_L)
    key_positions = jnp.concatenate([ctx_positions_L, block_positions_B])
    real_keys = jnp.concatenate([ctx_positions_L < num_ctx, jnp.ones(block_B.shape, bool)])

    def attend(layer_idx, q, k, v):
        ctx_k, ctx_v = context_kv[layer_idx]
        mask = position_mask(block_positions_B, key_positions, drafter.cfg.layers[layer_idx]) & real_keys
        return dense_attention(
            q, jnp.concatenate([ctx_k, k]), jnp.concatenate([ctx_v, v]), mask
        )

    hidden_BD = drafter(target.embed(block_B).astype(drafter.dtype), block_positions_B, finishing(attend), kernels)
    return hidden_BD[1:], drafter.logits(target.unembed, hidden_BD[1:].astype(target.dtype))
