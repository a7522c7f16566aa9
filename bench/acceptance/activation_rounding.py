"""What int8 activations would cost an 8-bit target in accuracy: `quantized_agreement` with
every 8-bit product's input first rounded through int8 per token (per group of --group input
channels, or over the whole row with 0), the numbers a W8A8 product computes up to the float
rounding of its sums. A probe: the library has no int8 activations, so each 8-bit layer of the
quantized targets gets a product function that rounds its input before the weight-only product
(the reference product, which CPU runs).

    python -m bench.acceptance.activation_rounding --group 128 --variants int8/128 --out J
"""

from __future__ import annotations

import argparse
import functools
import math


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


def _rounding_input(lhs, rhs, dimension_numbers, *args, product, group: int, **options):
    """`product` (a dot_general) of lhs with each token's channels rounded first: the lhs axes
    from the first batch or contracting one on (the reference's [T, K], or its [T, blocks,
    block_in] per block of input rows, zero-padded at the end) are one token's channels."""
    (contracting, _), (batch, _) = dimension_numbers
    rows = lhs.reshape(math.prod(lhs.shape[:min((*contracting, *batch))]), -1)
    rounded = rounded_through_int8(rows, group).reshape(lhs.shape)
    return product(rounded, rhs, dimension_numbers, *args, **options)


def with_rounded_inputs(target, group: int):
    """`target` with each 8-bit layer's product rounding its input per token (`group` channels
    a scale, 0 for the whole row); before the model's first run."""
    from flax import nnx

    from dflash_jax.quantization import QuantizedLinear

    for _, module in nnx.iter_graph(target):
        if isinstance(module, QuantizedLinear):
            module.dot_general = functools.partial(_rounding_input, product=module.dot_general, group=group)
    return target


def main(argv=None) -> None:
    from bench.acceptance import quantized_agreement

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--group", type=int, default=128, help="input channels per activation scale (0: the row)")
    args, rest = parser.parse_known_args(argv)
    quantized_agreement.main(rest, adapt=functools.partial(with_rounded_inputs, group=args.group))


if __name__ == "__main__":
    main()
