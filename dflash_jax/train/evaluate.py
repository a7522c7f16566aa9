"""Mean accepted length of a drafter: a dense greedy speculative loop (spec section 4).

No KV cache: every cycle reruns the target over a fixed-size buffer (causal, so the rows past
the committed end do not matter), drafts one block with the training forward at a single
anchor, and verifies it with a second target pass. Fixed shapes mean one compile per
(prompt length + budget) bucket. For checking training on small models; the paged runtime
measures the real thing.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.config import check_drafter_fits_target
from dflash_jax.models import Drafter, Target
from dflash_jax.train.forward import block_drafts, target_logits_and_features
from pallas_kernels.common import next_pow2


def speculative_greedy(target: Target, drafter: Drafter, prompt: Sequence[int], max_new_tokens: int):
    """(generated token ids, accepted length per cycle). The ids equal plain greedy decoding."""
    check_drafter_fits_target(target.cfg, drafter.cfg)
    if len(prompt) == 0 or max_new_tokens < 1:
        raise ValueError("give a non-empty prompt and max_new_tokens >= 1.")
    block_size = drafter.cfg.trained_block_size
    size = next_pow2(len(prompt) + max_new_tokens + block_size)
    buffer_L = np.zeros(size, np.int32)
    buffer_L[: len(prompt)] = prompt
    target_graph, target_state = nnx.split(target)
    drafter_graph, drafter_state = nnx.split(drafter)
    first_logits, _ = _target_pass(target_graph, target_state, buffer_L)
    start = len(prompt)  # position of the anchor: the last committed token
    buffer_L[start] = int(np.argmax(first_logits[start - 1]))
    generated, accepted = [int(buffer_L[start])], []
    while len(generated) < max_new_tokens:
        drafts, posterior = _cycle(target_graph, target_state, drafter_graph, drafter_state, buffer_L, start)
        drafts, posterior = np.asarray(drafts), np.asarray(posterior)
        num_accepted = int(np.cumprod(drafts == posterior[:-1]).sum())
        new = [*drafts[:num_accepted].tolist(), int(posterior[num_accepted])]
        buffer_L[start + 1 : start + 1 + len(new)] = new
        start += len(new)
        generated += new
        accepted.append(len(new))
    return generated[:max_new_tokens], accepted


def mean_accepted_length(target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> float:
    """Tokens committed per draft+verify cycle (bonus included), over all cycles of all prompts."""
    lengths = [n for prompt in prompts for n in speculative_greedy(target, drafter, prompt, max_new_tokens)[1]]
    return float(np.mean(lengths))


@functools.partial(jax.jit, static_argnames=("target_graph",))
def _target_pass(target_graph, target_state, buffer_L):
    return target_logits_and_features(nnx.merge(target_graph, target_state), buffer_L, ())


@functools.partial(jax.jit, static_argnames=("target_graph", "drafter_graph"))
def _cycle(target_graph, target_state, drafter_graph, drafter_state, buffer_L, start):
    """Greedy drafts [B-1] (the selector's path for DFlash 2) for the block anchored at `start`, and the target's argmax [B] there."""
    target = nnx.merge(target_graph, target_state)
    drafter = nnx.merge(drafter_graph, drafter_state)
    _, features_LF = target_logits_and_features(target, buffer_L, drafter.cfg.target_layer_ids)
    anchors_A = jnp.reshape(start, (1,)).astype(jnp.int32)
    drafts_N = block_drafts(target, drafter, buffer_L, features_LF, anchors_A)[0]
    verify_L = jax.lax.dynamic_update_slice(buffer_L, drafts_N.astype(jnp.int32), (start + 1,))
    logits_LV, _ = target_logits_and_features(target, verify_L, ())
    block_size = drafter.cfg.trained_block_size
    posterior_B = jnp.argmax(jax.lax.dynamic_slice_in_dim(logits_LV, start, block_size), axis=-1)
    return drafts_N, posterior_B
