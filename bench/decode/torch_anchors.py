"""--torch-anchors: transformers' and z-lab's PyTorch decoding of the same weights, timed in a
torch subprocess (torch and jax CUDA libraries never share a process; bench.decode.speed's
docstring). `python -m bench.decode.torch_anchors SPEC` is that subprocess: it imports no jax.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback

from bench.harness import ROOT


def run_torch_anchors(pair, contexts: list[int], opts, workdir: str) -> dict:
    """Export the pair with convert.export_hf, then time the anchors in a torch subprocess."""
    from convert import export_hf

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
        proc = subprocess.run([sys.executable, "-m", "bench.decode.torch_anchors", os.path.join(workdir, "spec.json")],
                              env=env, cwd=ROOT, timeout=opts.anchor_timeout_s, capture_output=True, text=True)
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


def torch_worker(spec_path: str) -> None:
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


if __name__ == "__main__":
    torch_worker(sys.argv[1])
