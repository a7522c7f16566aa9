"""What the kernels here share: power-of-two sizes (Triton's block shapes; the runtime's
buckets use them too), caches stored as bits, split-K partials summed in order, and a quiet
jax 0.11 deprecation warning."""

from __future__ import annotations

import functools
import operator
import warnings

import jax
import jax.numpy as jnp

# jax 0.11 warns at every Triton-backend lowering; the kernels still compile and run.
TRITON_DEPRECATION = (r"The Pallas Triton backend is deprecated and will be removed in"
                      r" a future JAX version\.")


def quiet_triton_deprecation():
    """Ignore exactly the Triton-deprecation DeprecationWarning when a kernel is traced for
    the GPU (it fires when the surrounding jit lowers, after this call; re-adding the same
    filter replaces it, so each trace re-installs it after a `catch_warnings` reset)."""
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


def runs_interpreted(interpret: bool | None) -> bool:
    """Whether a kernel call runs in interpret mode: `interpret`, where None means compiled on a
    GPU backend (the Triton deprecation warning quieted) and interpreted elsewhere."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if not interpret:
        quiet_triton_deprecation()
    return interpret


def sum_in_order(partials):
    """The sum over the leading axis of split-K `partials`, one after another: XLA's reduce
    may order its sum by the other axes' sizes (XLA CPU's does), and a row's result must not
    depend on the rows that share its call (a verify block computes what single steps do)."""
    return functools.reduce(operator.add, tuple(partials))


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(1, int(n)) - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def stored_as_bits(dtype) -> jnp.dtype:
    """The unsigned integer type of `dtype`'s width: how the jnp references can store a
    16-bit float KV cache on a CPU, where XLA has no 16-bit float scatter and would widen the
    whole cache to float32 and back around every write (two copies of the cache per layer
    and step). Scatters and gathers of the bits are in place; only the rows read or written
    are reinterpreted (`as_values`, `as_stored`)."""
    return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def as_values(x, dtype):
    """`x` read as `dtype` values: reinterpreted if it holds their bits, else as it is."""
    return jax.lax.bitcast_convert_type(x, dtype) if jnp.issubdtype(x.dtype, jnp.unsignedinteger) else x


def as_stored(rows, stored_dtype):
    """`rows` in a cache's stored dtype: their bits for a cache of bits (same width), else cast."""
    if not jnp.issubdtype(stored_dtype, jnp.unsignedinteger):
        return rows.astype(stored_dtype)
    if rows.dtype.itemsize != jnp.dtype(stored_dtype).itemsize:
        raise ValueError(f"{rows.dtype} rows cannot go to a cache of {stored_dtype} bits; cast them to the "
                         "cache's value dtype first.")
    return jax.lax.bitcast_convert_type(rows, stored_dtype)
