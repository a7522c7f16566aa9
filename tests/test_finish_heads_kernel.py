"""The fused q/k norm + RoPE + K/V cache write kernel (interpret mode on CPU; compiled on a
GPU) against its jnp reference and a float64 numpy oracle, and the runtime's greedy tokens
unchanged when it finishes every layer's heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dflash_jax
from conftest import randomize, save_hf
from dflash_jax.kernels import Kernels
from dflash_jax.models import Drafter
from dflash_jax.train.init import new_drafter_config
from pallas_kernels.finish_heads import finish_heads_pallas, finish_heads_reference
from test_generate import PROMPTS, biased_target

EPS = 1e-6
# (query heads, kv heads, head_dim[, rotary pairs]): grouped heads, SmolLM2's (not powers of
# two), a head_dim (12) that pads to a power of two, and partial rotary (Qwen3.5 rotates a
# quarter of each head: 4 of 16 pairs here; 3 of 6 in a padded head); the GPU test adds
# Qwen3-8B's (32, 8, 128) and Qwen3.5-9B's (16, 4, 256, 32)
SHAPES = [(4, 2, 16), (9, 3, 64), (3, 1, 12), (4, 2, 32, 4), (3, 1, 12, 3)]


def inputs(num_heads, num_kv_heads, head_dim, rotary_pairs=None, *, dtype, qk_norm, seed=0, num_tokens=5,
           num_slots=24):
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.normal(size=(num_tokens, num_heads + 2 * num_kv_heads, head_dim)) * 3, dtype)
    rotary = 2 * (rotary_pairs or head_dim // 2)
    angles = rng.integers(0, 5000, num_tokens)[:, None] / 10000 ** (np.arange(0, rotary, 2) / rotary)
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    weights = tuple(jnp.asarray(1 + 0.3 * rng.normal(size=head_dim), dtype) for _ in range(2)) if qk_norm else (None, None)
    slots = jnp.asarray(rng.permutation(num_slots)[:num_tokens], jnp.int32).at[1].set(-1)  # token 1: padding
    caches = tuple(jnp.asarray(rng.normal(size=(num_slots, num_kv_heads, head_dim)), dtype) for _ in range(2))
    return (qkv, cos, sin, *weights, EPS, slots, *caches)


def oracle(qkv, cos, sin, q_weight, k_weight, eps, slots, k_cache, v_cache, *, num_heads):
    """float64 numpy: norm, rotate, scatter; no intermediate rounding."""
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    x, cos, sin = f64(qkv), f64(cos)[:, None], f64(sin)[:, None]
    k = (x.shape[1] - num_heads) // 2
    q, key, value = x[:, :num_heads], x[:, num_heads : num_heads + k], x[:, num_heads + k :]
    if q_weight is not None:
        q, key = (f64(w) * h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) for h, w in ((q, q_weight), (key, k_weight)))
    z = cos.shape[-1]  # rotary pairs: dims past 2z pass through

    def rotate(h):
        a, b = h[..., :z], h[..., z: 2 * z]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin, h[..., 2 * z:]], -1)

    k_cache, v_cache = f64(k_cache).copy(), f64(v_cache).copy()
    slots = np.asarray(slots)
    k_cache[slots[slots >= 0]], v_cache[slots[slots >= 0]] = rotate(key)[slots >= 0], value[slots >= 0]
    return rotate(q), k_cache, v_cache


def check(got, args, num_heads, dtype):
    ref = jax.jit(finish_heads_reference, static_argnames="num_heads")(*args, num_heads=num_heads)
    step = float(jnp.finfo(dtype).eps)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        scale = np.abs(np.asarray(r, np.float32)).max()
        # the same steps; only the order of the float32 sum of squares may differ
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), atol=2 * step * scale)
    tol = dict(float32=1e-5, bfloat16=3e-2)[dtype]
    for g, want in zip(got, oracle(*args, num_heads=num_heads)):
        np.testing.assert_allclose(np.asarray(g, np.float64), want, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_kernel_matches_reference_and_oracle(shape, dtype, qk_norm):
    args = inputs(*shape, dtype=dtype, qk_norm=qk_norm)
    got = finish_heads_pallas(*args, num_heads=shape[0], interpret=True)
    check(got, args, shape[0], dtype)
    slots = np.asarray(args[6])
    untouched = np.setdiff1d(np.arange(24), slots[slots >= 0])
    for cache, before in zip(got[1:], args[7:]):  # rows not written keep their values exactly
        np.testing.assert_array_equal(np.asarray(cache)[untouched], np.asarray(before)[untouched])


def test_rejects_heads_that_do_not_fit_the_caches():
    args = inputs(4, 2, 16, dtype="float32", qk_norm=True)
    with pytest.raises(ValueError, match="does not fit 5 query heads"):
        finish_heads_pallas(*args, num_heads=5, interpret=True)
    wide = jnp.ones((args[1].shape[0], 9), jnp.float32)
    with pytest.raises(ValueError, match="a rotary table of 9 pairs does not fit heads of 16 dims"):
        finish_heads_pallas(args[0], wide, wide, *args[3:], num_heads=4, interpret=True)
    with pytest.raises(ValueError, match="both q/k norm weights"):
        finish_heads_pallas(*args[:4], None, *args[5:], num_heads=4, interpret=True)


def test_kernel_choice_refuses_unknown_values():
    with pytest.raises(ValueError, match="the heads kernel must be one of auto, reference, pallas"):
        Kernels(heads="cuda")
    assert Kernels(heads="reference").finish_heads is finish_heads_reference
    assert Kernels(heads="pallas").finish_heads is finish_heads_pallas
    with pytest.raises(ValueError, match="still 'auto'"):
        Kernels().finish_heads


@pytest.mark.slow
def test_fused_heads_keep_greedy_tokens(tmp_path):
    """Every layer of the target and drafter finishing its heads through the kernel (interpret
    mode) gives the reference path's greedy tokens and accepted lengths."""
    target = dflash_jax.load_target(save_hf(biased_target(), tmp_path / "target"))
    drafter = randomize(Drafter(new_drafter_config(target.cfg, mask_token_id=95, num_layers=2, block_size=8,
                                                   intermediate_size=64), rngs=nnx.Rngs(1)), seed=1)
    results = {}
    for impl in ("reference", "pallas"):
        kernels = Kernels(heads=impl)  # part of each program's jit key: no cache to clear
        spec = dflash_jax.generate(target, drafter, PROMPTS[:2], max_new_tokens=12, block_size=5, kernels=kernels)
        ar = dflash_jax.generate_autoregressive(target, PROMPTS[:2], max_new_tokens=12, kernels=kernels)
        results[impl] = (spec.token_ids, spec.accepted_lengths, ar.token_ids)
    assert results["pallas"] == results["reference"]
    assert results["pallas"][0] == results["pallas"][2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(32, 8, 128), (16, 4, 256, 32)], ids=["qwen3-8b", "qwen3_5-9b"])
def test_kernel_lowers_to_triton_for_a_gpu_from_any_host(dtype, shape):
    """Qwen3-8B's heads (32 query, 8 kv, 128 wide) and Qwen3.5-9B's (a quarter rotated) at 300
    tokens."""
    from conftest import triton_calls_for_cuda

    qkv, cos, sin, q_weight, k_weight, eps, *rest = inputs(*shape, dtype=dtype, qk_norm=True, num_tokens=300,
                                                           num_slots=512)
    kernel = lambda *a: finish_heads_pallas(*a[:5], eps, *a[5:], num_heads=shape[0], interpret=False)  # noqa: E731
    assert triton_calls_for_cuda(kernel, qkv, cos, sin, q_weight, k_weight, *rest) == 1


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_kernel_on_gpu(dtype):
    for shape, num_tokens in [(s, 5) for s in SHAPES] + [((32, 8, 128), 1), ((32, 8, 128), 300), ((16, 4, 256, 32), 17)]:
        for qk_norm in (True, False):
            args = inputs(*shape, dtype=dtype, qk_norm=qk_norm, num_tokens=num_tokens, num_slots=512)
            kernel = jax.jit(lambda *a, n=shape[0]: finish_heads_pallas(*a[:5], EPS, *a[6:], num_heads=n))
            got = kernel(*args)  # eps stays a Python float (a traced one would be a captured constant)
            check(got, args, shape[0], dtype)
