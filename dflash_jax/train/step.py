"""The jitted train step: frozen target features, drafter loss, AdamW update, all in one program.

Master weights are float32 pure dicts (`nnx.to_pure_dict` layout, so orbax saves them as
plain trees); the forward merges a bf16 copy into a drafter built for bf16, so matmuls run in
bf16 and gradients flow back to the float32 masters through the cast. The target runs in the
same step under `stop_gradient`: its parameters are an input, never updated.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dflash_jax.models import model_from_params
from dflash_jax.config import DrafterConfig
from dflash_jax.sharding import DATA
from dflash_jax.train.anchors import sample_anchors
from dflash_jax.train.forward import block_outputs, target_logits_and_features
from dflash_jax.train.loss import (
    block_loss_terms, block_soft_labels, block_targets, default_gamma, selector_loss_terms, slot_weights,
)


@dataclasses.dataclass(frozen=True)
class Hyperparams:
    """Optimisation settings; defaults follow SpecForge's Qwen3-8B DFlash recipe (spec 7)."""

    total_steps: int
    learning_rate: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None  # None: default_gamma(block_size)
    max_anchors: int = 512
    soft_label_weight: float = 0.0  # 0: hard labels only; 1: the target's distribution only
    selector_weight: float = 1.0  # DFlash 2: the candidate selector's loss beside the drafter's
    frozen_backbone: bool = False  # DFlash 2: train its convolutions and selector only (`trains`)
    compute_dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.total_steps, bool) or not isinstance(self.total_steps, numbers.Integral) or self.total_steps < 1:
            raise ValueError(f"total_steps is {self.total_steps}; train for at least one step.")
        for name, value, low in (("learning_rate", self.learning_rate, "> 0"), ("grad_clip", self.grad_clip, "> 0"),
                                 ("weight_decay", self.weight_decay, ">= 0"), ("gamma", self.gamma, "> 0"),
                                 ("selector_weight", self.selector_weight, ">= 0")):
            if value is None and name == "gamma":
                continue
            if not (math.isfinite(value) and (value > 0 if low == "> 0" else value >= 0)):
                raise ValueError(f"{name} is {value}; it must be a finite number {low}.")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio {self.warmup_ratio} must lie in [0, 1).")
        if not 0 <= self.soft_label_weight <= 1:
            raise ValueError(f"soft_label_weight {self.soft_label_weight} must lie in [0, 1].")
        if self.max_anchors < 1:
            raise ValueError(f"max_anchors is {self.max_anchors}; use at least one anchor per sequence.")


def learning_rate_schedule(hp: Hyperparams) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then cosine decay to 0 at the last step."""
    warmup = int(round(hp.warmup_ratio * hp.total_steps))
    return optax.warmup_cosine_decay_schedule(
        0.0, hp.learning_rate, warmup_steps=warmup, decay_steps=max(hp.total_steps, warmup + 1)
    )


def decays(path, x) -> bool:
    """Whether AdamW decays a parameter: matrices do; norm weights and biases (1-D) do not, nor
    a DFlash 2 selector's codebooks, tables whose rows only tokens that occur update (decay
    would shrink every rare token's row at each step)."""
    return x.ndim >= 2 and "codebook" not in jax.tree_util.keystr(path)


DFLASH2_PARTS = ("attention_conv", "mlp_conv", "candidate_selector")  # what DFlash 2 adds to a DFlash-1 drafter


def trains(hp: Hyperparams, path) -> bool:
    """Whether training changes a parameter: all do, but with `frozen_backbone` only DFlash 2's
    convolutions and selector (the rest keeps the weights it came with, so the drafter is its
    DFlash-1 base plus those parts)."""
    return not hp.frozen_backbone or any(part in jax.tree_util.keystr(path) for part in DFLASH2_PARTS)


def make_optimizer(hp: Hyperparams) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW, decaying what `decays` says of the parameters it `trains`.
    The frozen ones get zero gradients (`step`), so their moments and updates stay zero and the
    optimizer's state has the same structure either way."""
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(lambda p, x: decays(p, x) and trains(hp, p), params)
    return optax.chain(
        optax.clip_by_global_norm(hp.grad_clip),
        optax.adamw(learning_rate_schedule(hp), weight_decay=hp.weight_decay, mask=decay_mask),
    )


def drafter_params(drafter) -> dict:
    """float32 master copy of a drafter's parameters as a pure dict (a copy: the step donates it)."""
    return jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), nnx.to_pure_dict(nnx.state(drafter, nnx.Param)))


def make_train_step(cfg: DrafterConfig, target_graph, hp: Hyperparams, mesh: Mesh | None = None):
    """A jitted `step(params, opt_state, target_state, token_ids [R, L], loss_mask [R, L], step)`
    returning (params, opt_state, metrics); params and optimizer state are donated.

    With a `mesh`, data-parallel over its "data" axis: each device takes R / data sequences;
    parameters, optimizer state and the target are whole on every device, and XLA sums the
    loss and gradients over the devices (the loss is one mean over the whole batch, so the
    update is the one-device update).

    metrics: loss, grad_norm, learning_rate, and per-slot accuracy [B-1] (slot k predicts
    x_{p+k}) with the number of counted predictions per slot. A DFlash 2 drafter's loss adds
    `selector_weight` x its candidate selector's (`loss.selector_loss_terms`), and its metrics
    add selector_loss and selector_accuracy [B-1] (teacher-forced, among the candidates).
    """
    optimizer = make_optimizer(hp)
    schedule = learning_rate_schedule(hp)
    compute_dtype = jnp.dtype(hp.compute_dtype)
    weights_N = slot_weights(cfg.trained_block_size, hp.gamma or default_gamma(cfg.trained_block_size))
    base_key = jax.random.key(hp.seed)

    def loss_fn(params, target_state, token_ids_RL, loss_mask_RL, key):
        target = nnx.merge(target_graph, target_state)
        drafter = model_from_params(cfg, compute_dtype, jax.tree.map(lambda x: x.astype(compute_dtype), params))

        def one_sequence(token_ids_L, loss_mask_L, seq_key):
            target_logits_LV, features_LF = target_logits_and_features(target, token_ids_L, cfg.target_layer_ids)
            anchors_A, valid_A = sample_anchors(seq_key, loss_mask_L, hp.max_anchors)
            logits_ANV, hidden_AND = block_outputs(target, drafter, token_ids_L, jax.lax.stop_gradient(features_LF),
                                                   anchors_A)
            labels_AN, counted_AN = block_targets(token_ids_L, loss_mask_L, anchors_A, valid_A, cfg.trained_block_size)
            soft_ANV = None
            if hp.soft_label_weight > 0:
                soft_ANV = jax.lax.stop_gradient(block_soft_labels(target_logits_LV, anchors_A, cfg.trained_block_size))
            terms = block_loss_terms(logits_ANV, labels_AN, counted_AN, weights_N, soft_ANV, hp.soft_label_weight)
            if cfg.dflash2 is None:
                return terms, terms  # no selector: its terms are unused
            return terms, selector_loss_terms(drafter.candidate_selector, hidden_AND, logits_ANV, labels_AN, counted_AN,
                                              token_ids_L[anchors_A], weights_N)

        keys = jax.random.split(key, token_ids_RL.shape[0])
        (ce, weight, correct_N, counted_N), selector = jax.vmap(one_sequence)(token_ids_RL, loss_mask_RL, keys)
        loss = jnp.sum(ce) / jnp.maximum(jnp.sum(weight), 1e-9)
        extra = {}
        if cfg.dflash2 is not None:
            extra["selector_loss"] = jnp.sum(selector[0]) / jnp.maximum(jnp.sum(selector[1]), 1e-9)
            extra["selector_accuracy"] = jnp.sum(selector[2], 0) / jnp.maximum(jnp.sum(selector[3], 0), 1.0)
            loss = loss + hp.selector_weight * extra["selector_loss"]
        return loss, (jnp.sum(correct_N, 0), jnp.sum(counted_N, 0), extra)

    def step(params, opt_state, target_state, token_ids_RL, loss_mask_RL, step_index):
        key = jax.random.fold_in(base_key, step_index)
        (loss, (correct_N, counted_N, extra)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, target_state, token_ids_RL, loss_mask_RL, key
        )
        if hp.frozen_backbone:
            grads = jax.tree_util.tree_map_with_path(lambda p, g: g if trains(hp, p) else jnp.zeros_like(g), grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics = dict(
            loss=loss,
            grad_norm=jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))),
            learning_rate=schedule(step_index),
            accuracy=correct_N / jnp.maximum(counted_N, 1.0),
            counted=counted_N,
            **extra,
        )
        return optax.apply_updates(params, updates), opt_state, metrics

    if mesh is None:
        return optimizer, jax.jit(step, donate_argnums=(0, 1))
    whole, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(DATA))
    return optimizer, jax.jit(step, donate_argnums=(0, 1), in_shardings=(whole, whole, whole, rows, rows, whole),
                              out_shardings=whole)
