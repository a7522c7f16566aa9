"""The fused residual add + RMSNorm kernel (interpret mode on CPU; compiled on a GPU) against
its jnp reference and a float64 numpy oracle: values, gradients, and under vmap (training
traces the models inside one)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rms_norm import add_rms_norm_pallas, add_rms_norm_reference

EPS = 1e-6
SHAPES = [(1, 64), (5, 576), (3, 128), (2, 100)]  # 576 and 100: columns padded to a power of two


def oracle(x, delta, weight):
    x = np.asarray(x, np.float64) + (0.0 if delta is None else np.asarray(delta, np.float64))
    return x, np.asarray(weight, np.float64) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)


def inputs(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x, delta = (jnp.asarray(rng.normal(size=shape) * 3, dtype) for _ in range(2))
    return x, delta, jnp.asarray(rng.normal(size=shape[-1:]), dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("with_delta", [True, False])
def test_kernel_matches_reference_and_oracle(shape, dtype, with_delta):
    x, delta, weight = inputs(shape, dtype)
    delta = delta if with_delta else None
    got = add_rms_norm_pallas(x, delta, weight, EPS, interpret=True)
    ref = add_rms_norm_reference(x, delta, weight, EPS)
    # The sum is computed the same way: bit-equal. The norm differs at most by the order of
    # the float32 sum of squares: one rounding step of the output dtype.
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(ref[0], np.float32))
    step = float(jnp.finfo(dtype).eps)
    scale = np.abs(np.asarray(ref[1], np.float32)).max()
    np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(ref[1], np.float32), atol=2 * step * scale)
    want = oracle(x, delta, weight)
    tol = dict(float32=1e-5, bfloat16=5e-2)[dtype]
    np.testing.assert_allclose(np.asarray(got[1], np.float64), want[1], atol=tol * scale, rtol=tol)
    assert got[1].dtype == ref[1].dtype and got[0].dtype == x.dtype


def test_rejects_a_mismatched_delta():
    x, delta, weight = inputs((2, 64), "float32")
    with pytest.raises(ValueError, match="delta must match x"):
        add_rms_norm_pallas(x, delta[:1], weight, EPS, interpret=True)


def test_gradients_and_vmap_match_the_reference():
    x, delta, weight = inputs((3, 4, 64), "float32", seed=1)

    def loss(norm, x, delta, weight):
        total, normed = norm(x, delta, weight)
        return jnp.sum(normed**2) + jnp.sum(total * normed)

    kernel = lambda x, d, w: add_rms_norm_pallas(x, d, w, EPS, interpret=True)  # noqa: E731
    reference = lambda x, d, w: add_rms_norm_reference(x, d, w, EPS)  # noqa: E731
    for got, want in zip(jax.grad(loss, argnums=(1, 2, 3))(kernel, x[0], delta[0], weight),
                         jax.grad(loss, argnums=(1, 2, 3))(reference, x[0], delta[0], weight)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.vmap(kernel, in_axes=(0, 0, None))(x, delta, weight),
                         jax.vmap(reference, in_axes=(0, 0, None))(x, delta, weight)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_lowers_to_triton_for_a_gpu_from_any_host(dtype):
    from conftest import triton_calls_for_cuda

    x, delta, weight = inputs((300, 4096), dtype)
    assert triton_calls_for_cuda(lambda *a: add_rms_norm_pallas(*a, EPS, interpret=False), x, delta, weight) == 1


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_kernel_on_gpu(dtype):
    for shape in SHAPES + [(16, 4096), (300, 4096)]:
        x, delta, weight = inputs(shape, dtype)
        got = jax.jit(lambda x, d, w: add_rms_norm_pallas(x, d, w, EPS))(x, delta, weight)
        ref = jax.jit(lambda x, d, w: add_rms_norm_reference(x, d, w, EPS))(x, delta, weight)
        np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(ref[0], np.float32))
        scale = np.abs(np.asarray(ref[1], np.float32)).max()
        np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(ref[1], np.float32),
                                   atol=2 * float(jnp.finfo(dtype).eps) * scale)
