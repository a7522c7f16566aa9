"""Decode points (batch B, context C): parsing "BxC" lists, random prompts, and what a point
needs of the device."""

from __future__ import annotations

from bench.random_models import RandomPair, kv_bytes_per_token
from pallas_kernels.common import next_pow2

PAGE_SIZE = 16
# Issue 6's order of importance: its targets are at 1x1k and 32x1k.
POINTS_FULL = "1x1k,32x1k,8x1k,1x8k,128x1k,8x8k,32x8k,128x8k"  # 128x8k: K/V alone ~180 GB
POINTS_QUICK = "1x1k,32x1k"
POINTS_SMALL = "1x128,2x256"


def parse_points(text: str) -> list[tuple[int, int]]:
    """"1x1k,32x8k" -> [(1, 1024), (32, 8192)]."""
    points = []
    for item in text.split(","):
        batch, context = item.strip().lower().split("x")
        scale = 1024 if context.endswith("k") else 1
        points.append((int(batch), int(context.rstrip("k")) * scale))
    return points


def label(batch: int, context: int) -> str:
    return f"{batch}x{context // 1024}k" if context % 1024 == 0 else f"{batch}x{context}"


def prompts_for(rng, vocab: int, batch: int, context: int) -> list[list[int]]:
    return [rng.integers(0, vocab - 1, context).tolist() for _ in range(batch)]


def pages_per_request(context: int, capacity: int, num_drafts: int) -> int:
    """As `generate` sizes them: prompt bucket + capacity + one draft block past the end."""
    return -(-(next_pow2(context) + capacity + num_drafts + 1) // PAGE_SIZE)


def memory_needed(pair: RandomPair, batch: int, context: int, capacity: int, block: int) -> float:
    """Bytes a point needs at most on each device: weights, one target + drafter KV cache set,
    and room for the verify logits and a prefill's activations (a rough upper bound), split
    evenly over the devices of the models' mesh."""
    from dflash_jax.sharding import tensor_parallel_size

    t, d = pair.target.cfg, pair.drafter.cfg
    num_drafts = block - 1
    slots = batch * pages_per_request(context, capacity, num_drafts) * PAGE_SIZE
    kv = slots * (kv_bytes_per_token(pair.target, t.num_layers) + kv_bytes_per_token(pair.drafter, d.num_layers))
    weights = pair.target_weight_bytes + pair.lm_head_bytes + pair.drafter_bytes
    logits = 3 * batch * (num_drafts + 1) * t.vocab_size * 4
    prefill = next_pow2(batch * context) * (3 * t.intermediate_size + 4 * t.hidden_size) * pair.target.dtype.itemsize
    return (weights + kv + logits + prefill) / tensor_parallel_size(pair.target.mesh)


def device_memory_limit() -> int | None:
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # CPU backends may not report
        stats = {}
    return stats.get("bytes_limit")
