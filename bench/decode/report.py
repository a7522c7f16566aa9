"""The decode benchmark's numbers derived per point (AR step, DFlash cycle, bandwidth,
projections) and its markdown report."""

from __future__ import annotations

from bench.shapes import MODELS

TAUS = {"gsm8k": 6.55, "alpaca": 3.16}  # published mean acceptance, Qwen3-8B-DFlash-b16, greedy


def ms(seconds):
    return None if seconds is None else 1e3 * seconds


def derived(result: dict, copy_Bps: float) -> dict:
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
        if copy_Bps:
            row["floor_s"] = result["cycle_bytes"][str(block)] / copy_Bps
        if ar and cycle:
            row["cycle_over_ar"] = cycle / ar
        if cycle and block == 16:  # the published acceptance lengths are for block 16
            row["projection"] = {name: dict(tau=tau, tokens_per_s_per_request=tau / cycle,
                                            tokens_per_s_total=result["batch"] * tau / cycle,
                                            speedup_over_ar=tau * ar / cycle if ar else None)
                                 for name, tau in TAUS.items()}
    return out


def fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(record: dict) -> str:
    """The markdown report of a decode benchmark record (`harness.Record`)."""
    lines = []
    run, info = record["results"], record["env"]
    tp = run.get("tensor_parallel", 1)
    lines.append(f"# Decode benchmark: {MODELS[run.get('model', 'qwen3-8b')].title}, {run.get('dtype', 'bfloat16')}, "
                 f"{info['device']}{f' x {tp} (tensor parallel)' if tp > 1 else ''}")
    lines.append("")
    lines.append(f"Date {info['date']}; commit `{info['commit']}`; jax {info['jax']} ({info['backend']}), "
                 f"Python {info['python']}, flax {info.get('flax')}; command `{record['command']}`.")
    copy = run.get("copy_Bps")
    if tp > 1:
        lines.append(f"Tensor parallel over {tp} of the {info['num_devices']} devices (one mesh); bytes and "
                     f"floors below are the whole model's, over {tp} x the first device's copy bandwidth.")
    lines.append(f"Device copy bandwidth (read + write): {fmt(copy and copy / 1e12, 3)} TB/s. "
                 f"Weights streamed per one-token target step: {run['target_stream_bytes'] / 1e9:.2f} GB "
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
              "`sample_drafts` or a DFlash 2 selector's walk, verify = `target_step` on B x block rows, accept = `rejection_sample`); "
              "cycle / AR uses the generate numbers where present, else the parts; floor: weights (target "
              "over B x block tokens, drafter, LM head twice) + K/V over the copy bandwidth.", "",
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
                         f"| {fmt(ms(d['blocks'][str(block)].get('floor_s')))} | {fmt(gen.get('mean_accepted'))} |")
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
        for profile in profiles:
            for loop in ("ar", "dflash"):
                ops = (profile.get(loop) or {}).get("ops_per_iteration") or []
                if ops:
                    lines += ["", f"Busiest ops per {loop} iteration ({profile.get('point')}, "
                              f"{profile.get('attention_impl')}): calls, us", ""]
                    lines += [f"- {op}: {fmt(calls, 1)}, {fmt(us, 1)}" for op, calls, us in ops[:15]]
                    order = (profile.get(loop) or {}).get("ops_in_launch_order") or []
                    if order:
                        lines += ["", "The 40 busiest in the order of their first launch (a layer's kernels in "
                                  "its order): " + ", ".join(order)]
    if (run.get("model", "qwen3-8b") == "qwen3-8b" and run.get("dtype", "bfloat16") == "bfloat16"
            and run.get("tensor_parallel", 1) == 1):  # issue 6's setting
        lines += ["", "## Issue 6 targets", "", "| target | measured | met |", "|---|---|---|"]
        for target in targets(run):
            lines.append(f"| {target[0]} | {target[1]} | {target[2]} |")
    skipped = run.get("skipped") or []
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped)]
    return "\n".join(lines) + "\n"


def targets(run: dict) -> list[tuple[str, str, str]]:
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
