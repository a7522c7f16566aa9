"""Runs for tests/test_tensor_parallel.py, in a fresh interpreter with 8 fake CPU devices
(XLA_FLAGS must be set before jax is imported, which the pytest process has done long
before). `python tensor_parallel_runs.py CASE` prints one JSON line: the case's results.

Models are tiny and random, built from configs (no torch): a Qwen3 target whose LM head
favours two tokens (so a random drafter is often right and blocks get accepted), a tied
Llama target, and a drafter with a sliding-window layer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

DEVICES = os.environ.get("FAKE_DEVICES", "8")  # per process
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_disable_most_optimizations", True)  # compile time dominates these runs
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dflash_jax import Engine, Kernels, SamplingParams, generate, generate_autoregressive, make_mesh  # noqa: E402
from dflash_jax.buckets import Program  # noqa: E402
from dflash_jax.config import DFlash2Config, parse_config  # noqa: E402
from dflash_jax.models import Drafter, Target  # noqa: E402
from dflash_jax.placement import place_model  # noqa: E402
from dflash_jax.recurrent_state import RecurrentState  # noqa: E402

PROMPTS = [[5, 6, 7], list(range(20, 37))]


# a gated-delta-net layer, then a gated attention layer
QWEN3_5 = dict(
    architectures=["Qwen3_5ForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    rms_norm_eps=1e-6, tie_word_embeddings=False, layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
)


def target_config(architecture: str, *, kv_heads: int, tied: bool):
    return parse_config(dict(
        architectures=[architecture], vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=tied, rope_theta=10000.0,
    ))


def drafter_config(kv_heads: int = 2):
    return parse_config(dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=128, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=kv_heads,
        head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, num_target_layers=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True,
        dflash_config=dict(mask_token_id=127, target_layer_ids=[0, 1], block_size=4),
    ))


def random_params(cfg, seed: int) -> dict:
    """Host parameters with every one (norms included) shifted by noise; a target's head (or
    tied table) scaled down, two tokens along random directions scaled up."""
    model = (Target if cfg.kind == "target" else Drafter)(cfg, rngs=nnx.Rngs(seed))
    params = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype), params)
    if cfg.kind == "target":
        tied = cfg.tie_word_embeddings
        head_VD = params["embed_tokens"]["embedding"] if tied else params["lm_head"]["kernel"].T.copy()
        head_VD *= 0.5
        for token in (10, 20):
            direction = rng.standard_normal(cfg.hidden_size).astype(np.float32)
            head_VD[token] += 1.2 * direction / np.linalg.norm(direction)
        if not tied:
            params["lm_head"]["kernel"] = head_VD.T.copy()
    return params


def dflash2_drafter_config():
    """The drafter above as a DFlash 2 drafter: convolutions of 3 taps, 4 groups, a selector of
    rank 8 over 6 candidates."""
    cfg = drafter_config()
    return dataclasses.replace(cfg, dflash2=DFlash2Config(conv_kernel_size=3, conv_group_size=16, selector_rank=8,
                                                          selector_top_k=6))


def models(target_cfg, tp: int, drafter_kv_heads: int = 2, drafter_cfg=None):
    mesh = make_mesh(tp, 1) if tp > 1 else None
    target = place_model(target_cfg, jnp.float32, random_params(target_cfg, 0), mesh)
    drafter_cfg = drafter_cfg or drafter_config(drafter_kv_heads)
    drafter = place_model(drafter_cfg, jnp.float32, random_params(drafter_cfg, 1), mesh)
    return target, drafter


def greedy() -> dict:
    """Speculative greedy tokens and accepted lengths per TP size: Qwen3 with 2 kv heads
    (fewer than the shards from TP 4 on) at TP 1, 2, 4, 8; tied Llama with 8 kv heads at TP 1
    and 8; and Qwen3's autoregressive tokens at TP 1."""
    out = {}
    qwen3 = target_config("Qwen3ForCausalLM", kv_heads=2, tied=False)
    llama = target_config("LlamaForCausalLM", kv_heads=8, tied=True)
    for name, cfg, sizes in (("qwen3", qwen3, (1, 2, 4, 8)), ("llama", llama, (1, 8))):
        for tp in sizes:
            target, drafter = models(cfg, tp)
            spec = generate(target, drafter, PROMPTS, max_new_tokens=12)
            out[f"{name}/{tp}"] = [spec.token_ids, spec.accepted_lengths]
    out["qwen3/ar"] = generate_autoregressive(models(qwen3, 1)[0], PROMPTS, max_new_tokens=12).token_ids
    return out


def engine_and_sampling() -> dict:
    """Engine greedy tokens and seeded sampled `generate` tokens at TP 1 and 4."""
    out = {}
    cfg = target_config("Qwen3ForCausalLM", kv_heads=2, tied=False)
    for tp in (1, 4):
        target, drafter = models(cfg, tp)
        engine = Engine(target, drafter, max_num_reqs=2, max_num_tokens=16, page_size=8)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=10)) for p in PROMPTS]
        while engine.has_unfinished():
            engine.step()
        out[f"engine/{tp}"] = [engine.output(i) for i in ids]
        sampled = generate(target, drafter, PROMPTS, max_new_tokens=10, temperature=0.9, seed=[3, 4])
        out[f"sampled/{tp}"] = sampled.token_ids
    return out


def pallas() -> dict:
    """Greedy tokens with the Pallas attention, heads and norm kernels (interpret mode) at TP 2,
    the attention and heads per shard under shard_map, against the jnp references at TP 1."""
    cfg = target_config("Qwen3ForCausalLM", kv_heads=2, tied=False)
    kernels = {1: Kernels("reference", "reference", "reference", "reference"),
               2: Kernels(attention="pallas", layout="reference", norm="pallas", heads="pallas")}
    return {str(tp): generate(*models(cfg, tp), PROMPTS, max_new_tokens=6, kernels=kernels[tp]).token_ids
            for tp in (1, 2)}


def collectives(text: str) -> list[tuple[str, list[list[int]]]]:
    """(kind, shapes of its operands) of each all-reduce / all-gather / all-to-all /
    collective-permute / reduce-scatter in compiled HLO text (a combined one has several)."""
    found = []
    for line in text.splitlines():
        match = re.search(r"= (.+?) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(",
                          line)
        if match:
            shapes = [[int(d) for d in dims.split(",") if d] for dims in re.findall(r"\w+\[([\d,]*)\]", match.group(1))]
            found.append((match.group(2), shapes))
    return found


def hlo() -> dict:
    """Collectives of the compiled Engine step at TP 4 (greedy; the target alone, and with the
    drafter), and per-device parameter bytes against a one-device model's (norms aside; kv
    heads as many as the shards, so none is repeated)."""
    cfg = target_config("LlamaForCausalLM", kv_heads=8, tied=False)
    out = {"layers": cfg.num_layers, "vocab": cfg.vocab_size}
    target, drafter = models(cfg, 4, drafter_kv_heads=4)
    for name, pair in (("target", (target, None)), ("cycle", (target, drafter))):
        engine = Engine(*pair, max_num_reqs=2, max_num_tokens=16, page_size=8)
        out[name] = collectives(engine._executable(Program(rows=2, tokens=16, greedy=True)).as_text())
    one_device = models(cfg, 1, drafter_kv_heads=4)
    for model, single in zip((target, drafter), one_device):
        name = model.cfg.kind
        placed, whole = (dict(nnx.to_flat_state(nnx.state(m, nnx.Param))) for m in (model, single))
        unsplit = [path for path in whole if path[-2].endswith("norm")]
        out[f"{name}/per_device_bytes"] = sum(placed[path].get_value().addressable_shards[0].data.nbytes
                                              for path in placed if path not in unsplit)
        out[f"{name}/total_bytes"] = sum(whole[path].get_value().nbytes for path in whole if path not in unsplit)
    return out


def train() -> dict:
    """Losses of 4 float32 drafter train steps on the same random batches of 8 sequences, on
    one device and data-parallel over 4."""
    from dflash_jax.train.step import Hyperparams, drafter_params, make_train_step

    target, drafter = models(target_config("Qwen3ForCausalLM", kv_heads=2, tied=False), 1)
    target_graph, target_state = nnx.split(target)
    hp = Hyperparams(total_steps=4, learning_rate=3e-3, warmup_ratio=0.0, max_anchors=4, compute_dtype="float32")
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 127, (8, 16)).astype(np.int32), np.arange(16)[None].repeat(8, 0) >= 4)
               for _ in range(hp.total_steps)]
    out = {}
    for data in (1, 4):
        mesh = make_mesh(1, data) if data > 1 else None
        optimizer, step = make_train_step(drafter.cfg, target_graph, hp, mesh)
        params = drafter_params(drafter)
        opt_state = optimizer.init(params)
        if mesh is not None:
            params, opt_state, state = jax.device_put((params, opt_state, target_state),
                                                      jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        else:
            state = target_state
        losses = []
        for index, (token_ids, loss_mask) in enumerate(batches):
            params, opt_state, metrics = step(params, opt_state, state, token_ids, loss_mask, index)
            losses.append(float(metrics["loss"]))
        out[str(data)] = losses
    return out


def quantized() -> dict:
    """Greedy tokens of the Qwen3 target with 8-bit weights (int8 per output channel; fp8 per
    channel and block of 16 input rows) at TP 1 and 4, and its autoregressive tokens at TP 1;
    and at TP 4 from a copy holding its kernels [out, in] (one GPU's layout), placed by
    `shard_model`; a Qwen3.5 target's and a Qwen3-MoE target's (int8 per 16 rows) at TP 2 and
    autoregressive at TP 1."""
    from dflash_jax.models import quantize_model
    from dflash_jax.placement import shard_model
    from dflash_jax.quantization import WeightQuantization, to_output_major

    out = {}
    cfg = target_config("Qwen3ForCausalLM", kv_heads=2, tied=False)
    float_target, drafter = models(cfg, 1)
    for name, quantization in (("int8", WeightQuantization("int8")), ("fp8/16", WeightQuantization("fp8", 16))):
        target = quantize_model(float_target, quantization)
        params = jax.device_get(nnx.to_pure_dict(nnx.state(target, nnx.Param)))
        out[f"{name}/ar"] = generate_autoregressive(target, PROMPTS, max_new_tokens=10).token_ids
        for tp in (1, 4):
            placed = place_model(target.cfg, jnp.float32, params, make_mesh(tp, 1) if tp > 1 else None)
            out[f"{name}/{tp}"] = generate(placed, models(cfg, tp)[1], PROMPTS, max_new_tokens=10).token_ids
        output_major = quantize_model(float_target, quantization)
        to_output_major(output_major)
        placed = shard_model(output_major, make_mesh(4, 1))
        out[f"{name}/4/output-major"] = generate(placed, models(cfg, 4)[1], PROMPTS, max_new_tokens=10).token_ids
    hybrid = parse_config(QWEN3_5)  # its gated-delta-net layer's products 8-bit too
    target = quantize_model(models(hybrid, 1)[0], WeightQuantization("int8", 16))
    out["qwen3_5/ar"] = generate_autoregressive(target, PROMPTS, max_new_tokens=10).token_ids
    placed = shard_model(target, make_mesh(2, 1))
    out["qwen3_5/2"] = generate(placed, models(hybrid, 2)[1], PROMPTS, max_new_tokens=10).token_ids
    moe = parse_config(QWEN3_MOE)  # its experts 8-bit, their scales split over "model" with them
    target = quantize_model(models(moe, 1)[0], WeightQuantization("int8", 16))
    out["moe/ar"] = generate_autoregressive(target, PROMPTS, max_new_tokens=10).token_ids
    placed = shard_model(target, make_mesh(2, 1))
    out["moe/2"] = generate(placed, models(moe, 2)[1], PROMPTS, max_new_tokens=10).token_ids
    out["moe/2/scale-spec"] = list(placed.layers[0].mlp.gate_up_scale[...].sharding.spec)
    return out


QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=128,
    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True,
    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
)


def moe() -> dict:
    """Greedy tokens of a Qwen3-MoE target (8 experts, top 2; layer 1 dense) at TP 1, 2 and 4
    (experts split over "model") and its autoregressive tokens at TP 1; where its experts live;
    the same for a gpt-oss target (a windowed layer, sinks, biases) at TP 1 and 4."""
    cfg = parse_config(QWEN3_MOE)
    gpt_oss = parse_config(dict(
        architectures=["GptOssForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=32,
        num_local_experts=8, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
        sliding_window=6, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ))
    out = {"ar": generate_autoregressive(models(cfg, 1)[0], PROMPTS, max_new_tokens=10).token_ids}
    for tp in (1, 2, 4):
        target, drafter = models(cfg, tp)
        spec = generate(target, drafter, PROMPTS, max_new_tokens=10)
        out[str(tp)] = [spec.token_ids, spec.accepted_lengths]
        out[f"{tp}/spec"] = list(target.layers[0].mlp.gate_up[...].sharding.spec) if tp > 1 else None
    out["gpt-oss/ar"] = generate_autoregressive(models(gpt_oss, 1)[0], PROMPTS, max_new_tokens=10).token_ids
    for tp in (1, 4):  # sinks split by head with the heads, windows per layer
        out[f"gpt-oss/{tp}"] = generate(*models(gpt_oss, tp), PROMPTS, max_new_tokens=10).token_ids
    return out


def dflash2() -> dict:
    """A DFlash 2 drafter's greedy tokens and accepted lengths at TP 1, 2 and 4 (its
    convolutions and selector replicated, its attention split by heads), the autoregressive
    tokens, and seeded sampled tokens at TP 1 and 4."""
    cfg = target_config("Qwen3ForCausalLM", kv_heads=2, tied=False)
    out = {"ar": generate_autoregressive(models(cfg, 1)[0], PROMPTS, max_new_tokens=12).token_ids}
    for tp in (1, 2, 4):
        target, drafter = models(cfg, tp, drafter_cfg=dflash2_drafter_config())
        spec = generate(target, drafter, PROMPTS, max_new_tokens=12)
        out[str(tp)] = [spec.token_ids, spec.accepted_lengths]
        if tp != 2:
            out[f"sampled/{tp}"] = generate(target, drafter, PROMPTS, max_new_tokens=10, temperature=0.9,
                                            seed=[3, 4]).token_ids
    return out


def qwen3_5() -> dict:
    """Greedy tokens and accepted lengths of a Qwen3.5 target (a gated-delta-net layer, then a
    gated attention layer) at TP 1, 2 and 4 (at 2 also with the Pallas rule, and in one-token
    steps fused with its convolution), its autoregressive tokens at TP 1, and the
    devices each holds a slice of the linear-attention heads' parameters and state on; a long
    prompt's tokens (its prefill in chunks) at TP 1 and 2; heads too few to split in the Engine at
    TP 4 (their state whole on every device, step after step); the greedy tokens of its MoE
    variant at TP 1 and 2."""
    cfg = parse_config(QWEN3_5)
    out = {"ar": generate_autoregressive(models(cfg, 1)[0], PROMPTS, max_new_tokens=12).token_ids}
    for tp in (1, 2, 4):
        target, drafter = models(cfg, tp)
        spec = generate(target, drafter, PROMPTS, max_new_tokens=12)
        out[str(tp)] = [spec.token_ids, spec.accepted_lengths]
        if tp == 2:  # the Pallas rule (interpret mode) once per shard of the heads
            out["pallas 2"] = generate(target, drafter, PROMPTS, max_new_tokens=12,
                                       kernels=Kernels(recurrence="pallas")).token_ids
            # one-token steps through the fused rule per shard (the GPU default)
            out["fused decode 2"] = generate_autoregressive(target, PROMPTS, max_new_tokens=12,
                                                            kernels=Kernels(recurrence="fused_decode")).token_ids
            out["engine 2"] = _shared_prefix_engine(target, drafter)
        mixer = target.layers[0].linear_attn
        state = RecurrentState.zeros(target.cfg, 2, target.dtype, target.mesh)
        out[f"split {tp}"] = [len({shard.data.shape for shard in x.addressable_shards}) == 1
                              and x.addressable_shards[0].data.shape != x.shape
                              for x in (mixer.in_proj_qkv.kernel[...], mixer.out_proj.kernel[...],
                                        state.delta[0], state.history[0])]
    long_prompt = [[(7 * i) % 120 + 3 for i in range(100)]]  # prefilled in chunks of 64 tokens
    out["long"] = [generate(*models(cfg, tp), long_prompt, max_new_tokens=8, kernels=Kernels(recurrence=rule))
                   .token_ids for tp, rule in ((1, "reference"), (2, "reference"), (2, "pallas"))]
    few = parse_config({**QWEN3_5, "linear_num_key_heads": 2, "linear_num_value_heads": 2})  # whole at TP 4
    out["few heads"] = _shared_prefix_engine(*models(few, 4), reference=models(few, 1)[0])
    moe = parse_config({**QWEN3_5, "architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48})
    out["moe"] = [generate(*models(moe, tp), PROMPTS, max_new_tokens=12).token_ids for tp in (1, 2)]
    return out


def _shared_prefix_engine(target, drafter, reference=None) -> list:
    """Engine tokens of a prompt, then of two sharing its first 16 tokens (prefix caching
    restores the state saved there), and each prompt's autoregressive tokens (by `reference`,
    a one-device copy of the target, if given)."""
    first = [(7 * i + 3) % 120 for i in range(19)]
    later = [first[:16] + [5, 6, 7], first[:17] + [9]]
    engine = Engine(target, drafter, max_num_reqs=2, max_num_tokens=16, page_size=8)
    ids = [engine.add_request(first, SamplingParams(max_new_tokens=8))]
    while engine.has_unfinished():
        engine.step()
    ids += [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in later]
    while engine.has_unfinished():
        engine.step()
    return [[engine.output(i) for i in ids], [engine.stats(i).num_cached_tokens for i in ids],
            generate_autoregressive(reference or target, [first] + later, max_new_tokens=8).token_ids]


def save(folder: str) -> dict:
    """The Qwen3 target and the drafter as converted (orbax) folders under `folder`."""
    from dflash_jax.checkpoint import save_checkpoint
    from dflash_jax.formats.hf_config import to_hf_config

    target, drafter = models(target_config("Qwen3ForCausalLM", kv_heads=2, tied=False), 1)
    for name, model in (("target", target), ("drafter", drafter)):
        save_checkpoint(model, to_hf_config(model.cfg), os.path.join(folder, name))
    return {}


def cli(*argv: str) -> dict:
    """`dflash-jax generate ARGV` in this process; its exit status (tokens go to stdout)."""
    from dflash_jax.cli import main

    return {"status": main(["generate", *argv])}


CASES = {"dflash2": dflash2, "qwen3_5": qwen3_5, "greedy": greedy, "quantized": quantized, "moe": moe, "engine_and_sampling": engine_and_sampling, "hlo": hlo, "pallas": pallas, "save": save, "cli": cli, "train": train}

if __name__ == "__main__":
    print(json.dumps(CASES[sys.argv[1]](*sys.argv[2:])))
