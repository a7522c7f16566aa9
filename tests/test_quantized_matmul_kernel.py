"""The 8-bit product kernel (interpret mode on CPU; compiled on a GPU) against its jnp
reference and a float64 numpy oracle of the dequantized weight; each row computed alike
whatever rows share its call; and the choice `Kernels.quantized` makes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.kernels import Kernels
from dflash_jax.quantization import WeightQuantization, quantize
from pallas_kernels.quantized_matmul import (
    Tiling, default_tiling, output_major_tiling, quantized_matmul_pallas, quantized_matmul_reference,
)


def weight(K, N, weights, block_in, seed=0):
    w = np.random.default_rng(seed).normal(size=(K, N)).astype(np.float32) * 0.05
    return quantize(w, WeightQuantization(weights, block_in))


def oracle(x, values, scales, block_in):
    scales = np.asarray(scales, np.float64)
    if block_in is not None:
        scales = np.repeat(scales, block_in, axis=0)[: values.shape[0]]
    return np.asarray(x, np.float64) @ (np.asarray(values.astype(jnp.float32), np.float64) * scales)


CASES = [  # rows, K, N, weights, block_in
    (1, 256, 128, "int8", None),
    (5, 576, 960, "int8", 128),    # SmolLM2's width: 64-row steps inside 128-row blocks, 64 columns
    (16, 512, 256, "fp8", 128),
    (70, 1024, 256, "fp8", None),  # more rows than one program takes
    (3, 4096, 128, "int8", None),  # split over the input rows
    (2, 112, 96, "int8", 48),      # 16-row steps, blocks of 48 with a short last one
]


@pytest.mark.parametrize("rows,K,N,weights,block_in", CASES)
def test_kernel_matches_reference_and_oracle(rows, K, N, weights, block_in):
    values, scales = weight(K, N, weights, block_in)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(rows, K)), jnp.float32)
    expected = oracle(x, values, scales, block_in)
    got = quantized_matmul_pallas(x, values, scales, block_in, interpret=True)
    transposed = quantized_matmul_pallas(x, values.T, scales, block_in, interpret=True, transposed=True)
    reference = quantized_matmul_reference(x, values, scales, block_in)
    assert got.shape == transposed.shape == (rows, N) and got.dtype == jnp.float32
    scale = np.abs(expected).max()
    np.testing.assert_allclose(np.asarray(got), expected, atol=2e-6 * scale * np.sqrt(K / 256))
    np.testing.assert_allclose(np.asarray(transposed), expected, atol=2e-6 * scale * np.sqrt(K / 256))
    np.testing.assert_allclose(np.asarray(reference), expected, atol=2e-6 * scale * np.sqrt(K / 256))


def test_bfloat16_rows_and_leading_axes():
    values, scales = weight(512, 256, "int8", 128)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 512)), jnp.bfloat16)
    got = quantized_matmul_pallas(x, values, scales, 128, interpret=True)
    assert got.shape == (2, 3, 256) and got.dtype == jnp.bfloat16
    expected = oracle(np.asarray(x, np.float32).reshape(6, 512), values, scales, 128).reshape(2, 3, 256)
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("block_in,K", [(None, 1024), (128, 1024), (None, 4096)])
def test_a_row_is_computed_alike_alone_or_in_a_block(block_in, K, transposed):
    """A verify block's rows equal what single-row calls compute, bit for bit (held [N, K],
    the block of 24 rows takes wider column blocks than one row; K = 4096: eight splits
    summed)."""
    values, scales = weight(K, 256, "int8", block_in)
    values = values.T if transposed else values
    x = jnp.asarray(np.random.default_rng(3).normal(size=(24, K)), jnp.float32)
    block = quantized_matmul_pallas(x, values, scales, block_in, interpret=True, transposed=transposed)
    for i in (0, 7, 23):
        alone = quantized_matmul_pallas(x[i:i + 1], values, scales, block_in, interpret=True, transposed=transposed)
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(block[i]))


def test_the_reference_computes_a_bfloat16_row_alike_in_any_block():
    """The CPU path's product, as the models run it (the library's `dot_general`, bfloat16,
    fused with a residual add): the rows of a 12-row call equal 1- and 3-row calls bit for bit,
    blocks of 128 input rows with a short last one."""
    from dflash_jax.layers import dot_general

    values, scales = weight(200, 600, "int8", 128)
    rng = np.random.default_rng(4)
    x, residual = (jnp.asarray(rng.normal(size=(12, n)), jnp.bfloat16) for n in (200, 600))
    step = jax.jit(lambda x, r: quantized_matmul_reference(x, values, scales, 128, dot_general) + r)
    block = np.asarray(step(x, residual), np.float32)
    for rows in (1, 3):
        np.testing.assert_array_equal(np.asarray(step(x[:rows], residual[:rows]), np.float32), block[:rows])


def test_tilings():
    # Qwen3-8B's matrices: 128 x 128 tiles, splits bringing the programs near two per H200 SM
    assert default_tiling(4096, 6144, 128) == Tiling(128, 128, 4)
    assert default_tiling(12288, 4096, None) == Tiling(128, 128, 8)
    assert default_tiling(4096, 24576, 128) == Tiling(128, 128, 1)
    assert default_tiling(576, 1536, 128) == Tiling(64, 128, 1)  # nine steps: no even split
    assert default_tiling(100, 128, None) is None  # no 16-row step divides 100: the reference computes it
    # held [N, K]: 64 columns a program up to 16 rows, the splits of (K, N) at any rows
    assert output_major_tiling(4096, 24576, 128, 16) == Tiling(128, 64, 1)
    assert output_major_tiling(12288, 4096, 128, 1) == Tiling(128, 64, 8)
    assert output_major_tiling(12288, 4096, 128, 17) == default_tiling(12288, 4096, 128)
    values, scales = weight(100, 128, "int8", None)
    x = jnp.ones((2, 100), jnp.float32)
    np.testing.assert_array_equal(np.asarray(quantized_matmul_pallas(x, values, scales, None, interpret=True)),
                                  np.asarray(quantized_matmul_reference(x, values, scales, None)))
    with pytest.raises(ValueError, match="does not divide"):
        quantized_matmul_pallas(x, values, scales, None, tiling=Tiling(64, 128, 1), interpret=True)


def every_code(weights):
    """All 256 8-bit codes as int8 or float8_e4m3fn, and which of them are finite."""
    codes = jnp.asarray(np.arange(256, dtype=np.uint8).view(np.int8))
    if weights == "int8":
        return codes, np.ones(256, bool)
    values = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    return values, np.isfinite(np.asarray(values.astype(jnp.float32)))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype,block_in", [("int8", None), ("int8", 128), ("float8_e4m3fn", 128)])
def test_kernel_lowers_to_triton_for_a_gpu_from_any_host(dtype, block_in, transposed):
    """Qwen3-8B's gate and up product (4096 -> 2 x 12288) at 1 and 64 rows."""
    from conftest import triton_calls_for_cuda

    K, N = 4096, 24576
    values = jax.ShapeDtypeStruct((N, K) if transposed else (K, N), dtype)
    scales = jax.ShapeDtypeStruct((K // (block_in or K), N), jnp.float32)
    for rows in (1, 64):
        x = jax.ShapeDtypeStruct((rows, K), jnp.bfloat16)
        kernel = lambda *a: quantized_matmul_pallas(*a, block_in, transposed=transposed, interpret=False)  # noqa: E731
        assert triton_calls_for_cuda(kernel, x, values, scales) == 1


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("weights,block_in", [("int8", None), ("int8", 128), ("fp8", 128)])
def test_gpu_compiled_kernel_reads_every_code_exactly(weights, block_in, transposed):
    """Identity rows pick single weights out, so the compiled kernel's result must equal the
    reference's bit for bit (its conversion of every code exact); random rows within rounding."""
    values, finite = every_code(weights)
    K, N = 256, 256
    codes = jnp.where(jnp.asarray(finite), values, values[0])  # NaNs out: every row holds each other code
    values = codes[(np.arange(K)[:, None] + np.arange(N)[None, :]) % 256]
    rows = K // (block_in or K)
    scales = jnp.asarray(np.random.default_rng(5).uniform(0.5, 2.0, size=(rows, N)), jnp.float32)
    product = jax.jit(lambda x: quantized_matmul_pallas(x, values.T if transposed else values, scales, block_in,
                                                        transposed=transposed))
    x = jnp.eye(64, K, dtype=jnp.bfloat16)
    got = product(x)
    expected = quantized_matmul_reference(x, values, scales, block_in)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))
    x = jnp.asarray(np.random.default_rng(6).normal(size=(16, K)), jnp.bfloat16)
    got = product(x)
    expected = oracle(np.asarray(x, np.float32), values, scales, block_in)
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, rtol=2e-2, atol=1e-2 * np.abs(expected).max())


def test_kernels_choose_the_product(monkeypatch):
    assert Kernels().resolve().quantized == ("pallas_or_xla" if jax.default_backend() == "gpu" else "reference")
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    assert Kernels().resolve(mesh).quantized == "reference"  # a Pallas call XLA cannot partition
    for kernel in ("pallas", "pallas_or_xla"):
        with pytest.raises(ValueError, match="on a mesh use quantized=reference"):
            Kernels(quantized=kernel).resolve(mesh)
    with monkeypatch.context() as patched:
        patched.setattr(jax, "default_backend", lambda: "gpu")
        assert Kernels().resolve().quantized == "pallas_or_xla"
    assert Kernels.parse("quantized=pallas").quantized_matmul(jax.lax.dot_general) is quantized_matmul_pallas
    # pallas_or_xla: the kernel for 128-row blocks; per-column scales: the kernel for 2-64
    # tokens, the reference for one and for more than 64 (leading axes counted)
    product = Kernels(quantized="pallas_or_xla").quantized_matmul(jax.lax.dot_general)
    calls = []
    monkeypatch.setattr("dflash_jax.kernels.quantized_matmul_pallas", lambda *a, **k: calls.append(
        (a[0].shape[:-1], a[3])) or quantized_matmul_pallas(*a, **k, interpret=True))
    shapes = [(1,), (2,), (64,), (65,), (2, 40)]
    for lead in shapes:
        x = jnp.asarray(np.random.default_rng(len(lead)).normal(size=(*lead, 512)), jnp.float32)
        for block_in in (128, None):
            values, scales = weight(512, 256, "int8", block_in)
            got = product(x, values.T, scales, block_in, transposed=True)
            expected = oracle(x.reshape(-1, 512), values, scales, block_in).reshape(*lead, 256)
            np.testing.assert_allclose(np.asarray(got), expected, atol=2e-6 * np.abs(got).max() * 2)
    assert calls == [((1,), 128), ((2,), 128), ((2,), None), ((64,), 128), ((64,), None), ((65,), 128),
                     ((2, 40), 128)]
    with pytest.raises(ValueError, match="the quantized kernel must be one of"):
        Kernels(quantized="triton")
