"""`layers.dot_general`: the models' products, with the CPU bfloat16 path (float32 result,
one row run as two) that makes bfloat16 decoding fast on XLA CPU; `converted_dot_general`,
the 8-bit layers' product without the kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.layers import converted_dot_general, dot_general, runs_as_two_rows

NN = (((1,), (0,)), ((), ()))   # [M, K] x [K, N]
NT = (((1,), (1,)), ((), ()))   # [M, K] x [N, K] (the tied LM head)


def bf16(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("dims", [NN, NT], ids=["NN", "NT"])
@pytest.mark.parametrize("result", [None, jnp.float32], ids=["bf16-result", "f32-result"])
def test_bf16_products_match_float32(rows, dims, result):
    rng = np.random.default_rng(rows)
    x, w = bf16(rng, rows, 48), bf16(rng, 48, 40) if dims == NN else bf16(rng, 40, 48)
    out = jax.jit(lambda x, w: dot_general(x, w, dims, preferred_element_type=result))(x, w)
    expect = jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), dims)
    assert out.shape == (rows, 40) and out.dtype == (result or jnp.bfloat16)
    # float32 accumulation, one rounding to the result's dtype at the end
    tol = 0 if result else 2.0 ** -8
    np.testing.assert_allclose(np.asarray(out, np.float32), expect, rtol=tol, atol=1e-5 if result else 2e-2)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU path; elsewhere lax.dot_general as is")
def test_one_bf16_row_runs_as_two_with_a_float32_result():
    """The HLO of a 1-row bf16 product on CPU: a 2-row product into float32 (XLA CPU's
    1-row and bf16-result products are ~10x slower there); float32 products are untouched."""
    x, w = jnp.ones((1, 48), jnp.bfloat16), jnp.ones((48, 40), jnp.bfloat16)
    hlo = jax.jit(lambda x, w: dot_general(x, w, NN)).lower(x, w).as_text()
    assert "tensor<2x40xf32>" in hlo and "tensor<1x40xbf16>" in hlo
    hlo32 = jax.jit(lambda x, w: dot_general(x, w, NN)).lower(x.astype(jnp.float32), w.astype(jnp.float32)).as_text()
    assert "tensor<2x40" not in hlo32 and "tensor<1x40xf32>" in hlo32


@pytest.mark.parametrize("shape, backend, dtype, expect", [
    ((4096, 2048), "gpu", jnp.bfloat16, True),    # Qwen3-30B-A3B o_proj: XLA's multiply + reduce otherwise
    ((2048, 128), "gpu", jnp.bfloat16, True),     # its router
    ((2048, 5120), "gpu", jnp.bfloat16, False),   # its qkv_proj: already a matrix kernel
    ((4096, 4096), "gpu", jnp.bfloat16, False),
    ((2880, 32), "gpu", jnp.bfloat16, False),     # gpt-oss's router: cuBLAS as two rows, slower than the reduce
    ((576, 576), "cpu", jnp.bfloat16, True),
    ((576, 576), "cpu", jnp.float32, False),
    ((576, 576), "tpu", jnp.bfloat16, False),
])
def test_which_one_row_products_run_as_two(shape, backend, dtype, expect):
    """The policy `bench.kernels.one_row_products` measured on the H200 (and XLA CPU's)."""
    K, N = shape
    one_row = jax.ShapeDtypeStruct((1, K), dtype)
    assert runs_as_two_rows(one_row, jax.ShapeDtypeStruct((K, N), dtype), NN, backend) is expect
    two_rows = jax.ShapeDtypeStruct((2, K), dtype)
    assert not runs_as_two_rows(two_rows, jax.ShapeDtypeStruct((K, N), dtype), NN, backend)


def test_converted_one_row_products_run_as_two_on_a_gpu_at_any_size():
    """8-bit weights converted inside the product: two rows on a GPU whatever the shape (even
    where a float one stays a reduce or a matrix kernel), CPU's rule on a CPU."""
    one_row = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16)
    for shape, backend, expect in [((4096, 4096), "gpu", True), ((4096, 32), "gpu", True),
                                   ((4096, 4096), "tpu", False), ((4096, 4096), "cpu", True)]:
        rhs = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        assert runs_as_two_rows(one_row, rhs, NN, backend, converted=True) is expect
    assert not runs_as_two_rows(jax.ShapeDtypeStruct((2, 4096), jnp.bfloat16),
                                jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16), NN, "gpu", converted=True)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="XLA GPU's lowering")
def test_one_row_o_proj_is_a_matrix_kernel_on_the_gpu():
    """A Qwen3-30B-A3B-shaped one-row o_proj compiles to a matrix kernel, not XLA's reduce."""
    x, w = jnp.ones((1, 4096), jnp.bfloat16), jnp.ones((4096, 2048), jnp.bfloat16)
    compiled = jax.jit(lambda x, w: dot_general(x, w, NN)).lower(x, w).compile().as_text().lower()
    assert "reduce_fusion" not in compiled and ("gemm" in compiled or "cublas" in compiled)
    plain = jax.jit(lambda x, w: jax.lax.dot_general(x, w, NN)).lower(x, w).compile().as_text().lower()
    assert "reduce_fusion" in plain  # what the two rows avoid (if XLA changes its rule, revisit the limit)


@pytest.mark.parametrize("backend", ["gpu", "cpu"])
@pytest.mark.parametrize("dims", [NN, NT], ids=["NN", "NT"])
def test_converted_products_run_one_row_as_two_on_a_gpu(backend, dims, monkeypatch):
    """A one-row product of weights converted from 8 bits: two rows on a GPU at any size (the
    HLO as lowered, with the backend patched), the first row's values; untouched elsewhere
    and for more rows."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((1, 48)), jnp.float32)
    values = jnp.asarray(rng.integers(-127, 128, (48, 40) if dims == NN else (40, 48)), jnp.int8)
    product = jax.jit(lambda x, v: converted_dot_general(x, v.astype(x.dtype), dims, precision="highest"))
    weight = np.asarray(values, np.float64)
    expect = np.asarray(x, np.float64) @ (weight if dims == NN else weight.T)
    many = jnp.asarray(rng.standard_normal((3, 48)), jnp.float32)
    with monkeypatch.context() as patched:
        patched.setattr(jax, "default_backend", lambda: backend)
        hlo = product.lower(x, values).as_text()
        out = product(x, values)
        hlo_many = product.lower(many, values).as_text()
    assert ("tensor<2x40xf32>" in hlo) is (backend == "gpu") and out.shape == (1, 40)
    np.testing.assert_allclose(np.asarray(out), expect, atol=1e-3)  # float32 sums of 48 terms up to 127 * 4
    assert "tensor<3x40xf32>" in hlo_many and "tensor<6x40" not in hlo_many


def test_8_bit_layers_take_the_converted_product(monkeypatch):
    """`linear` with a quantization builds a layer whose XLA product (the reference kernels)
    runs a one-row call as two rows on a GPU."""
    from flax import nnx

    from dflash_jax.kernels import REFERENCE
    from dflash_jax.layers import linear
    from dflash_jax.quantization import WeightQuantization

    layer = linear(48, 40, (None, None), use_bias=False, dtype=jnp.float32, rngs=nnx.Rngs(0),
                   quantization=WeightQuantization("int8", None))
    x = jnp.ones((1, 48), jnp.float32)
    with monkeypatch.context() as patched:
        patched.setattr(jax, "default_backend", lambda: "gpu")
        hlo = jax.jit(lambda x: layer(x, REFERENCE)).lower(x).as_text()
    assert "tensor<2x40xf32>" in hlo
