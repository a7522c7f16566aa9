"""Decode speed at Qwen3-8B scale (issue 6): AR step, DFlash cycle and parts, anchors.

The autoregressive step and the DFlash cycle, the cycle's parts, achieved bandwidth, PyTorch
anchors and projected tokens/s, measured in one process.

    python -m bench.decode.speed --quick --torch-anchors --profile --attention-impl reference,pallas \
        --commit HASH --out $OUT/decode.json   # issue 6's target points (no .git on the device)
    python -m bench.decode.speed --points 8x1k,1x8k,128x1k --attention-impl pallas --out $OUT/more.json
    python -m bench.decode.speed --points 32x1k --block-sizes 16,8,4 --sections generate,steps --out ...
    python -m bench.decode.speed --small --torch-anchors --profile --out /tmp/decode.json  # CPU smoke test
    python -m bench.decode.speed --model smollm2-135m --dtype float32 --points 1x1k --sections generate ...
    python -m bench.decode.speed --model qwen3-32b --tensor-parallel 4 --points 1x1k,32x1k \
        --sections generate,engine --out ...   # one model over 4 devices (bench/plans/tensor_parallel.sh)

Models (`bench.shapes`): a Qwen3-8B-shaped target and a Qwen3-8B-DFlash-b16-shaped drafter;
with `--model qwen3-32b`, Qwen3-32B's shape and a drafter of the same form at its sizes; or,
with `--model smollm2-135m`, SmolLM2-135M's shape and the shipped drafter's (the launch-bound
end). Random weights (bf16, or `--dtype float32`) are drawn on the device, one small jit per
shape (`bench.random_models`).

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
          ctx_kv = `write_context_kv`; draft = `draft_block`; sample = `sample_drafts` (a DFlash
          2 drafter: its selector's walk); verify = `target_step` on B x block tokens; accept =
          `rejection_sample`. All greedy.
engine    The Engine without a drafter: B requests, prefill, then the median wall time of one
          `Engine.step()` over --engine-steps decode steps (host scheduling and the per-step
          device round trip included: that is how the Engine runs), with asynchronous
          scheduling (the default: the host's work overlaps the device's) and without (sync);
          then the Engine with the drafter (its block size; asynchronous), whose step is a
          DFlash cycle. Same prefill limit.

Also: `copy`, the device copy bandwidth (the faster of x + 1 and jnp.copy over a large bf16
array; read + write counted, as ENVIRONMENT.md's copy rate); `bandwidth`, AR step bytes
(target weights streamed: every parameter but the embedding table, of a MoE target's experts
those the step's B tokens touch under uniform routing, plus the K/V read, B x C x layers x 2 x
kv heads x head_dim x 2 bytes, and a hybrid target's gated-delta-net states read and written
once) over the AR step time, and its share of the copy bandwidth;
the `floor` of a step, those bytes over the copy bandwidth (for the cycle, per block: the
target over B x block tokens, drafter and the LM head a second time for the draft logits, plus
both K/V reads); --profile: device events, busy time and host syncs per loop iteration from
two jax.profiler traces.

--torch-anchors (batch 1): the same weights, written with convert.export_hf, in a torch
subprocess (torch and jax CUDA libraries never share a process): transformers' static-cache
`generate` (torch.compile'd automatically on a GPU) per token by the same n - m method, and
z-lab's `dflash_generate` per cycle (its own decode timer over its cycles), both reported as
ratios to ours.

Projections: tokens/s = tau / DFlash cycle time at tau = 6.55 (GSM8K) and 3.16 (Alpaca), the
published Qwen3-8B-DFlash-b16 acceptance lengths. These are PROJECTIONS, not measurements:
random weights accept almost nothing, and the cycle's cost is taken not to depend on it.

Output: the JSON record at --out (`bench.harness`: env, args, and every number under
"results") and a markdown report on stdout and next to it (.md); both rewritten after every
section, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from bench import harness
from bench.decode.engine_timing import section_engine
from bench.decode.generate_timing import section_generate
from bench.decode.points import (
    PAGE_SIZE, POINTS_FULL, POINTS_QUICK, POINTS_SMALL, device_memory_limit, label, memory_needed, parse_points,
    prompts_for,
)
from bench.decode.profile import profile_generate
from bench.decode.report import derived, fmt, ms, report
from bench.decode.step_parts import section_steps
from bench.decode.torch_anchors import run_torch_anchors
from bench.random_models import build_pair, kv_bytes_per_token, recurrent_bytes_per_request
from bench.shapes import MODELS
from pallas_kernels.common import next_pow2

SECTIONS = ("generate", "steps", "engine")


def guarded(fn, *args):
    """fn(*args), or {"error": ...} with the traceback printed: one failure never ends the run."""
    try:
        return fn(*args)
    except Exception as error:
        traceback.print_exc()
        return dict(error=f"{type(error).__name__}: {error}")


def in_temp_dir(prefix: str, fn):
    """guarded fn(folder) in a fresh temporary folder, removed afterwards."""
    folder = tempfile.mkdtemp(prefix=prefix)
    try:
        return guarded(fn, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Budget:
    """Wall-clock budget for the whole run: sections start only while time is left."""

    def __init__(self, seconds: float):
        self.start, self.seconds = time.perf_counter(), seconds

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed


def copy_bandwidth(num_bytes: int, reps: int = 10) -> dict[str, float]:
    """Device copy rates, bytes/s, read + write counted, over a bf16 array: {"x+1": a jitted
    elementwise add (donated), "copy": a jitted jnp.copy (a device-to-device copy)}. The add
    reads below the copy rate on the H200: both are kept and the larger one is the floors'
    copy rate."""
    import jax
    import jax.numpy as jnp

    rates = {}
    for name, fn, donate in (("x+1", lambda x: x + jnp.ones((), x.dtype), (0,)), ("copy", jnp.copy, ())):
        step = jax.jit(fn, donate_argnums=donate)
        arrays = {"x": jnp.zeros((num_bytes // 2,), jnp.bfloat16)}

        def five_calls():
            for _ in range(5):
                y = step(arrays["x"])
                arrays["x"] = y if donate else arrays["x"]
            return y

        # 20 calls to compile and let the clocks ramp up, then samples of 5.
        timing = harness.time_calls(five_calls, reps=reps, warmup=4, calls_per_sample=5)
        arrays.clear()
        rates[name] = 2 * (num_bytes // 2) * 2 / timing.median_s
    return rates


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_output_arguments(parser, out_default="decode.json")
    parser.add_argument("--small", action="store_true",
                        help="tiny shapes: a CPU smoke test (--model small, or small-moe when given)")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b", help="the random models' shapes")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the random models' dtype (the PyTorch anchors run in bfloat16 only)")
    # dflash_jax.quantization.QUANTIZE_CHOICES, spelled out: importing it starts jax before main sets its environment
    parser.add_argument("--quantize", choices=("int8", "fp8"),
                        help="the target's decoder-layer weights in 8 bits (weight-only)")
    parser.add_argument("--quantize-block", type=int, default=0,
                        help="with --quantize: input rows per scale (0, the default: one scale per output channel)")
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
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.torch_anchors and opts.dtype != "bfloat16":
        parser.error("--torch-anchors runs the PyTorch anchors in bfloat16: drop it or --dtype float32.")
    if opts.tensor_parallel < 1:
        parser.error("--tensor-parallel must be at least 1.")
    if opts.quantize and (opts.torch_anchors or opts.tensor_parallel > 1):
        parser.error("--quantize runs one device without anchors: drop --torch-anchors and --tensor-parallel.")
    if opts.tensor_parallel > 1 and (opts.torch_anchors or opts.profile):
        parser.error("--torch-anchors and --profile measure one device: drop them or --tensor-parallel.")
    opts.block_sizes = [int(b) for b in opts.block_sizes.split(",")]
    if any(not 2 <= b <= 16 for b in opts.block_sizes):
        parser.error("block sizes must lie in [2, 16] (the drafter is trained for 16)")
    opts.sections = [s.strip() for s in opts.sections.split(",")]
    bad = [s for s in opts.sections if s not in SECTIONS]
    if bad:
        parser.error(f"unknown sections {bad}; choose from {SECTIONS}")
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
    record = harness.Record(__spec__.name, opts, argv, packages=("triton",))

    small, quick = opts.small, opts.quick
    opts.n_tokens = opts.n_tokens or (32 if small else 64)
    opts.reps = opts.reps or (2 if small or quick else 3)
    opts.engine_steps = opts.engine_steps or (6 if small else 10 if quick else 20)
    opts.step_iters, opts.small_iters, opts.step_reps = (2, 4, 2) if small else (5, 20, 3) if quick else (8, 20, 5)
    points = parse_points(opts.points or (POINTS_SMALL if small else POINTS_QUICK if quick else POINTS_FULL))
    impls = [s.strip() for s in opts.attention_impl.split(",")]
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
    md_path = Path(opts.out).with_suffix(".md")
    budget = Budget(opts.budget_s)
    model = opts.model if small and opts.model.startswith("small") else "small" if small else opts.model
    run = dict(small=small, model=model, dtype=opts.dtype, quantize=opts.quantize,
               quantize_block=opts.quantize_block or None, tensor_parallel=tp,
               settings=dict(n_tokens=opts.n_tokens, reps=opts.reps, engine_steps=opts.engine_steps,
                             step_iters=opts.step_iters, small_iters=opts.small_iters, step_reps=opts.step_reps,
                             page_size=PAGE_SIZE, block_sizes=opts.block_sizes, generate_limit=opts.generate_limit),
               kernels=opts.kernels, resolved_kernels=dataclasses.asdict(base_kernels.resolve(mesh)), points=[],
               skipped=[], timeline=[])

    def save():
        record.write(run)
        md_path.write_text(report(record.data))

    def note(text):
        run["timeline"].append(f"{budget.elapsed:7.1f}s {text}")
        print(f"[{budget.elapsed:7.1f}s] {text}", flush=True)

    print(json.dumps(record.env), flush=True)
    t0 = time.perf_counter()
    pair = build_pair(model, opts.dtype, mesh=mesh, quantize=opts.quantize, quantize_block=opts.quantize_block or None)
    note(f"models built on the device{f' and placed on {tp} devices' if mesh else ''} in "
         f"{time.perf_counter() - t0:.1f} s")
    run.update(target_stream_bytes=pair.target_stream_bytes(), drafter_bytes=pair.drafter_bytes,
               lm_head_bytes=pair.lm_head_bytes, target_config=MODELS[model].target,
               drafter_config=MODELS[model].drafter)
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
        kv_target = batch * mean_ctx * kv_bytes_per_token(pair.target, len(tcfg.kv_layers))
        kv_drafter = batch * mean_ctx * kv_bytes_per_token(pair.drafter, dcfg.num_layers)
        kv_target += batch * recurrent_bytes_per_request(pair.target)  # a hybrid target's states
        for impl in impls:
            result = dict(batch=batch, context=context, attention_impl=impl, block_sizes=opts.block_sizes,
                          memory_estimate_bytes=need, ar_bytes=pair.target_stream_bytes(batch) + kv_target,
                          cycle_bytes={str(block): (pair.target_stream_bytes(batch * block) + pair.drafter_bytes
                                                    + pair.lm_head_bytes + kv_target + kv_drafter)
                                       for block in opts.block_sizes})
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
    for section in opts.sections:
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
    if "generate" not in opts.sections:
        profile()

    save()
    print(report(record.data), flush=True)
    print(f"results: {opts.out} and {md_path}; {budget.elapsed:.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
