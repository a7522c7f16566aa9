"""Decode speed at Qwen3-8B scale (issue 6): AR step, DFlash cycle and parts, anchors.

The autoregressive step and the DFlash cycle, the cycle's parts, achieved bandwidth, PyTorch
anchors and projected tokens/s, measured in one process.

    python bench/bench_decode.py --quick --torch-anchors --profile --attention-impl reference,pallas \
        --commit HASH --out $OUT/decode.json   # issue 6's target points (no .git on the device)
    python bench/bench_decode.py --points 8x1k,1x8k,128x1k --attention-impl pallas --out $OUT/more.json
    python bench/bench_decode.py --points 32x1k --block-sizes 16,8,4 --sections generate,steps --out ...
    python bench/bench_decode.py --small --torch-anchors --profile --out /tmp/decode.json  # CPU smoke test
    python bench/bench_decode.py --model smollm2-135m --dtype float32 --points 1x1k --sections generate ...
    python bench/bench_decode.py --model qwen3-32b --tensor-parallel 4 --points 1x1k,32x1k \
        --sections generate,engine --out ...   # one model over 4 devices (bench/tp_plan.sh)

Models: a Qwen3-8B-shaped target (36 layers, hidden 4096, 32 / 8 heads, head_dim 128,
intermediate 12288, vocab 151936) and a Qwen3-8B-DFlash-b16-shaped drafter (5 layers, block
16, target layers [1, 9, 17, 25, 33], mask 151669); with `--model qwen3-32b`, Qwen3-32B's
shape (64 layers, hidden 5120, 64 / 8 heads, intermediate 25600) and a drafter of the same
form at its sizes (5 layers, target layers [1, 16, 31, 46, 61]); or, with `--model
smollm2-135m`, SmolLM2-135M's shape and the shipped drafter's (the launch-bound end). Random
weights (bf16, or `--dtype float32`) are drawn on the device, one small jit per shape.

--tensor-parallel N: the models run over a ("data", "model") mesh of the first N devices
(`sharding.make_mesh(N, 1)`). They are drawn on the first device, then placed
(`placement.shard_model`, which copies them through the host once: for the 32B shape ~65 GB
of host memory and more for the reordered fused matrices); the sections' calls follow the
mesh the models carry. The copy bandwidth is the first device's; floors use N times it.
The steps section works on the mesh too; the PyTorch anchors and --profile are one-device
measures and are refused.

A point is (batch B, context C): B prompts of C random tokens. Sections, in this order, each
over every point and attention implementation (skipped, with the reason, once --budget-s
runs out or if the point cannot fit in device memory; an error is recorded and the run goes
on):

generate  `generate_autoregressive` and `generate` (per --block-sizes, default 16) end to
          end. Each runs for m and for n new tokens (m = n / 2 + 1: the same power-of-two
          capacity, so one compiled program), after a warm-up run that compiles it. Per AR
          step or DFlash cycle = (median time of the n runs - median of the m runs) / (loop
          iterations of an n run - of an m run): prefill, compilation and transfers cancel.
          The steps measured sit at context C + m .. C + n. Skipped when the jnp reference
          attention would make the prefill too slow (B x C^2 > --generate-limit: it gathers
          every query's keys). Records programs compiled during the timed runs (want 0).
steps     The cycle's parts, each a jitted loop of the runtime's own functions at the shapes
          the generate loop uses (the drafter fills its trained block, as generate's default),
          on caches filled to C positions (zeros: attention work
          follows lengths, not values), k calls per run (device time: host dispatch out of
          it; the carried cache or an optimisation barrier keeps calls in sequence):
          ar_step = `target_step` on B x 1 tokens + `sample_target`; layout = `draft_layouts`;
          ctx_kv = `write_context_kv`; draft = `draft_block`; sample = `sample_drafts`;
          verify = `target_step` on B x block tokens; accept = `rejection_sample`. All greedy.
engine    The Engine without a drafter: B requests, prefill, then the median wall time of one
          `Engine.step()` over --engine-steps decode steps (host scheduling and the per-step
          device round trip included: that is how the Engine runs), with asynchronous
          scheduling (the default: the host's work overlaps the device's) and without (sync);
          then the Engine with the drafter (its block size; asynchronous), whose step is a
          DFlash cycle. Same prefill limit.

Also: `copy`, the device copy bandwidth (the faster of x + 1 and jnp.copy over a large bf16
array; read + write counted, as ENVIRONMENT.md's 4.24 TB/s); `bandwidth`, AR step bytes (target weights streamed:
every parameter but the embedding table, plus the K/V read, B x C x layers x 2 x kv heads x
head_dim x 2 bytes) over the AR step time, and its share of the copy bandwidth; the
`floor` of a step, those bytes over the copy bandwidth (for the cycle: target, drafter and
the LM head a second time for the draft logits, plus both K/V reads); --profile: device
events, busy time and host syncs per loop iteration from two jax.profiler traces.

--torch-anchors (batch 1): the same weights, written with convert.export_hf, in a torch
subprocess (torch and jax CUDA libraries never share a process): transformers' static-cache
`generate` (torch.compile'd automatically on a GPU) per token by the same n - m method, and
z-lab's `dflash_generate` per cycle (its own decode timer over its cycles), both reported as
ratios to ours.

Projections: tokens/s = tau / DFlash cycle time at tau = 6.55 (GSM8K) and 3.16 (Alpaca), the
published Qwen3-8B-DFlash-b16 acceptance lengths. These are PROJECTIONS, not measurements:
random weights accept almost nothing, and the cycle's cost is taken not to depend on it.

Output: a markdown report on stdout and next to --out (.md), JSON at --out (date, commit,
device, versions, every number); both rewritten after every section, so a run cut short
keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)
from pallas_kernels.common import next_pow2  # noqa: E402  (after the path)

TAUS = {"gsm8k": 6.55, "alpaca": 3.16}  # published mean acceptance, Qwen3-8B-DFlash-b16, greedy
PAGE_SIZE = 16
TARGET_8B = dict(
    architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False,
)
DRAFTER_8B = dict(
    architectures=["DFlashDraftModel"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
    num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    rope_theta=1e6, max_position_embeddings=40960, num_target_layers=36,
    dflash_config=dict(mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33], block_size=16),
)
# --small: the same structure, tiny (a CPU smoke test).
TARGET_SMALL = dict(TARGET_8B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
DRAFTER_SMALL = dict(DRAFTER_8B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                     num_target_layers=4, dflash_config=dict(mask_token_id=1023, target_layer_ids=[1, 2],
                                                             block_size=16))
# --model smollm2-135m: SmolLM2-135M-Instruct's shape (Llama, tied head) with a drafter shaped
# like the shipped one (dflash_jax/assets/smollm2-135m-drafter): the launch-bound end.
TARGET_SMOLLM2 = dict(
    architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
    rope_theta=1e5, max_position_embeddings=8192, tie_word_embeddings=True,
)
DRAFTER_SMOLLM2 = dict(DRAFTER_8B, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=5,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                       max_position_embeddings=8192, num_target_layers=30,
                       dflash_config=dict(mask_token_id=16, target_layer_ids=[1, 8, 14, 20, 27], block_size=16))
# --model qwen3-32b: Qwen3-32B's shape, with a drafter of the 8B drafter's form at its sizes
# (target layers spread from 1 to 61 as the 8B's from 1 to 33: config.default_target_layer_ids).
TARGET_32B = dict(TARGET_8B, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64)
DRAFTER_32B = dict(DRAFTER_8B, hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_target_layers=64,
                   dflash_config=dict(mask_token_id=151669, target_layer_ids=[1, 16, 31, 46, 61], block_size=16))
MODELS = {"qwen3-8b": ("Qwen3-8B shape", TARGET_8B, DRAFTER_8B),
          "qwen3-32b": ("Qwen3-32B shape", TARGET_32B, DRAFTER_32B),
          "smollm2-135m": ("SmolLM2-135M shape", TARGET_SMOLLM2, DRAFTER_SMOLLM2),
          "small": ("small CPU shapes", TARGET_SMALL, DRAFTER_SMALL)}
# Issue 6's order of importance: its targets are at 1x1k and 32x1k.
POINTS_FULL = "1x1k,32x1k,8x1k,1x8k,128x1k,8x8k,32x8k,128x8k"  # 128x8k: K/V alone ~180 GB
POINTS_QUICK = "1x1k,32x1k"
POINTS_SMALL = "1x128,2x256"
SECTIONS = ("generate", "steps", "engine")


# ---- small helpers ------------------------------------------------------------------------

def parse_points(text):
    """"1x1k,32x8k" -> [(1, 1024), (32, 8192)]."""
    points = []
    for item in text.split(","):
        batch, context = item.strip().lower().split("x")
        scale = 1024 if context.endswith("k") else 1
        points.append((int(batch), int(context.rstrip("k")) * scale))
    return points


def label(batch, context):
    return f"{batch}x{context // 1024}k" if context % 1024 == 0 else f"{batch}x{context}"


def ms(seconds):
    return None if seconds is None else 1e3 * seconds


def commit_of(repo):
    try:
        out = subprocess.run(["git", "-C", repo, "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions():
    import jax

    out = {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
           "device": str(jax.devices()[0].device_kind), "num_devices": jax.device_count()}
    for name in ("jaxlib", "flax", "triton"):
        try:
            out[name] = __import__(name).__version__
        except Exception as error:  # report, don't fail
            out[name] = f"unavailable ({type(error).__name__})"
    return out


def guarded(fn, *args):
    """fn(*args), or {"error": ...} with the traceback printed: one failure never ends the run."""
    try:
        return fn(*args)
    except Exception as error:
        traceback.print_exc()
        return dict(error=f"{type(error).__name__}: {error}")


def in_temp_dir(prefix, fn):
    """guarded fn(folder) in a fresh temporary folder, removed afterwards."""
    folder = tempfile.mkdtemp(prefix=prefix)
    try:
        return guarded(fn, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Budget:
    """Wall-clock budget for the whole run: sections start only while time is left."""

    def __init__(self, seconds):
        self.start, self.seconds = time.perf_counter(), seconds

    @property
    def elapsed(self):
        return time.perf_counter() - self.start

    def left(self):
        return self.seconds - self.elapsed


# ---- models -------------------------------------------------------------------------------

def random_model(raw, seed, dtype="bfloat16"):
    """A Target or Drafter for the HF-style config dict `raw` with random `dtype` weights drawn
    on the default device: N(0, 0.02) matrices, ones for the 1-D (norm) weights.

    One small jitted draw per distinct shape: drawing the whole 8B model in one jit spent
    ~165 s compiling on the H200."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dflash_jax.models import abstract_model, model_from_params
    from dflash_jax.config import parse_config

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


def param_bytes(model, skip_embedding=False):
    import jax
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    total = sum(x.nbytes for x in jax.tree.leaves(state))
    if skip_embedding and hasattr(model, "embed_tokens") and not model.cfg.tie_word_embeddings:
        total -= model.embed_tokens.embedding[...].nbytes  # a step reads B rows of it, not all
    return total


def kv_bytes_per_token(model, num_layers):
    cfg = model.cfg
    return 2 * num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize  # k and v


@dataclasses.dataclass
class Pair:
    target: object
    drafter: object
    target_stream_bytes: int  # what a target step reads of the weights
    drafter_bytes: int
    lm_head_bytes: int


def build_pair(model, dtype="bfloat16", seed=0, mesh=None):
    """The random target and drafter of MODELS[model], placed on `mesh` if one is given (one at
    a time: the first device holds a whole one-device model only while it is placed)."""
    from dflash_jax.placement import shard_model

    _, target_config, drafter_config = MODELS[model]
    target = shard_model(random_model(target_config, seed, dtype), mesh)
    gc.collect()
    drafter = shard_model(random_model(drafter_config, seed + 1, dtype), mesh)
    gc.collect()
    cfg = target.cfg
    return Pair(target, drafter, param_bytes(target, skip_embedding=True), param_bytes(drafter),
                cfg.vocab_size * cfg.hidden_size * target.dtype.itemsize)


def prompts_for(rng, vocab, batch, context):
    return [rng.integers(0, vocab - 1, context).tolist() for _ in range(batch)]


def pages_per_request(context, capacity, num_drafts):
    """As `generate` sizes them: prompt bucket + capacity + one draft block past the end."""
    return -(-(next_pow2(context) + capacity + num_drafts + 1) // PAGE_SIZE)


def memory_needed(pair, batch, context, capacity, block):
    """Bytes a point needs at most on each device: weights, one target + drafter KV cache set,
    and room for the verify logits and a prefill's activations (a rough upper bound), split
    evenly over the devices of the models' mesh."""
    from dflash_jax.sharding import tensor_parallel_size

    t, d = pair.target.cfg, pair.drafter.cfg
    num_drafts = block - 1
    slots = batch * pages_per_request(context, capacity, num_drafts) * PAGE_SIZE
    kv = slots * (kv_bytes_per_token(pair.target, t.num_layers) + kv_bytes_per_token(pair.drafter, d.num_layers))
    weights = pair.target_stream_bytes + pair.lm_head_bytes + pair.drafter_bytes
    logits = 3 * batch * (num_drafts + 1) * t.vocab_size * 4
    prefill = next_pow2(batch * context) * (3 * t.intermediate_size + 4 * t.hidden_size) * pair.target.dtype.itemsize
    return (weights + kv + logits + prefill) / tensor_parallel_size(pair.target.mesh)


def device_memory_limit():
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # CPU backends may not report
        stats = {}
    return stats.get("bytes_limit")


# ---- timing primitives ----------------------------------------------------------------------

def copy_bandwidth(num_bytes, reps=10):
    """Device copy rates, bytes/s, read + write counted, over a bf16 array: {"x+1": a jitted
    elementwise add (donated), "copy": a jitted jnp.copy (a device-to-device copy)}.
    On the H200 the add read 3.24-3.29 TB/s, below ENVIRONMENT.md's 4.24: both are kept and
    the larger one is the floors' copy rate."""
    import jax
    import jax.numpy as jnp

    rates = {}
    for name, fn, donate in (("x+1", lambda x: x + jnp.ones((), x.dtype), (0,)), ("copy", jnp.copy, ())):
        step = jax.jit(fn, donate_argnums=donate)
        x = jnp.zeros((num_bytes // 2,), jnp.bfloat16)
        for _ in range(20):  # compile, and let the clocks ramp up
            y = step(x)
            x = y if donate else x
        jax.block_until_ready(y)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(5):
                y = step(x)
                x = y if donate else x
            jax.block_until_ready(y)
            samples.append((time.perf_counter() - t0) / 5)
        del x, y
        rates[name] = 2 * (num_bytes // 2) * 2 / statistics.median(samples)
    return rates


def device_loop(graphs, states, part, carry, inputs, *, iters, reps, unroll):
    """Median seconds per call of `part(models, carry, inputs) -> (carry, outputs)` in one
    jitted loop of `iters` calls, and the first call's seconds (compile included).

    The carry (a KV cache) is donated and threaded through the calls; each call's inputs pass
    an optimisation barrier together with the previous call's outputs, so no call can be
    hoisted, merged or dropped, and outputs stay live. Models are merged inside the jit from
    (graphdefs, states): their weights are arguments, not constants.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax
    from flax import nnx

    def models_of(states):
        return tuple(nnx.merge(g, s) for g, s in zip(graphs, states))

    out_shape = jax.eval_shape(lambda s, c, i: part(models_of(s), c, i)[1], states, carry, inputs)

    @functools.partial(jax.jit, donate_argnums=1)
    def loop(states, carry, inputs):
        models = models_of(states)

        def body(_, state):
            carry, outputs = state
            inputs_i = lax.optimization_barrier((inputs, outputs))[0]
            return part(models, carry, inputs_i)

        init = (carry, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape))
        return lax.fori_loop(0, iters, body, init, unroll=unroll)

    t0 = time.perf_counter()
    carry, _ = jax.block_until_ready(loop(states, carry, inputs))
    first = time.perf_counter() - t0
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        carry, _ = jax.block_until_ready(loop(states, carry, inputs))
        samples.append((time.perf_counter() - t0) / iters)
    del carry
    return statistics.median(samples), first


def time_generate(run, n_long, reps, point_budget_s):
    """Per-iteration seconds of a generate loop by the n - m method (module docstring), and
    how many programs were compiled during the timed runs (0: no recompilation)."""
    import importlib

    program = importlib.import_module("dflash_jax.generate")._program  # the package exports generate()
    compiled = getattr(program, "_cache_size", lambda: -1)
    n_short = n_long // 2 + 1
    t0 = time.perf_counter()
    run(n_short)  # compiles
    first = time.perf_counter() - t0
    programs = compiled()
    probe = run(n_short)
    reps = max(1, min(reps, int(point_budget_s / max(2.2 * probe.elapsed_s, 1e-9))))
    shorts, longs = [probe], []
    for i in range(reps):
        longs.append(run(n_long))
        if i:
            shorts.append(run(n_short))
    iterations = [max(len(a) for a in r.accepted_lengths) for r in (shorts[0], longs[0])]
    delta_iter = iterations[1] - iterations[0]
    t_short = statistics.median(r.elapsed_s for r in shorts)
    t_long = statistics.median(r.elapsed_s for r in longs)
    per_iter = (t_long - t_short) / delta_iter if delta_iter > 0 else None
    tokens = longs[0].num_tokens / len(longs[0].token_ids)
    return dict(
        per_iter_s=per_iter, first_run_s=first, reps=reps, n_tokens=[n_short, n_long], iterations=iterations,
        t_short_s=t_short, t_long_s=t_long, spread_s=[min(r.elapsed_s for r in longs), max(r.elapsed_s for r in longs)],
        prefill_and_rest_s=None if per_iter is None else t_short - iterations[0] * per_iter,
        mean_accepted=longs[0].mean_accepted_length, tokens_per_request=tokens,
        new_compiles_in_timed_runs=compiled() - programs,
        warning=None if delta_iter >= 8 else f"only {delta_iter} loop iterations apart: noisy",
    )


# ---- sections ---------------------------------------------------------------------------------

def section_generate(pair, prompts, impl, opts):
    from dflash_jax.generate import generate, generate_autoregressive

    out = {"ar": time_generate(
        lambda n: generate_autoregressive(pair.target, prompts, max_new_tokens=n, kernels=opts.kernels_for(impl)),
        opts.n_tokens, opts.reps, opts.point_budget_s), "dflash": {}}
    for block in opts.block_sizes:
        out["dflash"][str(block)] = time_generate(
            lambda n: generate(pair.target, pair.drafter, prompts, max_new_tokens=n, block_size=block,
                               kernels=opts.kernels_for(impl)),
            opts.n_tokens, opts.reps, opts.point_budget_s)
    return out


def section_engine(pair, prompts, impl, opts):
    """The Engine's decode step with asynchronous scheduling (its default) and without, and
    its DFlash step (the drafter's block) with asynchronous scheduling."""
    result = time_engine(pair, prompts, impl, opts, async_scheduling=True)
    result["sync"] = time_engine(pair, prompts, impl, opts, async_scheduling=False)
    result["dflash"] = time_engine(pair, prompts, impl, opts, async_scheduling=True, drafter=pair.drafter)
    return result


def time_engine(pair, prompts, impl, opts, async_scheduling, drafter=None):
    from dflash_jax.engine import Engine, SamplingParams

    batch, context = len(prompts), len(prompts[0])
    steps, warm = opts.engine_steps, 2
    budget = max(next_pow2(batch), min(next_pow2(batch * context), 8192))
    # Requests whose prefill ends early decode during the later prefill steps: room for those
    # extra tokens, so that no request finishes (shrinking the batch into a new bucket, which
    # would compile) inside the timed steps. Random drafts are rarely accepted: twice that
    # many tokens leave a DFlash step room for a few.
    max_new = (steps + warm + 2 + -(-batch * context // budget)) * (1 if drafter is None else 2)
    engine = Engine(pair.target, drafter, max_num_reqs=next_pow2(batch), max_num_tokens=budget,
                    max_model_len=context + max_new + 2 * PAGE_SIZE, kernels=opts.kernels_for(impl),
                    async_scheduling=async_scheduling)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=max_new)) for p in prompts]
    t0 = time.perf_counter()
    prefill_steps = 0
    while any(not engine.output(i) for i in ids):
        engine.step()
        prefill_steps += 1
    prefill = time.perf_counter() - t0
    for _ in range(warm):  # the first decode step compiles its bucket
        engine.step()
    traces = Engine.num_traces()
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        samples.append(time.perf_counter() - t0)
    del engine
    gc.collect()
    return dict(step_s=statistics.median(samples), spread_s=[min(samples), max(samples)], steps=steps,
                prefill_s=prefill, prefill_steps=prefill_steps, new_traces_in_timed_steps=Engine.num_traces() - traces)


def section_steps(pair, batch, context, impl, opts, rng):
    """The cycle's parts on caches filled to `context` positions (see the module docstring):
    {"ar_step": ..., "dflash": {block size: {part: ..., "cycle_parts_s": sum}}}."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dflash_jax import sampling
    from dflash_jax.kv_cache import DraftCacheGroups, PagedKVCache
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
        return PagedKVCache.for_model(target, tcfg.num_layers, num_pages, PAGE_SIZE)

    def draft_caches():
        return tuple(PagedKVCache.for_model(drafter, len(layers), num_pages, PAGE_SIZE) for layers in groups.layers)

    def ar_step(models, cache, batch_):
        cache, logits, _ = target_step(models[0], cache, batch_, (), kernels)
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
        verify_logits = jax.random.normal(k3, (batch, block, tcfg.vocab_size), jnp.float32)
        drafts = sampling.sample_drafts(draft_logits, *sampling_R, start_R, greedy=True)
        layout_args = dict(num_rejected_R=jnp.full((batch,), num_drafts, jnp.int32),
                           num_sampled_R=jnp.ones_like(zeros_R), last_sampled_R=tokens[:, 0],
                           next_prefill_tokens_R=zeros_R, layout_impl=kernels.layout, **shape)
        layouts = draft_layouts(drafter, page_sizes, tables, verify_batch, **layout_args)

        def verify(models, cache, batch_):
            cache, logits, feats = target_step(models[0], cache, batch_, dcfg.target_layer_ids, kernels)
            return cache, (logits, feats)

        def layout(models, carry, batch_, layout_args=layout_args):
            return carry, draft_layouts(models[1], page_sizes, tables, batch_, **layout_args)

        def ctx_kv(models, caches, inputs):
            return write_context_kv(models[1], caches, *inputs), ()

        def draft(models, caches, layouts_, num_drafts=num_drafts):
            return draft_block(models[0], models[1], caches, tables, layouts_, num_drafts=num_drafts,
                               draft_block_size=dcfg.trained_block_size, kernels=kernels)

        def sample(models, carry, logits):
            return carry, sampling.sample_drafts(logits, *sampling_R, start_R, greedy=True)

        def accept(models, carry, inputs, num_drafts=num_drafts):
            logits, (draft_tokens, probs) = inputs
            return carry, sampling.rejection_sample(logits, draft_tokens, probs,
                                                    jnp.full((batch,), num_drafts, jnp.int32), *sampling_R, start_R,
                                                    greedy=True)

        parts = {
            "layout": timed(layout, (), verify_batch, small),
            "ctx_kv": timed(ctx_kv, draft_caches(), (layouts, features), small),
            "draft": timed(draft, draft_caches(), layouts, big),
            "sample": timed(sample, (), draft_logits, small),
            "verify": timed(verify, target_cache(), verify_batch, big),
            "accept": timed(accept, (), (verify_logits, drafts), small),
        }
        parts["cycle_parts_s"] = sum(part["s"] for part in parts.values())
        out["dflash"][str(block)] = parts
    return out


# ---- profile ------------------------------------------------------------------------------------

def profile_generate(pair, prompts, impl, opts, log_dir):
    """Device events per DFlash cycle and per AR step from two jax.profiler traces (an m-run
    and an n-run of the compiled program): (events(n) - events(m)) / (iterations apart), in
    all and per op (calls and busy us, the 25 busiest), so prefill and compile-time work cancel."""
    import jax

    from dflash_jax.generate import generate, generate_autoregressive

    runs = {
        "ar": lambda n: generate_autoregressive(pair.target, prompts, max_new_tokens=n, kernels=opts.kernels_for(impl)),
        "dflash": lambda n: generate(pair.target, pair.drafter, prompts, max_new_tokens=n,
                                     block_size=max(opts.block_sizes), kernels=opts.kernels_for(impl)),
    }
    out = {}
    for name, run in runs.items():
        n_long = opts.n_tokens
        n_short = n_long // 2 + 1
        run(n_short)  # compiled outside the traces
        counts = []
        for n in (n_short, n_long):
            folder = os.path.join(log_dir, f"{name}-{n}")
            with jax.profiler.trace(folder, create_perfetto_trace=True):
                result = run(n)
            iterations = max(len(a) for a in result.accepted_lengths)
            counts.append((iterations, count_trace_events(folder)))
        (i0, c0), (i1, c1) = counts
        per = {k: (c1[k] - c0[k]) / max(i1 - i0, 1) for k in ("device_events", "busy_us", "memcpy", "memcpy_dtoh")}
        apart = max(i1 - i0, 1)
        ops = {op: ((calls - c0["ops"].get(op, (0, 0.0))[0]) / apart, (us - c0["ops"].get(op, (0, 0.0))[1]) / apart)
               for op, (calls, us) in c1["ops"].items()}
        top = sorted(ops.items(), key=lambda item: -item[1][1])[:25]
        out[name] = dict(per_iteration=per, iterations=[i0, i1], events_per_line_long_run=c1["lines"],
                         ops_per_iteration=[(op, round(calls, 2), round(us, 1)) for op, (calls, us) in top],
                         op_details={op: c1["details"].get(op, "") for op, _ in top})
    return out


def count_trace_events(folder):
    """Device-side event counts in the perfetto trace under `folder`: kernels on the GPU's
    stream lines (derived lines such as "XLA Ops" repeat them and are left out), memcpys
    (device to host ones are host syncs), events per line, and calls and busy time per op name."""
    import glob
    import gzip
    from collections import Counter

    paths = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        return dict(device_events=0, busy_us=0.0, memcpy=0, memcpy_dtoh=0, lines={}, ops={}, details={})
    with gzip.open(sorted(paths)[-1], "rt") as f:
        trace = json.load(f)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    meta = [e for e in events if e.get("ph") == "M"]
    device_pids = {e["pid"] for e in meta if e.get("name") == "process_name"
                   and "GPU" in str(e.get("args", {}).get("name", ""))}
    threads = {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", "")) for e in meta
               if e.get("name") == "thread_name" and e.get("pid") in device_pids}
    spans = [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids]
    lines = Counter(threads.get((e["pid"], e.get("tid")), "?") for e in spans)
    streams = {key for key, name in threads.items() if "stream" in name.lower()}
    device = [e for e in spans if not streams or (e["pid"], e.get("tid")) in streams]
    memcpy = [e for e in device if "memcpy" in e.get("name", "").lower()]
    dtoh = [e for e in memcpy if any(s in e["name"].lower() for s in ("dtoh", "d2h", "devicetohost"))]
    busy, calls = Counter(), Counter()
    for e in device:
        busy[e.get("name", "?")[:60]] += float(e.get("dur", 0))
        calls[e.get("name", "?")[:60]] += 1
    details = {}  # per op, the longest args any line gives it (HLO text, kernel launch shape)
    for e in spans:
        name, args = e.get("name", "?")[:60], json.dumps(e.get("args", {}), default=str)[:600]
        if name in busy and len(args) > len(details.get(name, "")):
            details[name] = args
    return dict(device_events=len(device), busy_us=sum(busy.values()), memcpy=len(memcpy), memcpy_dtoh=len(dtoh),
                lines=dict(lines), ops={name: (calls[name], us) for name, us in busy.items()}, details=details)


# ---- PyTorch anchors ----------------------------------------------------------------------------

def run_torch_anchors(pair, contexts, opts, workdir):
    """Export the pair with convert.export_hf, then time the anchors in a torch subprocess."""
    from convert.export_hf import export_hf

    t0 = time.perf_counter()
    export_hf(pair.target, os.path.join(workdir, "target"), max_shard_bytes=4 << 30)
    export_hf(pair.drafter, os.path.join(workdir, "drafter"))
    export_s = time.perf_counter() - t0
    spec = dict(target_dir=os.path.join(workdir, "target"), drafter_dir=os.path.join(workdir, "drafter"),
                contexts=contexts, n_tokens=opts.n_tokens, reps=opts.reps, out=os.path.join(workdir, "anchors.json"))
    with open(os.path.join(workdir, "spec.json"), "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-worker",
                               os.path.join(workdir, "spec.json")], env=env, timeout=opts.anchor_timeout_s,
                              capture_output=True, text=True)
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as error:
        tail = f"timed out after {opts.anchor_timeout_s} s: {str(error.stdout)[-1500:]}"
    result = {"export_s": export_s}
    if os.path.exists(spec["out"]):
        with open(spec["out"]) as f:
            result.update(json.load(f))
    else:
        result["error"] = "the torch worker wrote no result:\n" + tail
    result["worker_log_tail"] = tail[-1500:]
    return result


def torch_worker(spec_path):
    """Runs in its own process: transformers and z-lab timings on the exported weights."""
    with open(spec_path) as f:
        spec = json.load(f)
    import numpy as np
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"

    def sync_time():
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
           "gpu": torch.cuda.get_device_name() if cuda else None, "contexts": {}}
    t0 = time.perf_counter()
    target = transformers.AutoModelForCausalLM.from_pretrained(
        spec["target_dir"], dtype=torch.bfloat16, attn_implementation="sdpa").to(device).eval()
    out["load_s"] = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    n_long = spec["n_tokens"]
    n_short = n_long // 2 + 1
    try:
        from dflash.model import DFlashDraftModel
        import dflash.model as zmodel

        drafter = DFlashDraftModel.from_pretrained(spec["drafter_dir"], dtype=torch.bfloat16,
                                                   attn_implementation="sdpa").to(device).eval()
        if not cuda:
            zmodel._cuda_time = time.perf_counter  # its stats timer calls torch.cuda.synchronize
    except Exception as error:  # the wheel may be missing or broken: say so, skip that anchor
        drafter = None
        out["zlab_error"] = f"z-lab dflash not usable ({type(error).__name__}: {error}); anchor skipped"
        print(out["zlab_error"], flush=True)

    for context in spec["contexts"]:
        ids = torch.tensor(rng.integers(0, target.config.vocab_size - 1, (1, context)), device=device)
        row = out["contexts"][str(context)] = {}
        try:
            def hf_run(n):
                t = sync_time()
                with torch.inference_mode():
                    target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                    do_sample=False, cache_implementation="static", pad_token_id=0)
                return sync_time() - t

            t = time.perf_counter()
            hf_run(n_long)  # compiles (on a GPU); the static cache is sized for n_long
            hf_run(n_short)  # in case a shorter cache recompiles
            warm = time.perf_counter() - t
            longs, shorts = [], []
            for _ in range(spec["reps"]):
                longs.append(hf_run(n_long))
                shorts.append(hf_run(n_short))
            per_token = (statistics.median(longs) - statistics.median(shorts)) / (n_long - n_short)
            row["transformers"] = dict(per_token_s=per_token, compiled=cuda, warmup_s=warm,
                                       t_long_s=statistics.median(longs), t_short_s=statistics.median(shorts))
            print(f"transformers ctx {context}: {1e3 * per_token:.2f} ms/token", flush=True)
        except Exception as error:
            row["transformers"] = dict(error=f"{type(error).__name__}: {error}")
            traceback.print_exc()
        if drafter is None:
            continue
        try:
            def zlab_run(n):
                stats = zmodel.dflash_generate(drafter, target, ids, max_new_tokens=n, stop_token_ids=None,
                                               block_size=16, return_stats=True)
                decode = stats.time_per_output_token * stats.num_output_tokens
                return decode / len(stats.acceptance_lengths), stats

            zlab_run(8)  # warm-up
            runs = [zlab_run(n_long) for _ in range(max(1, min(2, spec["reps"])))]
            cycle = statistics.median(r[0] for r in runs)
            lengths = runs[0][1].acceptance_lengths
            row["zlab"] = dict(cycle_s=cycle, cycles=len(lengths), mean_accepted=float(np.mean(lengths)))
            print(f"z-lab ctx {context}: {1e3 * cycle:.2f} ms/cycle", flush=True)
        except Exception as error:
            row["zlab"] = dict(error=f"{type(error).__name__}: {error}")
            traceback.print_exc()
    with open(spec["out"], "w") as f:
        json.dump(out, f, indent=1)


# ---- report -------------------------------------------------------------------------------------

def derived(result, copy_Bps):
    """Per point: AR step, DFlash cycle per block size, bandwidth and projections; `copy_Bps`
    is the copy rate of every device the models span together."""
    gen, eng, steps = result.get("generate") or {}, result.get("engine") or {}, result.get("steps") or {}
    ar_gen = (gen.get("ar") or {}).get("per_iter_s")
    ar_step = (steps.get("ar_step") or {}).get("s")
    ar = ar_gen or ar_step
    out = dict(ar_s=ar, ar_source="generate" if ar_gen else "steps" if ar_step else None, engine_s=eng.get("step_s"),
               engine_sync_s=(eng.get("sync") or {}).get("step_s"),
               engine_dflash_s=(eng.get("dflash") or {}).get("step_s"),
               ar_bytes=result["ar_bytes"], cycle_bytes=result["cycle_bytes"], blocks={})
    if copy_Bps:
        out["ar_floor_s"] = result["ar_bytes"] / copy_Bps
        out["cycle_floor_s"] = result["cycle_bytes"] / copy_Bps
    for name, seconds in (("ar", ar), ("ar_step", ar_step)):
        if seconds:
            out[f"{name}_GBps"] = result["ar_bytes"] / seconds / 1e9
            if copy_Bps:
                out[f"{name}_share_of_copy"] = result["ar_bytes"] / seconds / copy_Bps
    for block in result["block_sizes"]:
        cycle_gen = ((gen.get("dflash") or {}).get(str(block)) or {}).get("per_iter_s")
        cycle_parts = ((steps.get("dflash") or {}).get(str(block)) or {}).get("cycle_parts_s")
        cycle = cycle_gen or cycle_parts
        row = out["blocks"][str(block)] = dict(
            cycle_s=cycle, cycle_source="generate" if cycle_gen else "steps" if cycle_parts else None)
        if ar and cycle:
            row["cycle_over_ar"] = cycle / ar
        if cycle and block == 16:  # the published acceptance lengths are for block 16
            row["projection"] = {name: dict(tau=tau, tokens_per_s_per_request=tau / cycle,
                                            tokens_per_s_total=result["batch"] * tau / cycle,
                                            speedup_over_ar=tau * ar / cycle if ar else None)
                                 for name, tau in TAUS.items()}
    return out


def fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def report(run):
    lines = []
    info = run["versions"]
    tp = run.get("tensor_parallel", 1)
    lines.append(f"# Decode benchmark: {MODELS[run.get('model', 'qwen3-8b')][0]}, {run.get('dtype', 'bfloat16')}, "
                 f"{info['device']}{f' x {tp} (tensor parallel)' if tp > 1 else ''}")
    lines.append("")
    lines.append(f"Date {run['date']}; commit `{run['commit']}`; jax {info['jax']} ({info['backend']}), "
                 f"Python {info['python']}, flax {info.get('flax')}; command `{run['command']}`.")
    copy = run.get("copy_Bps")
    if tp > 1:
        lines.append(f"Tensor parallel over {tp} of the {info['num_devices']} devices (one mesh); bytes and "
                     f"floors below are the whole model's, over {tp} x the first device's copy bandwidth.")
    lines.append(f"Device copy bandwidth (read + write): {fmt(copy and copy / 1e12, 3)} TB/s. "
                 f"Weights streamed per target step: {run['target_stream_bytes'] / 1e9:.2f} GB "
                 f"(drafter {run['drafter_bytes'] / 1e9:.2f} GB).")
    points = [p for p in run["points"] if "derived" in p]
    lines += ["", "## Autoregressive step (ms)", "",
              "generate: `generate_autoregressive`, n - m method; Engine: median `step()` wall time (host "
              "round trip included), with asynchronous scheduling (the default) and without (sync), and "
              "its DFlash step (drafter's block, random drafts, asynchronous); step: `target_step` + "
              "`sample_target` in a device loop; floor: "
              "weights streamed + K/V read over the copy bandwidth; GB/s and share from generate (else step).", "",
              "| B | ctx | attention | generate | Engine | Engine sync | Engine DFlash | step | floor | GB/s "
              "| share of copy |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        d = p["derived"]
        step = ((p.get("steps") or {}).get("ar_step") or {}).get("s")
        gen = d["ar_s"] if d["ar_source"] == "generate" else None
        lines.append(f"| {p['batch']} | {p['context']} | {p['attention_impl']} | {fmt(ms(gen))} "
                     f"| {fmt(ms(d['engine_s']))} | {fmt(ms(d.get('engine_sync_s')))} "
                     f"| {fmt(ms(d.get('engine_dflash_s')))} | {fmt(ms(step))} "
                     f"| {fmt(ms(d.get('ar_floor_s')))} "
                     f"| {fmt(d.get('ar_GBps'), 0)} | {fmt(d.get('ar_share_of_copy'))} |")
    lines += ["", "## DFlash cycle (ms)", "",
              "generate: `generate` cycle, n - m method; parts: each in a device loop (layout = "
              "`draft_layouts`, ctx K/V = `write_context_kv`, draft = `draft_block`, sample = "
              "`sample_drafts`, verify = `target_step` on B x block rows, accept = `rejection_sample`); "
              "cycle / AR uses the generate numbers where present, else the parts; floor: weights (target, "
              "drafter, LM head twice) + K/V over the copy bandwidth.", "",
              "| B | ctx | attention | block | generate | cycle / AR | layout | ctx K/V | draft | sample | verify "
              "| accept | parts sum | floor | accepted/cycle (random weights) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        d = p["derived"]
        for block in p["block_sizes"]:
            s = ((p.get("steps") or {}).get("dflash") or {}).get(str(block)) or {}
            gen = ((p.get("generate") or {}).get("dflash") or {}).get(str(block)) or {}
            part = [fmt(ms((s.get(k) or {}).get("s")), 3) for k in ("layout", "ctx_kv", "draft", "sample", "verify",
                                                                     "accept")]
            lines.append(f"| {p['batch']} | {p['context']} | {p['attention_impl']} | {block} "
                         f"| {fmt(ms(gen.get('per_iter_s')))} | {fmt(d['blocks'][str(block)].get('cycle_over_ar'))} "
                         f"| {' | '.join(part)} | {fmt(ms(s.get('cycle_parts_s')))} "
                         f"| {fmt(ms(d.get('cycle_floor_s')))} | {fmt(gen.get('mean_accepted'))} |")
    lines += ["", "## Projected tokens/s, block 16 (PROJECTIONS, not measurements)", "",
              "tau / measured cycle time at the published Qwen3-8B-DFlash-b16 acceptance lengths "
              "(GSM8K 6.55, Alpaca 3.16); random weights accept almost nothing, and the cycle's cost "
              "is assumed not to depend on acceptance.", "",
              "| B | ctx | attention | cycle ms (source) | tok/s/request tau 6.55 | tau 3.16 | total tok/s tau 6.55 "
              "| AR tok/s/request | projected speedup tau 6.55 |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        d = p["derived"]
        b16 = d["blocks"].get("16") or {}
        proj = b16.get("projection") or {}
        g, a = proj.get("gsm8k") or {}, proj.get("alpaca") or {}
        lines.append(f"| {p['batch']} | {p['context']} | {p['attention_impl']} | {fmt(ms(b16.get('cycle_s')))} "
                     f"({b16.get('cycle_source')}) | {fmt(g.get('tokens_per_s_per_request'), 0)} "
                     f"| {fmt(a.get('tokens_per_s_per_request'), 0)} | {fmt(g.get('tokens_per_s_total'), 0)} "
                     f"| {fmt(d['ar_s'] and 1 / d['ar_s'], 0)} | {fmt(g.get('speedup_over_ar'))} |")
    anchors = run.get("anchors")
    if anchors:
        lines += ["", "## PyTorch anchors (batch 1, same weights)", ""]
        if anchors.get("error") or anchors.get("zlab_error"):
            lines.append(f"Note: {anchors.get('error') or anchors.get('zlab_error')}".replace("\n", " ")[:600])
            lines.append("")
        lines += [f"torch {anchors.get('torch')}, transformers {anchors.get('transformers')}, on "
                  f"{anchors.get('gpu') or anchors.get('device')}; z-lab cycles at block 16.", "",
                  "| ctx | attention | transformers ms/token (compiled) | ours AR ms | transformers / ours "
                  "| z-lab ms/cycle | ours cycle ms | z-lab / ours |",
                  "|---|---|---|---|---|---|---|---|"]
        for context, row in (anchors.get("contexts") or {}).items():
            hf, zl = row.get("transformers") or {}, row.get("zlab") or {}
            for p in points:
                if p["batch"] != 1 or p["context"] != int(context):
                    continue
                d = p["derived"]
                ours = (d["blocks"].get("16") or {}).get("cycle_s")
                hf_s, zl_s = hf.get("per_token_s"), zl.get("cycle_s")
                lines.append(f"| {context} | {p['attention_impl']} | {fmt(ms(hf_s))} ({hf.get('compiled')}) "
                             f"| {fmt(ms(d['ar_s']))} | {fmt(hf_s and d['ar_s'] and hf_s / d['ar_s'])} "
                             f"| {fmt(ms(zl_s))} | {fmt(ms(ours))} | {fmt(zl_s and ours and zl_s / ours)} |")
            for kind, value in (("transformers", hf), ("z-lab", zl)):
                if value.get("error"):
                    lines.append(f"\n{kind} at {context}: {value['error']}"[:400])
    profiles = run.get("profile") or []
    if profiles:
        lines += ["", "## Profile: per loop iteration", "",
                  "From two jax.profiler traces (an m-run and an n-run of the same compiled program): (events of "
                  "the n-run - of the m-run) / iterations apart; busy = summed kernel time. memcpy DtoH = host "
                  "syncs.", "",
                  "| point | attention | loop | device events | busy ms | memcpy | memcpy DtoH |",
                  "|---|---|---|---|---|---|---|"]
        for profile in profiles:
            for loop in ("ar", "dflash"):
                per = (profile.get(loop) or {}).get("per_iteration") or {}
                busy = per.get("busy_us")
                lines.append(f"| {profile.get('point')} | {profile.get('attention_impl')} | {loop} "
                             f"| {fmt(per.get('device_events'), 1)} | {fmt(busy and busy / 1e3, 3)} "
                             f"| {fmt(per.get('memcpy'), 1)} | {fmt(per.get('memcpy_dtoh'), 1)} |")
            if profile.get("error"):
                lines.append(f"\nProfile error ({profile.get('attention_impl')}): {profile['error']}")
    if (run.get("model", "qwen3-8b") == "qwen3-8b" and run.get("dtype", "bfloat16") == "bfloat16"
            and run.get("tensor_parallel", 1) == 1):  # issue 6's setting
        lines += ["", "## Issue 6 targets", "", "| target | measured | met |", "|---|---|---|"]
        for target in targets(run):
            lines.append(f"| {target[0]} | {target[1]} | {target[2]} |")
    skipped = run.get("skipped") or []
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped)]
    return "\n".join(lines) + "\n"


def targets(run):
    """(target, measured, met) rows for issue 6's targets: the best attention impl (and for
    batch 32 the best block size) among those measured."""
    def rows_at(batch, context):
        return [p["derived"] for p in run["points"]
                if p["batch"] == batch and p["context"] == context and "derived" in p]

    def best_ar(batch, context):
        values = [d["ar_s"] for d in rows_at(batch, context) if d["ar_s"]]
        return min(values) if values else None

    def best_ratio(batch, context, blocks):
        """(cycle / AR, cycle seconds, block) with the lowest ratio."""
        found = [(b["cycle_over_ar"], b["cycle_s"], block) for d in rows_at(batch, context)
                 for block, b in d["blocks"].items() if block in blocks and b.get("cycle_over_ar")]
        return min(found) if found else (None, None, None)

    def row(name, value, ok):
        return (name, value, "-" if ok is None else ("yes" if ok else "NO"))

    ar1 = best_ar(1, 1024)
    ratio1, cyc1, _ = best_ratio(1, 1024, ("16",))
    ratio32, _, block32 = best_ratio(32, 1024, tuple(str(b) for b in range(2, 17)))
    rows = [row("AR step B1 ctx1k <= 4.3 ms", fmt(ms(ar1)), ar1 and ar1 <= 4.3e-3),
            row("DFlash cycle B1 ctx1k block 16 <= 1.2x AR step", fmt(ratio1), ratio1 and ratio1 <= 1.2),
            row(f"DFlash cycle B32 ctx1k <= 1.6x AR step (block {block32})", fmt(ratio32), ratio32 and ratio32 <= 1.6),
            row("projected tok/s tau 6.55 B1 >= 1300 (projection)", fmt(cyc1 and 6.55 / cyc1, 0),
                cyc1 and 6.55 / cyc1 >= 1300)]
    anchor = ((run.get("anchors") or {}).get("contexts") or {}).get("1024") or {}
    hf = (anchor.get("transformers") or {}).get("per_token_s")
    zl = (anchor.get("zlab") or {}).get("cycle_s")
    rows.append(row("AR step >= 2x faster than transformers compiled", fmt(hf and ar1 and hf / ar1),
                    hf and ar1 and hf >= 2 * ar1))
    rows.append(row("DFlash cycle >= 8x faster than z-lab", fmt(zl and cyc1 and zl / cyc1),
                    zl and cyc1 and zl >= 8 * cyc1))
    return rows


# ---- main ---------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="decode.json", help="JSON results (the markdown goes beside it, .md)")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test (--model small)")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b", help="the random models' shapes")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the random models' dtype (the PyTorch anchors run in bfloat16 only)")
    parser.add_argument("--quick", action="store_true", help=f"points {POINTS_QUICK}, fewer repeats")
    parser.add_argument("--points", default=None, help=f"BxC list, e.g. 1x1k,32x8k (default {POINTS_FULL})")
    parser.add_argument("--attention-impl", default="auto", help="comma list of auto / reference / pallas")
    parser.add_argument("--kernels", default="", help="the other kernels' implementations, e.g. norm=reference "
                        "(dflash_jax.Kernels.parse; default all auto)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma list of " + ", ".join(SECTIONS))
    parser.add_argument("--block-sizes", default="16", help="DFlash block sizes, e.g. 16,8 (at most the "
                        "drafter's 16; projections use block 16's cycle)")
    parser.add_argument("--torch-anchors", action="store_true", help="transformers and z-lab anchors (batch 1)")
    parser.add_argument("--anchor-contexts", default=None, help="contexts of the anchors, e.g. 1k,8k "
                        "(default 1k; --small: 128)")
    parser.add_argument("--anchor-timeout-s", type=int, default=360)
    parser.add_argument("--profile", action="store_true", help="device events per loop iteration from "
                        "jax.profiler traces of the first point, per attention impl (after the generate section)")
    parser.add_argument("--n-tokens", type=int, default=None, help="new tokens of the long runs (m = n / 2 + 1)")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per measure")
    parser.add_argument("--engine-steps", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=420, help="start no section after this many seconds")
    parser.add_argument("--point-budget-s", type=float, default=30, help="target seconds of timed generate runs")
    parser.add_argument("--generate-limit", type=float, default=2.0**26,
                        help="run generate / engine with the reference attention only if B x C^2 <= this")
    parser.add_argument("--copy-gb", type=float, default=None, help="array size of the copy measurement")
    parser.add_argument("--compile-cache", default=None, help="jax persistent compilation cache folder")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="run the models over a mesh of the "
                        "first N devices (1: one device, no mesh)")
    parser.add_argument("--commit", default=None, help="commit to record (default: git describe)")
    parser.add_argument("--torch-worker", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.torch_anchors and opts.dtype != "bfloat16":
        parser.error("--torch-anchors runs the PyTorch anchors in bfloat16: drop it or --dtype float32.")
    if opts.tensor_parallel < 1:
        parser.error("--tensor-parallel must be at least 1.")
    if opts.tensor_parallel > 1 and (opts.torch_anchors or opts.profile):
        parser.error("--torch-anchors and --profile measure one device: drop them or --tensor-parallel.")
    if opts.torch_worker:
        return torch_worker(opts.torch_worker)

    if opts.torch_anchors and "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:
        # Grow on demand instead of taking 75% up front: the torch worker needs the rest.
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax
    import numpy as np

    from pallas_kernels.common import TRITON_DEPRECATION

    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=DeprecationWarning)
    if opts.compile_cache:
        jax.config.update("jax_compilation_cache_dir", opts.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

    small, quick = opts.small, opts.quick
    opts.n_tokens = opts.n_tokens or (32 if small else 64)
    opts.reps = opts.reps or (2 if small or quick else 3)
    opts.engine_steps = opts.engine_steps or (6 if small else 10 if quick else 20)
    opts.step_iters, opts.small_iters, opts.step_reps = (2, 4, 2) if small else (5, 20, 3) if quick else (8, 20, 5)
    points = parse_points(opts.points or (POINTS_SMALL if small else POINTS_QUICK if quick else POINTS_FULL))
    impls = [s.strip() for s in opts.attention_impl.split(",")]
    opts.block_sizes = [int(b) for b in opts.block_sizes.split(",")]
    if any(not 2 <= b <= 16 for b in opts.block_sizes):
        parser.error("block sizes must lie in [2, 16] (the drafter is trained for 16)")
    sections = [s.strip() for s in opts.sections.split(",")]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        parser.error(f"unknown sections {bad}; choose from {SECTIONS}")
    tp = opts.tensor_parallel
    if tp > jax.device_count():
        parser.error(f"--tensor-parallel {tp} needs {tp} devices; there are {jax.device_count()}.")
    from dflash_jax.kernels import Kernels
    from dflash_jax.sharding import make_mesh

    mesh = make_mesh(tp, 1, devices=jax.devices()[:tp]) if tp > 1 else None
    base_kernels = Kernels.parse(opts.kernels)
    opts.kernels_for = lambda impl: dataclasses.replace(base_kernels, attention=impl)
    for impl in impls:
        opts.kernels_for(impl)
    out_path = opts.out
    md_path = os.path.splitext(out_path)[0] + ".md"
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    budget = Budget(opts.budget_s)

    run = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               commit=opts.commit or commit_of(REPO), versions=versions(), small=small,
               model="small" if small else opts.model, dtype=opts.dtype, tensor_parallel=tp,
               command="python bench/bench_decode.py " + " ".join(sys.argv[1:] if argv is None else argv),
               settings=dict(n_tokens=opts.n_tokens, reps=opts.reps, engine_steps=opts.engine_steps,
                             step_iters=opts.step_iters, small_iters=opts.small_iters, step_reps=opts.step_reps,
                             page_size=PAGE_SIZE, block_sizes=opts.block_sizes, generate_limit=opts.generate_limit),
               env={k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                    "XLA_FLAGS")},
               kernels=opts.kernels,
               points=[], skipped=[], timeline=[])

    def save():
        with open(out_path, "w") as f:
            json.dump(run, f, indent=1, default=str)
        with open(md_path, "w") as f:
            f.write(report(run))

    def note(text):
        run["timeline"].append(f"{budget.elapsed:7.1f}s {text}")
        print(f"[{budget.elapsed:7.1f}s] {text}", flush=True)

    print(json.dumps(run["versions"]), flush=True)
    t0 = time.perf_counter()
    pair = build_pair(run["model"], opts.dtype, mesh=mesh)
    note(f"models built on the device{f' and placed on {tp} devices' if mesh else ''} in "
         f"{time.perf_counter() - t0:.1f} s")
    run.update(target_stream_bytes=pair.target_stream_bytes, drafter_bytes=pair.drafter_bytes,
               lm_head_bytes=pair.lm_head_bytes, target_config=MODELS[run["model"]][1],
               drafter_config=MODELS[run["model"]][2])
    copy_bytes = int((opts.copy_gb or (0.0625 if small else 4.0)) * 2**30)
    run["copy_rates_Bps"] = copy_bandwidth(copy_bytes)
    run["copy_Bps"] = max(run["copy_rates_Bps"].values())
    run["copy_bytes"] = copy_bytes
    note("copy bandwidth (read + write) " + ", ".join(f"{k} {v / 1e9:.0f} GB/s" for k, v in run["copy_rates_Bps"].items()))
    save()

    if opts.torch_anchors:
        anchor_contexts = opts.anchor_contexts or ("128" if small else "1k")
        contexts = [c for _, c in parse_points(",".join(f"1x{c}" for c in anchor_contexts.split(",")))]
        run["anchors"] = in_temp_dir("bench_decode_anchors_", lambda d: run_torch_anchors(pair, contexts, opts, d))
        note(f"torch anchors: {json.dumps(run['anchors'].get('contexts'), default=str)[:400]}")
        gc.collect()
        save()

    limit = device_memory_limit()
    rng = np.random.default_rng(0)
    tcfg, dcfg = pair.target.cfg, pair.drafter.cfg
    work = []  # (result, prompts) per point and attention implementation
    for batch, context in points:
        need = memory_needed(pair, batch, context, next_pow2(opts.n_tokens), max(opts.block_sizes))
        if limit and need > 0.9 * limit:
            run["skipped"].append(f"{label(batch, context)}: needs ~{need / 2**30:.0f} GiB, the device has "
                                  f"{limit / 2**30:.0f} GiB")
            note(run["skipped"][-1])
            continue
        prompts = prompts_for(rng, tcfg.vocab_size, batch, context)
        mean_ctx = context + 0.75 * opts.n_tokens  # where the n - m steps sit, on average
        kv_target = batch * mean_ctx * kv_bytes_per_token(pair.target, tcfg.num_layers)
        kv_drafter = batch * mean_ctx * kv_bytes_per_token(pair.drafter, dcfg.num_layers)
        for impl in impls:
            result = dict(batch=batch, context=context, attention_impl=impl, block_sizes=opts.block_sizes,
                          memory_estimate_bytes=need, ar_bytes=pair.target_stream_bytes + kv_target,
                          cycle_bytes=(pair.target_stream_bytes + pair.drafter_bytes + pair.lm_head_bytes
                                       + kv_target + kv_drafter))
            result["derived"] = derived(result, run["copy_Bps"] * tp)
            run["points"].append(result)
            work.append((result, prompts))

    def profile():
        """After the generate section: its programs at the first point are compiled already."""
        if not (opts.profile and work) or budget.left() <= 0:
            return
        run["profile"] = []
        for result, prompts in work:
            if (result["batch"], result["context"]) != points[0]:
                continue
            # Traces are large: they stay in a temporary folder, only the summary is kept.
            impl = result["attention_impl"]
            run["profile"].append(dict(point=label(*points[0]), attention_impl=impl, **in_temp_dir(
                "bench_decode_profile_", lambda d: profile_generate(pair, prompts, impl, opts, d))))
            note(f"profile: {json.dumps(run['profile'][-1], default=str)[:600]}")
            save()

    # Sections outermost: the headline numbers (generate) of every point before the rest.
    for section in sections:
        for result, prompts in work:
            batch, context, impl = result["batch"], result["context"], result["attention_impl"]
            tag = f"{label(batch, context)} {impl} {section}"
            prefill_ok = opts.kernels_for(impl).resolve().attention == "pallas" or batch * context**2 <= opts.generate_limit
            if budget.left() <= 0:
                run["skipped"].append(f"{tag}: time budget (--budget-s {opts.budget_s:.0f})")
                note(run["skipped"][-1])
                continue
            if section in ("generate", "engine") and not prefill_ok:
                run["skipped"].append(f"{tag}: reference-attention prefill too slow (B x C^2 > --generate-limit)")
                note(run["skipped"][-1])
                continue
            t0 = time.perf_counter()
            if section == "generate":
                result[section] = guarded(section_generate, pair, prompts, impl, opts)
            elif section == "engine":
                result[section] = guarded(section_engine, pair, prompts, impl, opts)
            else:
                result[section] = guarded(section_steps, pair, batch, context, impl, opts, rng)
            gc.collect()
            result["derived"] = derived(result, run["copy_Bps"] * tp)
            cycles = {b: fmt(ms(v["cycle_s"])) for b, v in result["derived"]["blocks"].items()}
            note(f"{tag} done in {time.perf_counter() - t0:.1f} s: AR {fmt(ms(result['derived']['ar_s']))} ms, "
                 f"cycle ms by block {cycles}")
            save()
        if section == "generate":
            profile()
    if "generate" not in sections:
        profile()

    save()
    print(report(run), flush=True)
    print(f"results: {out_path} and {md_path}; {budget.elapsed:.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
