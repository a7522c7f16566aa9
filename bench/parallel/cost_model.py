"""Tensor parallelism on H200s: a cost model of the AR step, the DFlash cycle and the Engine
step at TP 1, 2, 4, 8 for the Qwen3-8B and Qwen3-32B shapes of `bench.shapes` (bf16).
PREDICTIONS, not measurements: bench/LOG.md holds its tables, and
bench/plans/tensor_parallel.sh measures what it predicts.

    python -m bench.parallel.cost_model [--out J]   # prints the tables (markdown)

A decode step is memory-bound at batch 1 and the layers run one after another, so a step at
TP t is taken as three terms:

    T(t) = S / t + F + collectives x (alpha + 2 (t - 1) / t x message bytes / bus bandwidth)

S, the part that splits over the devices: every weight matrix (q/k/v and gate/up by columns,
o and down by rows, the LM head by vocabulary rows) and the K/V (by kv head, 8 of them, so
up to TP 8 none is repeated) are read once per step, 1/t of them by each device; at large
batches the products' FLOPs instead, also 1/t each. F, the part that does not: hundreds of
small kernels per step (norms, RoPE, sampling, the loop's bookkeeping) whose time is launch
and latency, not bytes. Both are anchored to the one-H200 measurements of the 8B shape
(MEASURED_8B): F is the 1 x 1k step's time less its bytes at STREAM_BPS, and S at each point
the measured time less F. The 32B shape, never measured, takes the 8B's ratio of S to the
bytes-or-FLOPs floor at the same point and F scaled by its layer count.

Collectives: the compiled TP programs hold, greedy, per target step one all-reduce after each
layer's o_proj and down_proj and one for the vocab-sharded embedding lookup, and two
all-gathers of the argmax's per-shard (max, index) pairs; the drafter's forward adds two per
layer, one for its fc and embedding together, and two gathers for the draft argmax. Within
one step each depends on the product before it, so none overlaps compute or another. An
all-reduce message is rows x hidden x 2 bytes (the bf16 residual stream).

The Engine's step runs the same device program and overlaps its host work (scheduling,
packing inputs) with the device's: max(device step + the Engine's extra at TP 1, the host's
own time per step, HOST_FLOOR_S).
"""

from __future__ import annotations

import argparse
import dataclasses

from bench import harness
from bench.shapes import QWEN3_8B, QWEN3_8B_DRAFTER, QWEN3_32B, QWEN3_32B_DRAFTER

TP_SIZES = (1, 2, 4, 8)
POINTS = ((1, 1024), (32, 1024))
BLOCK = 16  # the DFlash block: verify rows per request
NEW_TOKENS = 64  # bench.decode.speed's default n: the measured steps sit at context + 3/4 of it
BYTES = 2  # bf16
STREAM_BPS = 3.8e12  # one H200's weight / K/V streaming rate in decode (its copy rate is ~4.1 TB/s)
FLOPS = 800e12  # one H200's bf16 dense product rate in practice
ALPHAS_S = (10e-6, 15e-6, 20e-6)  # NCCL small-message all-reduce latency in one NVLink host: low, mid, high
BUS_BPS = 360e9  # NCCL all-reduce bus bandwidth on NVLink 4 (450 GB/s each way per GPU), NVLS off
HOST_FLOOR_S = 2.95e-3  # the Engine's host time per step: its SmolLM2 step, whose device step is ~1 ms
# One H200, Qwen3-8B shape, random bf16 weights, Pallas attention (bench/results/):
# 2026-12-01-one-cycle-h200.md ("after" column) except the 32 x 1k block-16 cycle
# (2026-11-30-qwen3-8b-shape-h200-s5.md; later sessions measured blocks 8 and 4 only).
MEASURED_8B = {
    ("ar", 1): 4.328e-3, ("ar", 32): 5.988e-3,
    ("cycle", 1): 5.761e-3, ("cycle", 32): 19.21e-3,
    ("engine", 1): 4.539e-3, ("engine_dflash", 1): 5.726e-3,
}


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    target: dict
    drafter: dict

    @property
    def layers(self) -> int:
        return self.target["num_hidden_layers"]

    @property
    def drafter_layers(self) -> int:
        return self.drafter["num_hidden_layers"]

    @property
    def hidden(self) -> int:
        return self.target["hidden_size"]

    @property
    def head_params(self) -> int:
        return self.target["vocab_size"] * self.hidden

    def layer_params(self, raw: dict) -> int:
        d, n, k, h, i = (raw[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                              "intermediate_size"))
        return d * (n + 2 * k) * h + n * h * d + 3 * d * i + 2 * d + 2 * h  # qkv, o, gate/up/down, 4 norms

    @property
    def target_stream_params(self) -> int:
        """What a target step reads: every parameter but the embedding table (rows gathered)."""
        return self.layers * self.layer_params(self.target) + self.head_params + self.hidden

    @property
    def drafter_params(self) -> int:
        fc = len(self.drafter["dflash_config"]["target_layer_ids"]) * self.hidden * self.hidden
        return self.drafter_layers * self.layer_params(self.drafter) + fc + 2 * self.hidden

    def kv_bytes_per_token(self, raw: dict) -> int:
        return 2 * raw["num_hidden_layers"] * raw["num_key_value_heads"] * raw["head_dim"] * BYTES


SHAPES = (Shape("Qwen3-8B", QWEN3_8B, QWEN3_8B_DRAFTER), Shape("Qwen3-32B", QWEN3_32B, QWEN3_32B_DRAFTER))
MEASURES = {"ar": ("AR step", "ar", False), "cycle": ("DFlash cycle (block 16)", "cycle", False),
            "engine_ar": ("Engine AR step", "ar", True), "engine_cycle": ("Engine DFlash step", "cycle", True)}


def collectives(shape: Shape, measure: str) -> int:
    target = 2 * shape.layers + 1 + 2
    return target if measure == "ar" else target + 2 * shape.drafter_layers + 1 + 2


def message_bytes(shape: Shape, measure: str, batch: int) -> int:
    return batch * (1 if measure == "ar" else BLOCK) * shape.hidden * BYTES


def allreduce_s(message: int, tp: int, alpha: float) -> float:
    return 0.0 if tp == 1 else alpha + 2 * (tp - 1) / tp * message / BUS_BPS


def floor_s(shape: Shape, measure: str, batch: int, context: int) -> float:
    """One device's time for the splittable part at TP 1: bytes over STREAM_BPS or FLOPs over
    FLOPS, whichever is longer (the cycle: verify on B x 16 rows, the drafter on B x 16 rows,
    the LM head a second time on B x 15 draft rows)."""
    tokens = batch * (context + 3 * NEW_TOKENS // 4)
    kv = tokens * shape.kv_bytes_per_token(shape.target)
    if measure == "ar":
        return max((shape.target_stream_params * BYTES + kv) / STREAM_BPS,
                   2 * batch * shape.target_stream_params / FLOPS)
    kv += tokens * shape.kv_bytes_per_token(shape.drafter)
    params = shape.target_stream_params + shape.drafter_params + shape.head_params
    rows = batch * BLOCK
    flops = 2 * rows * (shape.target_stream_params + shape.drafter_params) + 2 * batch * (BLOCK - 1) * shape.head_params
    return max((params * BYTES + kv) / STREAM_BPS, flops / FLOPS)


def fixed_s(shape: Shape, measure: str) -> float:
    """F: the 8B step at 1 x 1k less its floor, scaled by the layers the step runs."""
    eight = SHAPES[0]
    f8 = MEASURED_8B[(measure, 1)] - floor_s(eight, measure, 1, 1024)
    if measure == "ar":
        return f8 * shape.layers / eight.layers
    return f8 * (shape.layers + shape.drafter_layers) / (eight.layers + eight.drafter_layers)


def split_s(shape: Shape, measure: str, batch: int, context: int) -> float:
    """S at TP 1: the 8B's measured time less F; the 32B's floor times the 8B's S / floor."""
    eight = SHAPES[0]
    s8 = MEASURED_8B[(measure, batch)] - fixed_s(eight, measure)
    return s8 * floor_s(shape, measure, batch, context) / floor_s(eight, measure, batch, context)


def step_s(shape: Shape, measure: str, batch: int, context: int, tp: int, alpha: float) -> float:
    return (split_s(shape, measure, batch, context) / tp + fixed_s(shape, measure)
            + collectives(shape, measure) * allreduce_s(message_bytes(shape, measure, batch), tp, alpha))


def engine_s(shape: Shape, measure: str, batch: int, context: int, tp: int, alpha: float) -> float:
    extra = MEASURED_8B[("engine" if measure == "ar" else "engine_dflash", 1)] - MEASURED_8B[(measure, 1)]
    return max(step_s(shape, measure, batch, context, tp, alpha) + extra, HOST_FLOOR_S)


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def sizes_table() -> list[str]:
    lines = ["| shape | TP | target weights / step GB | drafter GB | target K/V 1x1k / 32x1k GB | drafter K/V 1x1k / "
             "32x1k GB | collectives per AR step / cycle | all-reduce KB: AR B1, B32; cycle B1, B32 "
             "| all-reduce us (alpha 15 us): AR B1, B32; cycle B1, B32 |", "|" + "---|" * 9]
    for shape in SHAPES:
        for tp in TP_SIZES:
            kv = [batch * context * shape.kv_bytes_per_token(raw) / tp for raw in (shape.target, shape.drafter)
                  for batch, context in POINTS]
            messages = [message_bytes(shape, measure, batch) for measure in ("ar", "cycle") for batch, _ in POINTS]
            times = [1e6 * allreduce_s(m, tp, ALPHAS_S[1]) for m in messages]
            lines.append(f"| {shape.name} | {tp} | {gb(shape.target_stream_params * BYTES / tp)} "
                         f"| {gb(shape.drafter_params * BYTES / tp)} | {gb(kv[0])} / {gb(kv[1])} "
                         f"| {gb(kv[2])} / {gb(kv[3])} "
                         f"| {collectives(shape, 'ar') if tp > 1 else 0} / {collectives(shape, 'cycle') if tp > 1 else 0} "
                         f"| {', '.join(f'{m / 1024:.0f}' for m in messages)} "
                         f"| {', '.join(f'{t:.0f}' for t in times)} |")
    return lines


def predicted_s(shape: Shape, name: str, batch: int, context: int, tp: int, alpha: float) -> float:
    """The predicted seconds of MEASURES[name] at a point, TP size and all-reduce latency."""
    _, measure, engine = MEASURES[name]
    return (engine_s if engine else step_s)(shape, measure, batch, context, tp, alpha)


def predictions() -> list[dict]:
    """Every predicted step time (alpha 15 us), as the record's results."""
    return [dict(shape=shape.name, batch=batch, context=context, measure=name, tp=tp,
                 seconds=predicted_s(shape, name, batch, context, tp, ALPHAS_S[1]))
            for shape in SHAPES for batch, context in POINTS for name in MEASURES for tp in TP_SIZES]


def steps_table() -> list[str]:
    header = " | ".join(f"TP {tp} ms (x TP 1)" for tp in TP_SIZES)
    lines = [f"| shape | point | measure | {header} | TP 8 at alpha 10 / 20 us |", "|" + "---|" * (4 + len(TP_SIZES))]
    for shape in SHAPES:
        for batch, context in POINTS:
            for name, (title, _, _) in MEASURES.items():
                one = predicted_s(shape, name, batch, context, 1, ALPHAS_S[1])
                cells = [f"{1e3 * t:.2f} ({one / t:.2f}x)" for t in
                         (predicted_s(shape, name, batch, context, tp, ALPHAS_S[1]) for tp in TP_SIZES)]
                low, high = (1e3 * predicted_s(shape, name, batch, context, 8, alpha)
                             for alpha in (ALPHAS_S[0], ALPHAS_S[2]))
                lines.append(f"| {shape.name} | {batch}x{context // 1024}k | {title} | {' | '.join(cells)} "
                             f"| {low:.2f} / {high:.2f} |")
    return lines


def limits_table() -> list[str]:
    lines = ["| shape | point | measure | S ms (splits) | F ms (does not) | collectives x alpha ms | TP where S / TP "
             "= collectives x alpha | speedup limit (1 / (F + collectives x alpha)) |", "|" + "---|" * 8]
    for shape in SHAPES:
        for batch, context in POINTS:
            for measure in ("ar", "cycle"):
                s, f = split_s(shape, measure, batch, context), fixed_s(shape, measure)
                floor = collectives(shape, measure) * ALPHAS_S[1]
                limit = step_s(shape, measure, batch, context, 1, ALPHAS_S[1]) / (f + floor)
                lines.append(f"| {shape.name} | {batch}x{context // 1024}k | {'AR step' if measure == 'ar' else 'cycle'} "
                             f"| {1e3 * s:.2f} | {1e3 * f:.2f} | {1e3 * floor:.2f} | {s / floor:.1f} | {limit:.2f}x |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    harness.Record(__spec__.name, args, argv).write(predictions())
    for title, table in (("Bytes and collectives per device", sizes_table()),
                         ("Predicted step times (alpha 15 us)", steps_table()),
                         ("Where tensor parallelism stops paying (alpha 15 us)", limits_table())):
        print(f"\n### {title}\n")
        print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
