"""Whether an Engine step's cost follows the requests' lengths or its max length: one request
decoded on Engines that differ only in `max_model_len`, with `serve`'s sizes and models
(`--server-args`, as `dflash-jax serve` takes them; default the demo pair). Per max length:
the median step, the compiled decode program's temporary bytes against the caches' (a step
that copied the caches needs at least their size) and the process's resident memory over the
steps (flat when the caches are updated in place).

    python -m bench.decode.engine_max_len --out J                          # demo pair, 512 and 8192
    python -m bench.decode.engine_max_len --server-args "--no-drafter" --out J
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time

from bench import harness
from dflash_jax.demo import QUESTIONS


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_output_arguments(parser)
    parser.add_argument("--max-lens", default="512,8192", help="comma-separated max lengths (0: the target's)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--server-args", default="", help="flags of `dflash-jax serve` naming models and sizes")
    args = parser.parse_args(argv)
    import dflash_jax
    from dflash_jax.cli import parse_args
    from dflash_jax.kv_cache import kv_cache_bytes
    from dflash_jax.serve.cli import load_models

    flags = parse_args(["serve", *shlex.split(args.server_args)])
    models = load_models(flags)
    target = models.target
    prompt = models.tokenizer.encode([{"role": "user", "content": QUESTIONS[0]}])
    params = dflash_jax.SamplingParams(max_new_tokens=args.max_tokens, temperature=0.0)
    record = harness.Record(__spec__.name, args, argv)
    results = []
    for max_len in (int(n) for n in args.max_lens.split(",")):
        engine = dflash_jax.Engine(target, models.drafter, max_num_reqs=flags.max_num_reqs,
                                   max_num_tokens=flags.max_num_tokens, max_model_len=max_len or None,
                                   block_size=models.info.block_size if models.drafter is not None else None,
                                   draft_sampling=flags.draft_sampling)
        decode = next(p for p in engine.programs if p.rows == 1 and p.greedy)
        memory = engine.memory_analysis(decode)
        caches = kv_cache_bytes(num_layers=len(target.cfg.kv_layers), num_pages=engine.scheduler.allocator.num_pages,
                                page_size=engine.page_size, num_kv_heads=target.cfg.num_kv_heads,
                                head_dim=target.cfg.head_dim, dtype=target.dtype)
        row = {"max_model_len": engine.max_model_len, "target_cache_bytes": caches,
               "decode_temp_bytes": memory.temp_size_in_bytes}
        for label in ("warm-up", "timed"):  # the first request compiles what it runs
            request = engine.add_request(prompt, params)
            steps_s, resident = [], []
            while engine.has_unfinished():
                start = time.perf_counter()
                engine.step()
                steps_s.append(time.perf_counter() - start)
                resident.append(resident_bytes())
            row.update(tokens=len(engine.output(request)), steps=len(steps_s), median_step_s=statistics.median(steps_s),
                       resident_min_bytes=min(resident), resident_max_bytes=max(resident))
            engine.release(request)
        results.append(row)
        record.write(results)
        print(f"max length {row['max_model_len']:6d}: step {row['median_step_s'] * 1e3:7.1f} ms, decode temp "
              f"{row['decode_temp_bytes'] / 2**20:8.1f} MiB of {caches / 2**20:8.1f} MiB caches, resident "
              f"{row['resident_min_bytes'] / 2**30:.2f}-{row['resident_max_bytes'] / 2**30:.2f} GiB", flush=True)
        del engine


if __name__ == "__main__":
    main()
