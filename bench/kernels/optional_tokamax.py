"""openxla/tokamax, an optional benchmark-only dependency: its GPU `ragged_dot` kernels
(Mosaic GPU, Triton; on Hopper a Mosaic GPU kernel that dequantizes qwix-quantized
right-hand sides in registers) timed beside this project's kernels.

tokamax and the packages it imports travel to the device as wheels (bench/README.md); where
it is missing, or the backend is not a GPU, its variants are left out with the reason printed."""

from __future__ import annotations

import sys


def load_tokamax():
    """The tokamax module, or None (the reason printed) off a GPU or where it does not import."""
    import jax

    if jax.default_backend() != "gpu":
        return None
    try:
        import tokamax
    except Exception as error:  # ImportError, or a version that does not import under this jax
        print(f"tokamax not measured: {type(error).__name__}: {error}", flush=True)
        return None
    from absl import flags

    if not flags.FLAGS.is_parsed():  # tokamax reads absl flags, which would parse the script's arguments
        flags.FLAGS(sys.argv[:1])
    return tokamax
