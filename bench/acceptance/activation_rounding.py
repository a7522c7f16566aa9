"""What int8 activations would cost an 8-bit target in accuracy: `quantized_agreement` with
every 8-bit product's input first rounded through int8 per token (per group of --group input
channels, or over the whole row with 0), the numbers a W8A8 product computes up to the float
rounding of its sums. A probe: the library has no int8 activations, so this swaps the
library's reference 8-bit product (the one CPU runs) for one that rounds its input.

    python -m bench.acceptance.activation_rounding --group 128 --variants int8/128 --out J
"""

from __future__ import annotations

import argparse


def rounded_through_int8(x, group: int):
    """x [..., K] with each token's `group` channels (0: all K) rounded through int8 on one
    scale (the channels past K's last whole group padded with zeros)."""
    import jax.numpy as jnp

    from bench.kernels.wgmma_block_scaled import int8_rows

    *lead, K = x.shape
    group = group or K
    rows = jnp.pad(x.reshape(-1, K).astype(jnp.float32), ((0, 0), (0, -K % group)))
    values, scales_GT = int8_rows(rows, group)
    blocks = values.reshape(rows.shape[0], -1, group).astype(jnp.float32) * scales_GT.T[..., None]
    return blocks.reshape(rows.shape)[:, :K].reshape(x.shape).astype(x.dtype)


def main(argv=None) -> None:
    import dflash_jax.kernels
    from bench.acceptance import quantized_agreement

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--group", type=int, default=128, help="input channels per activation scale (0: the row)")
    args, rest = parser.parse_known_args(argv)
    weights_only = dflash_jax.kernels.quantized_matmul_reference

    def rounding_input(x, *rest, **options):
        return weights_only(rounded_through_int8(x, args.group), *rest, **options)

    dflash_jax.kernels.quantized_matmul_reference = rounding_input
    try:
        quantized_agreement.main(rest)
    finally:
        dflash_jax.kernels.quantized_matmul_reference = weights_only


if __name__ == "__main__":
    main()
