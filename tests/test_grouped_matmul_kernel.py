"""The grouped-expert product (pallas_kernels/grouped_matmul.py; compiled on a GPU, interpret
mode on CPU): the pairs' tile layout holds each routed pair once, in a tile of its own expert;
the kernel computes its jnp reference for several tilings; the experts' product through it
equals the `ragged_dot` reference for Qwen-style and gpt-oss-style experts, and a token's
output does not depend on the tokens beside it (bit for bit)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import ExpertsConfig
from dflash_jax.experts import experts_product
from dflash_jax.kernels import Kernels
from pallas_kernels.grouped_matmul import (
    expert_tiles, grouped_matmul_pallas, grouped_matmul_reference, grouped_tiling, pairs_tile_alone, tile_rows,
)
from pallas_kernels.quantized_matmul import Tiling


def routed_ids(tokens: int, num_experts: int, top_k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(num_experts)[:top_k] for _ in range(tokens)]).astype(np.int32)


@pytest.mark.parametrize("tokens,num_experts,top_k,block_m", [(1, 8, 2, 16), (2, 32, 4, 16), (13, 8, 2, 16),
                                                             (40, 4, 3, 16), (300, 16, 4, 64)])
def test_tiles_hold_each_routed_pair_once_with_its_expert(tokens, num_experts, top_k, block_m):
    ids = routed_ids(tokens, num_experts, top_k, seed=tokens)
    ids[0, 0] = num_experts  # another shard's expert: dropped
    flat = ids.reshape(-1)
    tiles = jax.tree.map(np.asarray, expert_tiles(jnp.asarray(flat), num_experts, block_m, top_k))
    P = ids.size
    routed = [p for p in range(P) if flat[p] < num_experts]
    filled = tiles.pair_GM[tiles.pair_GM < P]
    assert sorted(filled.tolist()) == routed
    assert (tiles.pair_GM.reshape(-1)[tiles.row_P[routed]] == routed).all()
    assert (tiles.row_P[flat >= num_experts] == tiles.pair_GM.size).all()
    for g, row in enumerate(tiles.pair_GM):
        pairs = row[row < P]
        assert tiles.used_G[g] == (len(pairs) > 0)
        assert (flat[pairs] == tiles.expert_G[g]).all()
    if pairs_tile_alone(P, top_k):
        assert len(tiles.pair_GM) == P and tiles.used_G.sum() == len(routed)
        return
    used = tiles.used_G.sum()
    assert tiles.used_G[:used].all() and not tiles.used_G[used:].any()  # the used tiles first
    counts = np.bincount(flat, minlength=num_experts + 1)[:num_experts]
    assert used == (-(-counts // block_m)).sum()  # no more tiles than each expert's rows need


@pytest.mark.parametrize("tokens", [1, 13])
def test_tiles_without_dropped_ids_are_the_checked_tiles(tokens):
    """`dropped_ids=False` (one device holds every expert) skips the checks, not the layout."""
    flat = jnp.asarray(routed_ids(tokens, 8, 2, seed=tokens).reshape(-1))
    checked, unchecked = (jax.tree.map(np.asarray, expert_tiles(flat, 8, 16, 2, dropped_ids=dropped))
                          for dropped in (True, False))
    for a, b in zip(jax.tree.leaves(checked), jax.tree.leaves(unchecked)):
        np.testing.assert_array_equal(a, b)


def test_tile_rows_grow_with_the_pairs_per_expert():
    assert tile_rows(8, 128) == 16 and tile_rows(128, 128) == 16
    assert tile_rows(16 * 1024, 128) == 64


@pytest.mark.parametrize("tiling", [None, Tiling(16, 32, 1), Tiling(16, 16, 2), Tiling(32, 64, 2)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_computes_its_reference(tiling, dtype):
    E, K, N, top_k = 6, 64, 64, 2
    ids = routed_ids(9, E, top_k, seed=1).reshape(-1)
    tiles = expert_tiles(jnp.asarray(ids), E, 16, top_k)
    key_x, key_w = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (*tiles.pair_GM.shape, K), jnp.float32).astype(dtype)
    weights = jax.random.normal(key_w, (E, K, N), jnp.float32).astype(dtype)
    got = grouped_matmul_pallas(x, weights, tiles, top_k=top_k, tiling=tiling)
    with jax.default_matmul_precision("highest"):  # a GPU's default float32 product is TF32
        want = grouped_matmul_reference(x.astype(jnp.float32), weights.astype(jnp.float32), tiles, top_k=top_k)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    assert not np.asarray(got)[~np.asarray(tiles.used_G)].any()  # unused tiles: zeros
    # token rows gathered into the tiles by the kernel: the product of the laid-out rows, bit for bit
    x_TK = jax.random.normal(key_x, (9, K), jnp.float32).astype(dtype)
    laid_out = jnp.take(x_TK, tiles.pair_GM // top_k, axis=0, mode="fill", fill_value=0)
    np.testing.assert_array_equal(grouped_matmul_pallas(x_TK, weights, tiles, top_k=top_k, tiling=tiling),
                                  grouped_matmul_pallas(laid_out, weights, tiles, top_k=top_k, tiling=tiling))
    np.testing.assert_array_equal(grouped_matmul_reference(x_TK, weights, tiles, top_k=top_k),
                                  grouped_matmul_reference(laid_out, weights, tiles, top_k=top_k))


@pytest.mark.parametrize("weights,block_in", [("int8", 32), ("int8", None), ("fp8", 32)])
@pytest.mark.parametrize("tokens", [1, 9])
def test_kernel_computes_its_reference_over_8_bit_experts(weights, block_in, tokens):
    """8-bit experts (values and float32 scales per column and block of input rows): the kernel
    over token rows against the dequantized reference, and against each expert's own
    dequantized float matrix."""
    from dflash_jax.quantization import WeightQuantization, dequantize, quantize

    E, K, N, top_k = 6, 64, 48, 2
    ids = routed_ids(tokens, E, top_k, seed=3).reshape(-1)
    tiles = expert_tiles(jnp.asarray(ids), E, 16, top_k)
    key_x, key_w = jax.random.split(jax.random.key(1))
    floats = jax.random.normal(key_w, (E, K, N), jnp.float32)
    values, scales = jax.vmap(lambda w: quantize(w, WeightQuantization(weights, block_in)))(floats)
    x = jax.random.normal(key_x, (tokens, K), jnp.float32)
    got = grouped_matmul_pallas(x, values, tiles, top_k=top_k, scales_ERN=scales, block_in=block_in,
                                tiling=Tiling(16, 16, 2))
    with jax.default_matmul_precision("highest"):
        want = grouped_matmul_reference(x, values, tiles, top_k=top_k, scales_ERN=scales, block_in=block_in)
        dense = jax.vmap(lambda v, s: dequantize(v, s, block_in, jnp.float32))(values, scales)
        floated = grouped_matmul_reference(x, dense, tiles, top_k=top_k)
    assert values.dtype.itemsize == 1
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(want), np.asarray(floated), rtol=1e-5, atol=1e-4)
    assert not np.asarray(got)[~np.asarray(tiles.used_G)].any()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("weights,block_in", [(None, None), ("int8", 128), ("fp8", 128), ("int8", None)])
@pytest.mark.parametrize("tokens", [1, 16])
def test_gpu_compiled_kernel_computes_its_reference(weights, block_in, tokens):
    """The compiled kernel (bf16 token rows; bf16 experts, or 8-bit ones with scales per 128
    input rows or per column) against the float32 reference, within bf16 rounding, at one token
    (a tile per pair) and 16 (pairs grouped by expert)."""
    from dflash_jax.quantization import WeightQuantization, quantize

    E, K, N, top_k = 16, 512, 384, 4
    ids = routed_ids(tokens, E, top_k, seed=7).reshape(-1)
    tiles = expert_tiles(jnp.asarray(ids), E, tile_rows(ids.size, E), top_k)
    key_x, key_w = jax.random.split(jax.random.key(2))
    floats = jax.random.normal(key_w, (E, K, N), jnp.float32) * 0.05
    if weights is None:
        values, scales = floats.astype(jnp.bfloat16), None
    else:
        values, scales = jax.vmap(lambda w: quantize(w, WeightQuantization(weights, block_in)))(floats)
    x = jax.random.normal(key_x, (tokens, K), jnp.float32).astype(jnp.bfloat16)
    got = jax.jit(lambda x, v, s: grouped_matmul_pallas(x, v, tiles, top_k=top_k, scales_ERN=s, block_in=block_in))(
        x, values, scales)
    with jax.default_matmul_precision("highest"):
        want = grouped_matmul_reference(x.astype(jnp.float32), values, tiles, top_k=top_k, scales_ERN=scales,
                                        block_in=block_in)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("eight_bit", [False, True])
@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize("matrix", ["gate_up", "down"])
def test_kernel_lowers_to_triton_for_a_gpu_from_any_host(tokens, matrix, eight_bit):
    """Qwen3-30B-A3B's experts (128, top 8; gate and up [2048, 1536] from token rows the kernel
    gathers, down [768, 2048] from rows laid out in tiles) at one token (a tile per pair) and 16
    (pairs grouped by expert), bf16 or FP8 in 128 x 128 blocks (the published layout), lower
    for CUDA to one Triton call."""
    from conftest import triton_calls_for_cuda

    E, top_k = 128, 8
    K, N = {"gate_up": (2048, 1536), "down": (768, 2048)}[matrix]

    def kernel(x_TK, ids_P, weights_EKN, *scales):
        P = ids_P.shape[0]
        tiles = expert_tiles(ids_P, E, tile_rows(P, E), top_k)
        if matrix == "down":  # laid out in tiles (empty rows: zeros)
            x_TK = jnp.take(x_TK, tiles.pair_GM // top_k, axis=0, mode="fill", fill_value=0)
        return grouped_matmul_pallas(x_TK, weights_EKN, tiles, top_k=top_k, interpret=False,
                                     scales_ERN=scales[0] if scales else None, block_in=128 if scales else None)

    arrays = [jax.ShapeDtypeStruct((tokens, K), jnp.bfloat16), jax.ShapeDtypeStruct((tokens * top_k,), jnp.int32),
              jax.ShapeDtypeStruct((E, K, N), jnp.float8_e4m3fn if eight_bit else jnp.bfloat16)]
    if eight_bit:
        arrays.append(jax.ShapeDtypeStruct((E, K // 128, N), jnp.float32))
    assert triton_calls_for_cuda(kernel, *arrays) == 1


def test_a_tiling_that_does_not_divide_is_refused():
    tiles = expert_tiles(jnp.zeros(2, jnp.int32), 2, 16, 1)
    with pytest.raises(ValueError, match="does not divide"):
        grouped_matmul_pallas(jnp.zeros((*tiles.pair_GM.shape, 48)), jnp.zeros((2, 48, 32)), tiles, top_k=1,
                              tiling=Tiling(32, 32, 1))


def test_tilings_depend_on_the_shape_and_top_k_only():
    assert grouped_tiling(2048, 1536, 8) == Tiling(128, 128, 2)
    assert grouped_tiling(768, 2048, 8) == Tiling(128, 128, 1)
    assert grouped_tiling(2880, 5760, 4) is not None and grouped_tiling(40, 64, 2) is None


QWEN = ExpertsConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True, layers=(0,))
GPT_OSS = ExpertsConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=False, layers=(0,),
                        softmax_after_top_k=True, bias=True, interleaved=True, swiglu_alpha=1.702, swiglu_limit=7.0)


ONE_OF_SIX = ExpertsConfig(num_experts=6, top_k=1, intermediate_size=32, norm_topk_prob=False, layers=(0,))


@pytest.mark.parametrize("experts,tokens", [(QWEN, 11), (QWEN, 70), (GPT_OSS, 11), (ONE_OF_SIX, 40)],
                         ids=["qwen3-moe", "qwen3-moe-tall-tiles", "gpt-oss", "top-1-of-6"])
def test_experts_product_through_the_kernel_equals_ragged_dot(experts, tokens):
    """At 70 tokens the tiles are 32 rows high (16 alone): a token's output stays its own."""
    E, D, inter = experts.num_experts, 64, experts.intermediate_size
    keys = jax.random.split(jax.random.key(1), 6)
    params = {"gate_up": jax.random.normal(keys[0], (E, D, 2 * inter)),
              "down": jax.random.normal(keys[1], (E, inter, D))}
    if experts.bias:
        params.update(gate_up_bias=jax.random.normal(keys[2], (E, 2 * inter)),
                      down_bias=jax.random.normal(keys[3], (E, D)))
    x = jax.random.normal(keys[4], (tokens, D))
    ids = jnp.asarray(routed_ids(tokens, E, experts.top_k, seed=2)).at[3, 0].set(E)  # one pair on another shard
    weights = jax.nn.softmax(jax.random.normal(keys[5], (tokens, experts.top_k)))
    kernel = Kernels(experts="pallas").grouped_matmul
    assert Kernels(experts="reference").grouped_matmul is None
    with jax.default_matmul_precision("highest"):
        want = experts_product(x, params, weights, ids, experts)
    got = experts_product(x, params, weights, ids, experts, kernel)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4 * float(jnp.abs(want).max()))
    for t in range(min(tokens, 12)):
        alone = experts_product(x[t:t + 1], params, weights[t:t + 1], ids[t:t + 1], experts, kernel)
        assert (np.asarray(alone[0]) == np.asarray(got[t])).all()  # a token's output is its own, bit for bit


def test_matrices_no_tile_fits_take_the_sorted_pairs():
    """A width with no power-of-two divisor of 16 or more: the kernel is not called."""
    E, D, inter = 4, 40, 24
    keys = jax.random.split(jax.random.key(2), 3)
    params = {"gate_up": jax.random.normal(keys[0], (E, D, 2 * inter)),
              "down": jax.random.normal(keys[1], (E, inter, D))}
    x, ids, weights = jax.random.normal(keys[2], (5, D)), jnp.asarray(routed_ids(5, E, 2, seed=3)), jnp.ones((5, 2)) / 2

    def refuses(*args, **kwargs):
        raise AssertionError("the kernel was called for matrices no tile fits")

    experts = ExpertsConfig(num_experts=E, top_k=2, intermediate_size=inter, norm_topk_prob=True, layers=(0,))
    np.testing.assert_array_equal(np.asarray(experts_product(x, params, weights, ids, experts, refuses)),
                                  np.asarray(experts_product(x, params, weights, ids, experts)))
