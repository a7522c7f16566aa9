"""What the kernels here share: power-of-two sizes (Triton's block shapes; the runtime's
buckets use them too) and a quiet jax 0.11 deprecation warning."""

from __future__ import annotations

import warnings

# jax 0.11 warns at every Triton-backend lowering; the kernels still compile and run.
TRITON_DEPRECATION = (r"The Pallas Triton backend is deprecated and will be removed in"
                      r" a future JAX version\.")


def quiet_triton_deprecation():
    """Ignore exactly the Triton-deprecation DeprecationWarning when a kernel is traced for
    the GPU (it fires when the surrounding jit lowers, after this call; re-adding the same
    filter replaces it, so each trace re-installs it after a `catch_warnings` reset)."""
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(1, int(n)) - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0
