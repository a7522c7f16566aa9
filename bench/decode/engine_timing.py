"""The engine section: the Engine's decode step, wall time per `Engine.step()` (host
scheduling and the step's device round trip included: that is how the Engine runs)."""

from __future__ import annotations

import gc
import time

from bench.decode.points import PAGE_SIZE
from bench.harness import time_calls
from pallas_kernels.common import next_pow2


def section_engine(pair, prompts, impl: str, opts) -> dict:
    """The Engine's decode step with asynchronous scheduling (its default) and without, and
    its DFlash step (the drafter's block) with asynchronous scheduling."""
    result = time_engine(pair, prompts, impl, opts, async_scheduling=True)
    result["sync"] = time_engine(pair, prompts, impl, opts, async_scheduling=False)
    result["dflash"] = time_engine(pair, prompts, impl, opts, async_scheduling=True, drafter=pair.drafter)
    return result


def time_engine(pair, prompts, impl: str, opts, async_scheduling: bool, drafter=None) -> dict:
    """Median seconds of one `step()` over `opts.engine_steps` decode steps, after the prefill
    and two warm-up steps (the first decode step compiles its bucket)."""
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
    for _ in range(warm):
        engine.step()
    traces = Engine.num_traces()

    def step():
        engine.step()  # waits for the device itself: a step reads back committed tokens

    timing = time_calls(step, reps=steps, warmup=0)
    del step, engine
    gc.collect()
    return dict(step_s=timing.median_s, spread_s=timing.spread_s, steps=steps, prefill_s=prefill,
                prefill_steps=prefill_steps, new_traces_in_timed_steps=Engine.num_traces() - traces)
