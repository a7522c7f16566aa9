"""Shared fixtures: tiny random HF targets and z-lab drafters, saved as HF folders."""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import dflash_jax.cli

# A CLI command run in this process would turn JAX's persistent compilation cache on for the
# rest of the suite, writing every later test's programs to the user's cache folder (and
# serializing executables that no test asked to keep). Commands run as subprocesses keep it.
dflash_jax.cli.enable_compile_cache = lambda folder: Path(folder)


def fast_compile_flags() -> tuple[str, ...]:
    """XLA flags that compile the suite's programs faster.

    The tiny models run in microseconds and compile in seconds. XLA CPU's code generation at
    optimization level 0 compiles them ~20% faster, and its older loop emitters in place of
    the fusion emitters ~25% faster again (`bench/LESSONS.md`). Code generation may reorder
    float operations (by an ulp): a test that compares two programs bit for bit where that
    matters pins its own flags (test_delta_rule_kernel). The second flag is offered to
    CPU-only installs alone: XLA refuses an unknown flag at start, and a CUDA build of another
    version need not know it."""
    cuda = any((d.metadata["Name"] or "").startswith("jax-cuda") for d in importlib.metadata.distributions())
    return ("--xla_backend_optimization_level=0",) + (() if cuda else ("--xla_cpu_use_fusion_emitters=false",))


# Set before any backend starts, so this process, its workers and the commands they run inherit
# them; the notebooks' kernels drop them (test_notebooks).
FAST_COMPILE_FLAGS = fast_compile_flags()
_given_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_given_flags + [f for f in FAST_COMPILE_FLAGS if f not in _given_flags])

# Most of the suite's time is XLA compiling the same few tiny programs again: in the other
# pytest-xdist worker, in the next module (whose models have the same shapes), and after
# `release_compiled_programs`. One persistent compilation cache for the run, in a temporary
# folder the first process makes and the workers it starts inherit, compiles each once.
# Only this process uses it: commands run as subprocesses keep their own (their tests check it).
TEST_COMPILE_CACHE_ENV = "DFLASH_JAX_TEST_COMPILE_CACHE"
OWNS_TEST_COMPILE_CACHE = TEST_COMPILE_CACHE_ENV not in os.environ
if OWNS_TEST_COMPILE_CACHE:
    os.environ[TEST_COMPILE_CACHE_ENV] = tempfile.mkdtemp(prefix="dflash-jax-test-xla-")


def pytest_configure(config):
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ[TEST_COMPILE_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


def pytest_unconfigure(config):
    if OWNS_TEST_COMPILE_CACHE:
        shutil.rmtree(os.environ.pop(TEST_COMPILE_CACHE_ENV), ignore_errors=True)


def release_compiled_programs() -> None:
    """Forget every compiled program no live object holds (jitted functions' and Engines')."""
    import jax

    from dflash_jax.step_program import clear_compiled_programs

    jax.clear_caches()
    clear_compiled_programs()
    gc.collect()


def memory_mappings() -> int:
    """This process's memory mappings (0 where /proc is absent)."""
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def max_memory_mappings() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530  # Linux's default


# XLA's CPU backend maps each compiled kernel's code into memory on its own (a step program of
# a tiny model: some hundred mappings), so a long run reaches the kernel's limit of mappings
# per process and the next compilation crashes. Programs are dropped well before that.
MAPPINGS_BEFORE_RELEASE = max_memory_mappings() // 2


@pytest.fixture(autouse=True, scope="module")
def release_each_modules_programs():
    """Drop each module's compiled programs when it ends: the next module's models differ."""
    yield
    release_compiled_programs()


@pytest.fixture(autouse=True)
def release_programs_before_the_mapping_limit():
    """Within a module, drop compiled programs once they hold half the mappings allowed."""
    yield
    if memory_mappings() > MAPPINGS_BEFORE_RELEASE:
        release_compiled_programs()


def randomize_norms(model: torch.nn.Module, seed: int = 0) -> None:
    """Random init leaves RMSNorm weights at 1; perturb them so a misplaced norm shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))


def randomize(model, seed: int):
    """An NNX model with every parameter (norms included) shifted by noise, so a misplaced
    one shows; random init alone leaves norms at 1 and biases at 0."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))


def make_hf_target(kind: str = "qwen3", *, seed: int = 0, **overrides):
    """A tiny random transformers Qwen3 or Llama causal LM in float32, eval mode."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if kind == "qwen3":
        config = transformers.Qwen3Config(**common)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    randomize_norms(model, seed)
    return model.float().eval()


def drafter_config_dict(target_config: dict, **overrides) -> dict:
    """A z-lab DFlash-1 config.json for a tiny drafter of `target_config`'s target."""
    cfg = dict(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        vocab_size=target_config["vocab_size"],
        hidden_size=target_config["hidden_size"],
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=256,
        attention_bias=False,
        num_target_layers=target_config["num_hidden_layers"],
        dflash_config={"mask_token_id": target_config["vocab_size"] - 1, "block_size": 8},
    )
    cfg.update(overrides)
    return cfg


def make_zlab_drafter(config_dict: dict, *, seed: int = 0):
    """The z-lab reference DFlashDraftModel (dflash 0.1.0) with random float32 weights."""
    import transformers
    from dflash.model import DFlashDraftModel

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**{k: v for k, v in config_dict.items() if k != "architectures"})
    config.architectures = config_dict["architectures"]
    for key in ("layer_types", "sliding_window", "is_causal"):
        if key in config_dict:
            setattr(config, key, config_dict[key])
    model = DFlashDraftModel(config)
    randomize_norms(model, seed)
    return model.float().eval()


def save_hf(model, path, config_dict: dict | None = None, **save_kwargs) -> str:
    """save_pretrained, optionally replacing config.json with `config_dict` verbatim."""
    model.save_pretrained(path, **save_kwargs)
    if config_dict is not None:
        (path / "config.json").write_text(json.dumps(config_dict))
    return str(path)


def favour_two_tokens(hf, gen) -> None:
    """Scale a transformers model's LM head down and lift tokens 10 and 20 along random
    directions: greedy outputs turn repetitive and a random drafter's guesses often right."""
    with torch.no_grad():
        hf.lm_head.weight.mul_(0.05)
        for token in (10, 20):
            direction = torch.randn(hf.config.hidden_size, generator=gen)
            hf.lm_head.weight[token] += 6 * direction / direction.norm()


def converted_pair(hf, tmp, **dflash_config):
    """(the folder `hf` is saved in, the target `dflash-jax convert` makes of it, a random
    z-lab drafter for it with block 4 and `dflash_config`'s fields)."""
    import dflash_jax
    from dflash_jax.cli import main

    folder = save_hf(hf, tmp / "hf")
    assert main(["convert", folder, str(tmp / "converted")]) == 0
    config = drafter_config_dict(hf.config.to_dict(),
                                 dflash_config={"mask_token_id": 95, "block_size": 4, **dflash_config})
    drafter = dflash_jax.load_drafter(save_hf(make_zlab_drafter(config, seed=5), tmp / "drafter", config))
    return folder, dflash_jax.load_target(tmp / "converted"), drafter


def hf_greedy(hf, prompt, max_new_tokens, stop=None) -> list[int]:
    """transformers' greedy continuation of one prompt (its attention mask given: without one,
    transformers masks every prompt id equal to the pad id)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=stop, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_greedy_dflash_exact(hf, target, drafter, prompts, max_new_tokens=16):
    """Greedy autoregressive decoding equals transformers' greedy `generate`, and DFlash (block
    4, blocks partly accepted) equals it in `generate` and in the Engine."""
    import dflash_jax

    ar = dflash_jax.generate_autoregressive(target, prompts, max_new_tokens=max_new_tokens)
    assert ar.token_ids == [hf_greedy(hf, prompt, max_new_tokens) for prompt in prompts]
    spec = dflash_jax.generate(target, drafter, prompts, max_new_tokens=max_new_tokens, block_size=4)
    assert spec.token_ids == ar.token_ids
    lengths = [n for per_request in spec.accepted_lengths for n in per_request]
    assert any(n > 1 for n in lengths) and any(n < 4 for n in lengths)  # blocks partly accepted
    assert engine_outputs(target, drafter, prompts, max_new_tokens) == ar.token_ids


def engine_outputs(target, drafter, prompts, max_new_tokens: int) -> list[list[int]]:
    """Greedy DFlash tokens of `prompts` through an Engine of 2 requests at a time (16 tokens a
    step: prompts are prefilled in chunks), block 4."""
    import dflash_jax

    engine = dflash_jax.Engine(target, drafter, max_num_reqs=2, max_num_tokens=16, block_size=4)
    ids = [engine.add_request(p, dflash_jax.SamplingParams(max_new_tokens=max_new_tokens)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.output(i) for i in ids]


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / max(np.max(np.abs(ref)), 1e-30))


def triton_calls_for_cuda(kernel, *arrays) -> int:
    """Triton calls in `kernel(*arrays)` lowered for a CUDA GPU from this host, no GPU needed:
    Pallas accepting every load, product and loop of its kernels (Triton's own compile and the
    results are the GPU tests' to check). Arrays may be `jax.ShapeDtypeStruct`s."""
    import jax
    from jax import export

    target = "__gpu$xla.gpu.triton"
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    lowered = export.export(jax.jit(kernel), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(*shapes)
    return lowered.mlir_module().count(f"custom_call @{target}")


@pytest.fixture
def tmp_models(tmp_path):
    return tmp_path


def chi_square_pvalue(counts, probs) -> float:
    """Pearson chi-square p-value of `counts` against `probs` (flat arrays of cells).

    Cells expected below 5 are pooled into one; any count outside the support gives 0.
    """
    import jax

    counts, probs = np.asarray(counts, np.float64).ravel(), np.asarray(probs, np.float64).ravel()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = counts.sum() * probs / probs.sum()
    small = (expected < 5) & (probs > 0)
    observed = np.append(counts[(probs > 0) & ~small], counts[small].sum())
    expected = np.append(expected[(probs > 0) & ~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    assert len(expected) >= 2, "too few cells for a chi-square test"
    stat = float(((observed - expected) ** 2 / expected).sum())
    return float(jax.scipy.special.gammaincc((len(expected) - 1) / 2, stat / 2))


def two_token_law_pvalue(target, prompt, token_ids) -> float:
    """Chi-square p-value of sampled two-token continuations `token_ids` of `prompt` against
    the target's own p(t1) p(t2 | t1) at temperature 1; the first tokens never drawn are one
    more cell, with no draws in it."""
    import jax

    import dflash_jax

    pairs = [tuple(tokens) for tokens in token_ids]
    first = np.asarray(jax.nn.softmax(dflash_jax.target_forward(target, prompt)[0][-1]))
    cells, probs = [], []
    for t1 in sorted({t1 for t1, _ in pairs}):
        second = np.asarray(jax.nn.softmax(dflash_jax.target_forward(target, prompt + [t1])[0][-1]))
        cells += [(t1, t2) for t2 in range(second.size)]
        probs += list(first[t1] * second)
    counts = [pairs.count(cell) for cell in cells]
    assert sum(counts) == len(pairs)
    return chi_square_pvalue(counts + [0], probs + [max(0.0, 1 - sum(probs))])


def fp8_blocks(w_OI: np.ndarray, block_out: int, block_in: int) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 values [O, I], float32 scales [ceil(O / block_out), ceil(I / block_in)]): each
    block scaled to e4m3's largest magnitude, as published FP8 checkpoints are."""
    from dflash_jax.quantization import WeightQuantization

    out, inp = w_OI.shape
    scale = np.ones((-(-out // block_out), -(-inp // block_in)), np.float32)
    for a in range(scale.shape[0]):
        for b in range(scale.shape[1]):
            largest = np.abs(w_OI[a * block_out:(a + 1) * block_out, b * block_in:(b + 1) * block_in]).max()
            scale[a, b] = largest / 448 if largest > 0 else 1
    return (w_OI / expanded_scales(scale, w_OI.shape, block_out, block_in)).astype(WeightQuantization("fp8").dtype), scale


def expanded_scales(scale: np.ndarray, shape: tuple[int, int], block_out: int, block_in: int) -> np.ndarray:
    """Block scales repeated over each block's entries of a weight of `shape`."""
    return np.repeat(np.repeat(scale, block_out, 0)[:shape[0]], block_in, 1)[:, :shape[1]]


def write_published_fp8(folder: Path, out: Path, reference: Path, layout: str, keep_float: tuple[str, ...] = ()) -> None:
    """The HF checkpoint in `folder` written to `out` as published FP8 checkpoints are: every
    2-D projection weight (`*_proj.weight`, Qwen3.5's `in_proj_*.weight`) in e4m3 with Qwen's 16 x 24 block
    `weight_scale_inv` ("qwen") or compressed-tensors' per-channel `weight_scale`, everything
    else (router, norms, embeddings, LM head) as it was; and to `reference` the float
    checkpoint of the weights those stand for (what a dequantizing reader must compute).
    `keep_float`: parts of module names left in float too, listed in the quantization config
    (its modules_to_not_convert, or compressed-tensors' ignore as `re:` patterns)."""
    from safetensors.torch import load_file, save_file

    tensors = {k: v for path in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(path).items()}
    dequantized = dict(tensors)
    projection = re.compile(r"(_proj|\.linear_attn\.in_proj_\w+)\.weight$")  # Qwen3.5's in_proj_qkv, _z, _b, _a too
    for name in [n for n, t in tensors.items() if projection.search(n) and t.dim() == 2
                 and not any(part in n for part in keep_float)]:
        w = tensors[name].float().numpy()
        block_out, block_in = (16, 24) if layout == "qwen" else (1, w.shape[1])
        values, scale = fp8_blocks(w, block_out, block_in)
        dequantized[name] = torch.from_numpy(values.astype(np.float32) * expanded_scales(scale, w.shape, block_out, block_in))
        tensors[name] = torch.from_numpy(values.astype(np.float32)).to(torch.float8_e4m3fn)
        tensors[name.removesuffix("weight") + ("weight_scale_inv" if layout == "qwen" else "weight_scale")] = (
            torch.from_numpy(scale))
    config = json.loads((Path(folder) / "config.json").read_text())
    for path, weights in ((out, tensors), (reference, dequantized)):
        path.mkdir()
        save_file(weights, path / "model.safetensors")
    (reference / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 24],
         "modules_to_not_convert": ["lm_head", *keep_float]} if layout == "qwen" else
        {"quant_method": "compressed-tensors", "ignore": ["lm_head", "re:.*mlp.gate$", *(f"re:.*{part}.*" for part in keep_float)],
         "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}})
    (out / "config.json").write_text(json.dumps(config))
