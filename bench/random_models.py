"""Random-weight models of `shapes.MODELS`, drawn on the device, and the bytes a decode step
streams through them: speed does not depend on the values, only on the shapes."""

from __future__ import annotations

import dataclasses
import functools
import gc

from bench.shapes import MODELS


def random_model(raw: dict, seed: int, dtype: str = "bfloat16"):
    """A Target or Drafter for the HF-style config dict `raw` with random `dtype` weights drawn
    on the default device: N(0, 0.02) matrices, ones for the 1-D (norm) weights.

    One small jitted draw per distinct shape: drawing the whole 8B model in one jit spends
    minutes compiling on the H200."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dflash_jax.config import parse_config
    from dflash_jax.models import abstract_model, model_from_params

    cfg = parse_config(raw)
    dtype = jnp.dtype(dtype)
    shapes = nnx.to_pure_dict(nnx.state(abstract_model(cfg, dtype)))

    @functools.lru_cache(maxsize=None)
    def draw(shape):
        if len(shape) == 1:
            return jax.jit(lambda key: jnp.ones(shape, dtype))
        return jax.jit(lambda key: (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype))

    leaves, treedef = jax.tree.flatten(shapes)
    root = jax.random.key(seed)
    params = [draw(tuple(leaf.shape))(jax.random.fold_in(root, i)) for i, leaf in enumerate(leaves)]
    return model_from_params(cfg, dtype, jax.tree.unflatten(treedef, jax.block_until_ready(params)))


def param_bytes(model, skip_embedding: bool = False) -> int:
    import jax
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    total = sum(x.nbytes for x in jax.tree.leaves(state))
    if skip_embedding and hasattr(model, "embed_tokens") and not model.cfg.tie_word_embeddings:
        total -= model.embed_tokens.embedding[...].nbytes  # a step reads B rows of it, not all
    return total


def expert_bytes(model) -> int:
    """The bytes of the model's routed experts, all of them (0 for a dense model)."""
    from flax import nnx

    from dflash_jax.experts import RoutedExperts

    return sum(getattr(module, name)[...].nbytes for _, module in nnx.iter_graph(model)
               if isinstance(module, RoutedExperts)
               for name in ("gate_up", "down", "gate_up_bias", "down_bias") if hasattr(module, name))


def kv_bytes_per_token(model, num_layers: int) -> int:
    cfg = model.cfg
    return 2 * num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize  # k and v


def recurrent_bytes_per_request(model) -> int:
    """A hybrid target's gated-delta-net state per request, read and written once a step
    (0 for other targets): each layer's convolution history and float32 delta-rule state."""
    la = model.cfg.linear_attention
    if la is None:
        return 0
    history = (la.conv_kernel_size - 1) * la.conv_dim * model.dtype.itemsize
    return 2 * len(la.layers) * (history + la.num_value_heads * la.key_head_dim * la.value_head_dim * 4)


@dataclasses.dataclass
class RandomPair:
    target: object
    drafter: object
    target_weight_bytes: int  # the target's weights but its embedding table (a step gathers rows of it)
    expert_bytes: int  # of which its routed experts' (0 for a dense target)
    drafter_bytes: int
    lm_head_bytes: int

    def target_stream_bytes(self, tokens: int = 1) -> int:
        """What a target pass over `tokens` tokens reads of the weights: all of them but the
        experts no token routes to (as many as uniform routing leaves on average)."""
        from dflash_jax.verify_block import experts_touched

        experts = self.target.cfg.experts
        if experts is None:
            return self.target_weight_bytes
        untouched = 1 - experts_touched(experts.num_experts, experts.top_k, tokens) / experts.num_experts
        return int(self.target_weight_bytes - self.expert_bytes * untouched)


def build_pair(model: str, dtype: str = "bfloat16", seed: int = 0, mesh=None, quantize: str | None = None,
               quantize_block: int | None = None) -> RandomPair:
    """The random target and drafter of MODELS[model], placed on `mesh` if one is given (one at
    a time: the first device holds a whole one-device model only while it is placed);
    `quantize` ("int8", "fp8") stores the target's decoder-layer weights in 8 bits, a scale
    per output column and block of `quantize_block` input rows (None: all of them)."""
    from dflash_jax.loading import lay_out_for_device
    from dflash_jax.models import quantize_model
    from dflash_jax.placement import shard_model
    from dflash_jax.quantization import WeightQuantization

    shapes = MODELS[model]
    target = random_model(shapes.target, seed, dtype)
    if quantize is not None:
        target = quantize_model(target, WeightQuantization(quantize, quantize_block))
        gc.collect()
    target = shard_model(target, mesh)
    lay_out_for_device(target)
    gc.collect()
    drafter = shard_model(random_model(shapes.drafter, seed + 1, dtype), mesh)
    gc.collect()
    cfg = target.cfg
    return RandomPair(target, drafter, param_bytes(target, skip_embedding=True), expert_bytes(target),
                      param_bytes(drafter), cfg.vocab_size * cfg.hidden_size * target.dtype.itemsize)
