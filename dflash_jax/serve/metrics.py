"""The server's Prometheus metrics, in a registry of its own (two servers in one process,
as in tests, would otherwise collide in the global one)."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dflash_jax.prefix_cache import PrefixCacheStats
from dflash_jax.requests import DraftCounts

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, max_block_size: int = 16):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("dflash_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=registry)
        self.finished = Counter("dflash_requests_finished", "Generation requests ended, by reason "
                                "(stop, length, abort: client gone or shutdown, error: the engine failed)",
                                ["reason"], registry=registry)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of admitted requests", registry=registry)
        self.completion_tokens = Counter("dflash_completion_tokens", "Tokens generated", registry=registry)
        self.accepted_length = Histogram(
            "dflash_accepted_length", "Tokens committed per verify cycle (1 + accepted drafts)",
            buckets=tuple(range(1, max_block_size + 1)), registry=registry)
        self.time_to_first_token = Histogram("dflash_time_to_first_token_seconds",
                                             "From submission to the engine to the first token",
                                             buckets=LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram(
            "dflash_inter_token_latency_seconds",
            "Time between a request's successive outputs divided by the tokens the later one brought",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.step_time = Histogram("dflash_engine_step_seconds", "Wall time of one Engine.step() call",
                                   buckets=LATENCY_BUCKETS, registry=registry)
        self.preemptions = Counter("dflash_preemptions", "Times a request was preempted (its KV cache recomputed)",
                                   registry=registry)
        self.queue_depth = Gauge("dflash_queue_depth", "Requests in the engine that have no token yet "
                                 "(waiting for a slot or in prefill)", registry=registry)
        self.open_requests = Gauge("dflash_requests_open", "Requests in the engine, not yet finished",
                                   registry=registry)
        # vLLM's speculative-decoding and cache names (vllm:spec_decode_*, vllm:kv_cache_usage_perc,
        # vllm:prefix_cache_*).
        self.spec_drafts = Counter("dflash_spec_decode_num_drafts", "Verify cycles that checked drafts",
                                   registry=registry)
        self.spec_draft_tokens = Counter("dflash_spec_decode_num_draft_tokens", "Drafts checked", registry=registry)
        self.spec_accepted_tokens = Counter("dflash_spec_decode_num_accepted_tokens", "Drafts accepted and committed",
                                            registry=registry)
        self.spec_accepted_per_pos = Counter(
            "dflash_spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted and committed, by position in the block (0: the first after the anchor)", ["position"],
            registry=registry)
        self.kv_cache_usage = Gauge("dflash_kv_cache_usage_perc", "Share of the KV cache pages held by requests (0-1)",
                                    registry=registry)
        self.prefix_cache_queries = Counter("dflash_prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache", registry=registry)
        self.prefix_cache_hits = Counter("dflash_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                         registry=registry)
        self._drafts_seen = DraftCounts()
        self._prefix_cache_seen = PrefixCacheStats()

    def count_drafts(self, counts: DraftCounts) -> None:
        """Bring the spec_decode counters up to an Engine's totals `counts`."""
        seen = self._drafts_seen
        self.spec_drafts.inc(counts.num_drafts - seen.num_drafts)
        self.spec_draft_tokens.inc(counts.num_draft_tokens - seen.num_draft_tokens)
        self.spec_accepted_tokens.inc(counts.num_accepted_tokens - seen.num_accepted_tokens)
        for position, total in enumerate(counts.accepted_per_position):
            before = seen.accepted_per_position[position] if position < len(seen.accepted_per_position) else 0
            self.spec_accepted_per_pos.labels(position=str(position)).inc(total - before)
        self._drafts_seen = dataclasses.replace(counts, accepted_per_position=list(counts.accepted_per_position))

    def count_prefix_cache(self, stats: PrefixCacheStats | None) -> None:
        """Bring the prefix-cache counters up to an Engine's totals (None: caching is off)."""
        if stats is None:
            return
        self.prefix_cache_queries.inc(stats.queries - self._prefix_cache_seen.queries)
        self.prefix_cache_hits.inc(stats.hits - self._prefix_cache_seen.hits)
        self._prefix_cache_seen = dataclasses.replace(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
