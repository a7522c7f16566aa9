"""The steps section: the DFlash cycle's parts, each timed on the device in a jitted loop of
the runtime's own functions at the shapes the generate loop uses (bench.decode.speed's
docstring)."""

from __future__ import annotations

import functools
import gc

from bench.decode.points import PAGE_SIZE, pages_per_request
from bench.harness import after, time_calls
from pallas_kernels.common import next_pow2


def device_loop(graphs, states, part, carry, inputs, *, iters: int, reps: int, unroll: bool) -> tuple[float, float]:
    """Median seconds per call of `part(models, carry, inputs) -> (carry, outputs)` in one
    jitted loop of `iters` calls, and the first call's seconds (compile included).

    The carry (a KV cache) is donated and threaded through the calls; each call's inputs
    depend on the previous call's outputs (`harness.after`), so no call can be hoisted, merged
    or dropped. Models are merged inside the jit from
    (graphdefs, states): their weights are arguments, not constants.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax import lax

    def models_of(states):
        return tuple(nnx.merge(g, s) for g, s in zip(graphs, states))

    out_shape = jax.eval_shape(lambda s, c, i: part(models_of(s), c, i)[1], states, carry, inputs)

    @functools.partial(jax.jit, donate_argnums=1)
    def loop(states, carry, inputs):
        models = models_of(states)

        def body(_, state):  # a part without outputs (it only updates its carry) is chained by its carry
            carry, outputs = state
            return part(models, carry, after(inputs, outputs if jax.tree.leaves(outputs) else carry))

        init = (carry, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape))
        return lax.fori_loop(0, iters, body, init, unroll=unroll)

    donated = [carry]
    del carry

    def call():
        donated[0], outputs = loop(states, donated[0], inputs)
        return donated[0], outputs

    timing = time_calls(call, reps=reps, calls_per_sample=iters)
    donated.clear()
    return timing.median_s, timing.first_s


def section_steps(pair, batch: int, context: int, impl: str, opts, rng) -> dict:
    """The cycle's parts on caches filled to `context` positions (bench.decode.speed's docstring):
    {"ar_step": ..., "dflash": {block size: {part: ..., "cycle_parts_s": sum}}}."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dflash_jax import sampling
    from dflash_jax.kv_cache import DraftCacheGroups, PagedKVCache
    from dflash_jax.recurrent_state import RecurrentState
    from dflash_jax.steps import block_batch, draft_block, draft_layouts, target_step, write_context_kv

    target, drafter = pair.target, pair.drafter
    tcfg, dcfg = target.cfg, drafter.cfg
    kernels = opts.kernels_for(impl).resolve()
    width = pages_per_request(context, next_pow2(opts.n_tokens), max(*opts.block_sizes, dcfg.trained_block_size) - 1)
    table = 1 + jnp.arange(batch * width, dtype=jnp.int32).reshape(batch, width)
    num_pages = 1 + batch * width
    groups = DraftCacheGroups.for_drafter(dcfg)
    tables = (table,) * len(groups.layers)
    page_sizes = [PagedKVCache((), (), PAGE_SIZE)] * len(tables)  # draft_layouts reads only their page size
    graphs, states = zip(*(nnx.split(m) for m in (target, drafter)))
    zeros_R = jnp.zeros((batch,), jnp.int32)
    start_R = jnp.full((batch,), context, jnp.int32)  # the anchor sits right after the prompt
    sampling_R = (jnp.zeros((batch,), jnp.float32), zeros_R, jnp.ones((batch,), jnp.float32), zeros_R)
    key = jax.random.key(int(rng.integers(1 << 30)))
    big = dict(iters=opts.step_iters, reps=opts.step_reps, unroll=False)
    small = dict(iters=opts.small_iters, reps=opts.step_reps, unroll=True)

    def timed(part, carry, inputs, settings):
        per_call, first = device_loop(graphs, states, part, carry, inputs, **settings)
        gc.collect()
        return dict(s=per_call, first_run_s=first)

    def target_cache():
        return PagedKVCache.for_model(target, len(tcfg.kv_layers), num_pages, PAGE_SIZE, kernels)

    def draft_caches():
        return tuple(PagedKVCache.for_model(drafter, len(layers), num_pages, PAGE_SIZE, kernels)
                     for layers in groups.layers)

    recurrent = RecurrentState.zeros(tcfg, batch, target.dtype)  # a hybrid target's states (the rule runs once)

    def ar_step(models, cache, batch_):
        cache, logits, *_ = target_step(models[0], cache, batch_, (), kernels, recurrent)
        return cache, sampling.sample_target(logits, *sampling_R, start_R, greedy=True)

    tokens = jnp.asarray(rng.integers(0, tcfg.vocab_size - 1, (batch, max(opts.block_sizes))), jnp.int32)
    out = {"ar_step": timed(ar_step, target_cache(), block_batch(tokens[:, :1], start_R, table, PAGE_SIZE), big),
           "dflash": {}}
    for block in opts.block_sizes:
        num_drafts = block - 1
        # As `generate` by default: the drafter fills its trained block, the first block - 1 drafts are verified.
        shape = dict(draft_block_size=dcfg.trained_block_size, max_model_len=tcfg.max_position_embeddings)
        verify_batch = block_batch(tokens[:, :block], start_R, table, PAGE_SIZE)
        key, k1, k2, k3 = jax.random.split(key, 4)
        features = jax.random.normal(k1, (batch * block, len(dcfg.target_layer_ids) * tcfg.hidden_size),
                                     jnp.float32).astype(target.dtype)
        draft_logits = jax.random.normal(k2, (batch, num_drafts, tcfg.vocab_size), jnp.float32)
        draft_hidden = jax.random.normal(k2, (batch, num_drafts, dcfg.hidden_size), jnp.float32).astype(drafter.dtype)
        verify_logits = jax.random.normal(k3, (batch, block, tcfg.vocab_size), jnp.float32)
        drafts = sampling.sample_drafts(draft_logits, *sampling_R, start_R, greedy=True)
        layout_args = dict(num_rejected_R=jnp.full((batch,), num_drafts, jnp.int32),
                           num_sampled_R=jnp.ones_like(zeros_R), last_sampled_R=tokens[:, 0],
                           next_prefill_tokens_R=zeros_R, layout_impl=kernels.layout, **shape)
        layouts = draft_layouts(drafter, page_sizes, tables, verify_batch, **layout_args)

        def verify(models, cache, batch_):
            cache, logits, feats, _ = target_step(models[0], cache, batch_, dcfg.target_layer_ids, kernels, recurrent)
            return cache, (logits, feats)

        def layout(models, carry, batch_, layout_args=layout_args):
            return carry, draft_layouts(models[1], page_sizes, tables, batch_, **layout_args)

        def ctx_kv(models, caches, inputs):  # the features first: `harness.after` links the first leaf
            features_, layouts_ = inputs
            return write_context_kv(models[1], caches, layouts_, features_), ()

        def draft(models, caches, layouts_, num_drafts=num_drafts):
            caches, logits, _ = draft_block(models[0], models[1], caches, tables, layouts_, num_drafts=num_drafts,
                                            draft_block_size=dcfg.trained_block_size, kernels=kernels)
            return caches, logits

        def sample(models, carry, inputs):  # a DFlash 2 drafter's selector walks the block instead
            logits, hidden = inputs
            if models[1].cfg.dflash2 is not None:
                return carry, models[1].candidate_selector.walk(hidden, logits, tokens[:, 0])[0]
            return carry, sampling.sample_drafts(logits, *sampling_R, start_R, greedy=True)

        def accept(models, carry, inputs, num_drafts=num_drafts):
            logits, (draft_tokens, probs) = inputs
            return carry, sampling.rejection_sample(logits, draft_tokens, probs,
                                                    jnp.full((batch,), num_drafts, jnp.int32), *sampling_R, start_R,
                                                    greedy=True)

        parts = {
            "layout": timed(layout, (), verify_batch, small),
            "ctx_kv": timed(ctx_kv, draft_caches(), (features, layouts), small),
            "draft": timed(draft, draft_caches(), layouts, big),
            "sample": timed(sample, (), (draft_logits, draft_hidden), small),
            "verify": timed(verify, target_cache(), verify_batch, big),
            "accept": timed(accept, (), (verify_logits, drafts), small),
        }
        parts["cycle_parts_s"] = sum(part["s"] for part in parts.values())
        out["dflash"][str(block)] = parts
    return out
