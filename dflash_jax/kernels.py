"""Which implementation computes each kernel: one frozen value, resolved once, passed down.

`Kernels` names the implementation of the seven kernels a step runs: paged attention, the
DFlash layout, the residual add + RMSNorm, the heads' finish (q/k norm, RoPE, K/V cache
write), the 8-bit weights' product, the routed experts' product (with their router's top k)
and the gated delta rule (hybrid targets' linear attention). "auto" means the Pallas kernel
on a GPU, the jnp reference elsewhere (where Pallas could only run in its slow interpret
mode); the 8-bit product on one GPU is "pallas_or_xla" (the kernel, or XLA's product for
per-column weights where that is faster), on a mesh the reference (XLA partitions it; a Pallas call it
could not), while the experts' kernel runs per device inside the expert split and the delta
rule's per shard of the heads (or as the reference where the heads stay whole). `resolve()`
replaces "auto" by what it means on this backend; the resolved value travels in each
program's static configuration, so it is part of the jit cache key and a different choice
compiles a different program. One more choice is a form, not an implementation:
`prefill_rule`, whether long prefill rows go through the gated delta rule in chunks of 64
("chunks", the CPU's "auto") or token by token like every other row ("tokens", the GPU's:
there the chunked walk measured no faster). Nothing here reads the environment: a caller
that wants environment defaults (the CLI) reads them itself.

    kernels = Kernels(attention="pallas").resolve()   # the others "auto"
    add_norm = kernels.add_rms_norm                   # a function, for the models' layers
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.chunked_delta_rule import chunked_delta_rule_pallas, chunked_delta_rule_reference
from pallas_kernels.conv_delta_rule import conv_delta_rule_pallas
from pallas_kernels.delta_rule import delta_rule_pallas, delta_rule_reference
from pallas_kernels.finish_heads import finish_heads_pallas, finish_heads_reference
from pallas_kernels.grouped_matmul import grouped_matmul_pallas
from pallas_kernels.paged_attention import (
    default_block_q, default_kv_splits, paged_attention_pallas, query_blocks,
)
from pallas_kernels.paged_attention_reference import paged_attention_reference
from pallas_kernels.quantized_matmul import quantized_matmul_pallas, quantized_matmul_reference
from pallas_kernels.rms_norm import add_rms_norm_pallas, add_rms_norm_reference
from pallas_kernels.router import route_pallas, route_reference
from pallas_kernels.rule_inputs import rule_inputs_pallas

# Implementations each kernel accepts ("auto": see AUTO).
CHOICES = {
    "attention": ("auto", "reference", "pallas"),
    "layout": ("auto", "reference", "pallas", "triton"),
    "norm": ("auto", "reference", "pallas"),
    "heads": ("auto", "reference", "pallas"),
    "quantized": ("auto", "reference", "pallas", "pallas_or_xla"),
    "experts": ("auto", "reference", "pallas"),
    "recurrence": ("auto", "reference", "pallas", "fused", "fused_decode"),
    "rule_inputs": ("auto", "reference", "pallas"),
    "prefill_rule": ("auto", "chunks", "tokens"),
}
# What "auto" means: (on a GPU, elsewhere). Long prefill rows walk token by token on a GPU,
# where the chunked rule measured no faster; the rule computes its own convolution and norms
# in decode steps only, where that measured faster, and takes them from one kernel in the
# other steps (bench/results).
AUTO = ({name: ("pallas", "reference") for name in CHOICES}
        | {"prefill_rule": ("tokens", "chunks"), "recurrence": ("fused_decode", "reference"),
           "quantized": ("pallas_or_xla", "reference")})


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The implementation of each kernel: "auto", "reference" (jnp) or "pallas" (layout: also
    "triton", the jax-triton kernel; recurrence: also "fused", the Pallas rule that computes
    its own inputs, convolution and norms, and "fused_decode", that rule in steps of one token
    a row and "pallas" in the others; quantized: also "pallas_or_xla", the Pallas kernel, or
    XLA's product for weights scaled per column where its fused conversion is the faster:
    `_pallas_or_xla`). Hashable: a static jit argument."""

    attention: str = "auto"
    layout: str = "auto"
    norm: str = "auto"
    heads: str = "auto"
    quantized: str = "auto"
    experts: str = "auto"
    recurrence: str = "auto"
    rule_inputs: str = "auto"
    prefill_rule: str = "auto"

    def __post_init__(self):
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"the {name} kernel must be one of {', '.join(choices)}, got {value!r}.")

    @classmethod
    def parse(cls, spec: str) -> Kernels:
        """From "name=impl,..." (e.g. "attention=pallas,norm=reference"; "" is all "auto"):
        the command line's form."""
        choices = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, sep, impl = item.partition("=")
            if not sep or name.strip() not in CHOICES:
                raise ValueError(f"kernel choice {item!r} is not name=impl with a name among "
                                 f"{', '.join(CHOICES)}; e.g. attention=pallas,norm=reference.")
            choices[name.strip()] = impl.strip()
        return cls(**choices)

    def resolve(self, mesh=None) -> Kernels:
        """This value with "auto" replaced by what it means on the default backend, for models
        placed on `mesh` (None: one device)."""
        if mesh is not None and self.quantized in ("pallas", "pallas_or_xla"):
            raise ValueError("the Pallas 8-bit product runs on one device; on a mesh use quantized=reference "
                             "(or auto).")
        on_gpu = jax.default_backend() == "gpu"
        auto = {name: AUTO[name][0 if on_gpu else 1] for name in CHOICES}
        if mesh is not None:
            auto["quantized"] = "reference"
        if self.recurrence == "reference":  # the rule's jnp form takes its inputs from jnp too
            auto["rule_inputs"] = "reference"
        return Kernels(**{name: auto[name] if getattr(self, name) == "auto" else getattr(self, name)
                          for name in CHOICES})

    @property
    def add_rms_norm(self):
        """`add_rms_norm_reference`'s signature: (x + delta, its RMSNorm)."""
        return add_rms_norm_pallas if self._chosen("norm") == "pallas" else add_rms_norm_reference

    @property
    def finish_heads(self):
        """`finish_heads_reference`'s signature: (queries, key cache, value cache)."""
        return finish_heads_pallas if self._chosen("heads") == "pallas" else finish_heads_reference

    def quantized_matmul(self, dot_general):
        """`quantized_matmul_reference`'s (x, values, scales, block_in, transposed=) as this
        value computes it; the reference's products go through `dot_general`."""
        chosen = self._chosen("quantized")
        reference = functools.partial(quantized_matmul_reference, dot_general=dot_general)
        if chosen == "pallas_or_xla":
            return functools.partial(_pallas_or_xla, reference=reference)
        return quantized_matmul_pallas if chosen == "pallas" else reference

    @property
    def grouped_matmul(self):
        """The routed experts' product: `grouped_matmul_pallas` (pairs in tiles of one expert,
        only the routed experts read), or None for the reference (XLA's `ragged_dot`)."""
        return grouped_matmul_pallas if self._chosen("experts") == "pallas" else None

    @property
    def route(self):
        """The MoE router's choice (`route_reference`'s signature): one Pallas kernel beside the
        experts' Pallas product, else jnp."""
        return route_pallas if self._chosen("experts") == "pallas" else route_reference

    @property
    def delta_rule(self):
        """`delta_rule_reference`'s signature: the gated delta rule over ragged rows."""
        return delta_rule_reference if self._chosen("recurrence") == "reference" else delta_rule_pallas

    def conv_delta_rule(self, one_token_rows: bool):
        """`conv_delta_rule_pallas` (the rule with its convolution and norms in the kernel)
        where `recurrence` is "fused", or "fused_decode" in a step whose rows hold one token
        each (`one_token_rows`); else None (the convolution and norms in jnp, then
        `delta_rule`). A verify block's commit walks its kept tokens again, which the fused
        rule pays with the convolution again, the other with the kept q/k/v."""
        chosen = self._chosen("recurrence")
        return conv_delta_rule_pallas if chosen == "fused" or (chosen == "fused_decode" and one_token_rows) else None

    @property
    def prepare_rule_inputs(self):
        """`rule_inputs_pallas` (the rule's convolution, SiLU and norms for every token of an
        unfused step in one kernel) where `rule_inputs` is "pallas", else None (jnp)."""
        return rule_inputs_pallas if self._chosen("rule_inputs") == "pallas" else None

    @property
    def chunked_delta_rule(self):
        """`delta_rule_reference`'s signature (and `num_chunks`), in chunks of tokens, for long
        prefill rows; None where `prefill_rule` walks them token by token too."""
        if self._chosen("prefill_rule") == "tokens":
            return None
        return chunked_delta_rule_reference if self._chosen("recurrence") == "reference" else chunked_delta_rule_pallas

    def paged_attention(self, q_req_T, *, num_rows: int, num_kv_heads: int, group: int, dtype):
        """`paged_attention_reference` (same arguments) as this value's attention computes
        it, for the queries of one step. For the Pallas kernel the query blocks, which depend
        only on the step's `q_req_T`, are cut here once and shared by every layer of the step.
        `num_rows`: block-table rows; `num_kv_heads`: the kv heads of one call (a shard's);
        `group`: query heads per kv head; `dtype`: the queries'."""
        if self._chosen("attention") == "reference":
            return paged_attention_reference
        block_q = default_block_q(q_req_T.shape[0], num_rows, group, f32=jnp.dtype(dtype) == jnp.float32)
        kv_splits = default_kv_splits(q_req_T.shape[0], num_rows, block_q, num_kv_heads)
        return functools.partial(paged_attention_pallas, block_q=block_q, blocks=query_blocks(q_req_T, block_q),
                                 kv_splits=kv_splits)

    def _chosen(self, name: str) -> str:
        value = getattr(self, name)
        if value == "auto":
            raise ValueError(f"Kernels.{name} is still 'auto': call resolve() once where the run starts.")
        return value


REFERENCE = Kernels(**{name: elsewhere for name, (_, elsewhere) in AUTO.items()})


# Calls of these many tokens run per-column 8-bit products faster through the Pallas kernel
# than through XLA's fused conversion; one token and larger calls the other way round
# (bench/results).
PER_COLUMN_KERNEL_TOKENS = range(2, 65)


def _pallas_or_xla(x, values, scales, block_in, *, transposed=False, reference):
    """The 8-bit product of `Kernels(quantized="pallas_or_xla")`: the Pallas kernel where
    scales come per block of input rows, and where they come per column for calls of
    `PER_COLUMN_KERNEL_TOKENS` tokens; `reference` (XLA's product) for the other calls. So
    with per-column weights a one-token step and a verify block run different products, whose
    last bits may differ (`quantized="pallas"` keeps them alike)."""
    if block_in is None and math.prod(x.shape[:-1]) not in PER_COLUMN_KERNEL_TOKENS:
        return reference(x, values, scales, block_in, transposed=transposed)
    return quantized_matmul_pallas(x, values, scales, block_in, transposed=transposed)


def check_kernels(kernels) -> Kernels:
    """`kernels` if it is a `Kernels`, else a TypeError that says so."""
    if not isinstance(kernels, Kernels):
        raise TypeError(f"kernels must be a dflash_jax.Kernels, got {type(kernels).__name__}.")
    return kernels


def add_kernels_argument(parser) -> None:
    """The command line's `--kernels name=impl,...` (an argparse parser's option)."""

    def parse(spec: str) -> Kernels:
        try:
            return Kernels.parse(spec)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parser.add_argument(
        "--kernels", type=parse, default=Kernels(), metavar="NAME=IMPL,...",
        help="implementation of each kernel: attention, layout, norm, heads, quantized (8-bit weights' "
        "product; also pallas_or_xla: Pallas, but XLA for per-column scales in calls of one token or more than 64 "
        "tokens: the GPU's auto), "
        "experts (routed experts' product), recurrence (gated delta rule) = auto | reference | pallas (layout also triton; "
        "recurrence also fused: the convolution and norms inside the rule's kernel, and fused_decode: fused in "
        "steps of one token a row, pallas in the others); rule_inputs = auto | reference | pallas: the rule's "
        "convolution, SiLU and norms in unfused steps as jnp or one kernel (auto beside recurrence=reference: jnp); auto, "
        "the default, is Pallas on a GPU (recurrence: fused_decode; quantized: pallas_or_xla) and the jnp reference elsewhere; prefill_rule = auto | chunks | tokens: long prefill rows "
        "through the gated delta rule in chunks of 64 or token by token (auto: tokens on a GPU, chunks elsewhere)",
    )
