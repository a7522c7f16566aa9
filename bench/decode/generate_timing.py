"""The generate section: `generate_autoregressive` and `generate` end to end, per AR step and
per DFlash cycle by the n - m method (bench.decode.speed's docstring)."""

from __future__ import annotations

import statistics
import time


def time_generate(run, n_long: int, reps: int, point_budget_s: float) -> dict:
    """Per-iteration seconds of a generate loop, `run(max_new_tokens)`, by the n - m method,
    and how many programs were traced during the timed runs (0: no recompilation)."""
    from dflash_jax.generate import num_traces

    n_short = n_long // 2 + 1
    t0 = time.perf_counter()
    run(n_short)  # compiles
    first = time.perf_counter() - t0
    programs = num_traces()
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
        new_compiles_in_timed_runs=num_traces() - programs,
        warning=None if delta_iter >= 8 else f"only {delta_iter} loop iterations apart: noisy",
    )


def section_generate(pair, prompts, impl: str, opts) -> dict:
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
