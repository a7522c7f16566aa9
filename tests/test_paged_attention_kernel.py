"""The Pallas paged-attention kernel (interpret mode on CPU) against the jnp reference
`paged_attention` and a float64 numpy oracle written per token from the definition, on
fuzzed ragged batches (verify blocks of 1..16 rows, prefill chunks, padding tokens and
rows), for every mask rule, GQA/MQA/MHA, bf16 and f32, pages of 16 and 32."""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels.paged_attention_reference import paged_attention_reference as paged_attention
from dflash_jax.config import LayerAttention
from pallas_kernels.paged_attention import (
    default_block_q,
    default_kv_splits,
    default_settings,
    paged_attention_pallas,
    query_blocks,
)
from pallas_kernels.common import TRITON_DEPRECATION

reference = jax.jit(paged_attention,
                    static_argnames=("page_size", "rule", "token_tile", "key_chunk"))

TOLERANCE = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=2e-2, rtol=2e-2)}


@dataclasses.dataclass(frozen=True)
class Config:
    """Static sizes of one fuzzed configuration: one compile of the kernel and reference."""

    rule: LayerAttention
    dtype: str
    page_size: int
    num_kv_heads: int
    group: int
    head_dim: int
    num_tokens: int      # T
    num_rows: int        # R, block-table rows
    table_width: int
    kernel_kwargs: tuple = ()

    @property
    def max_len(self):
        return self.page_size * self.table_width


# --------------------------------------------------------------------------------------
# The oracle: one token at a time, in float64.
# --------------------------------------------------------------------------------------

def oracle(batch, cfg, sinks=None):
    """out[t] = softmax over the visible keys of row q_req[t] of q.k / sqrt(H), times v (with
    `sinks`, each head's sink logit joins the softmax's denominator)."""
    q, k, v = (np.asarray(batch[name], np.float64) for name in ("q", "k", "v"))
    table, seq_lens, page = batch["table"], batch["seq_lens"], cfg.page_size
    num_kv_heads, group, head_dim = cfg.num_kv_heads, cfg.group, cfg.head_dim
    out = np.zeros(q.shape)
    for t, (row, qp) in enumerate(zip(batch["q_req"], batch["q_pos"])):
        key_pos = np.arange(seq_lens[row])
        visible = np.ones(len(key_pos), bool)
        if cfg.rule.causal:
            visible &= key_pos <= qp
        if cfg.rule.window is not None:
            visible &= qp - key_pos < cfg.rule.window
            if not cfg.rule.causal:
                visible &= key_pos - qp < cfg.rule.window
        if not visible.any():
            continue  # nothing visible: zeros
        slots = table[row, key_pos // page] * page + key_pos % page
        slots = slots[visible]
        for n in range(num_kv_heads * group):
            kv = n // group
            scores = k[slots, kv] @ q[t, n] / np.sqrt(head_dim)
            top = scores.max() if sinks is None else max(scores.max(), sinks[n])
            probs = np.exp(scores - top)
            out[t, n] = probs @ v[slots, kv] / (probs.sum() + (0 if sinks is None else np.exp(sinks[n] - top)))
    return out


# --------------------------------------------------------------------------------------
# Random ragged batches.
# --------------------------------------------------------------------------------------

def random_batch(rng, cfg, *, num_reqs, prefill_share=0.3, shuffle=False):
    """Requests with verify blocks (1..16 rows) or prefill chunks, contiguous as the runtime
    lays them out; the rest of the T tokens are padding (row 0 at position 0, as the
    runtime pads, or a batch row with no keys). Rows past num_reqs have seq_len 0."""
    T, R, L = cfg.num_tokens, cfg.num_rows, cfg.max_len
    q_req, q_pos, seq_lens = [], [], np.zeros(R, np.int32)
    for r in range(num_reqs):
        budget = T - len(q_req) - (num_reqs - r - 1)
        if budget < 1:
            break
        if rng.random() < prefill_share:
            n = int(rng.integers(1, min(budget, L) + 1))
        else:
            n = int(rng.integers(1, min(budget, 16) + 1))
        first = int(rng.integers(0, L - n + 1))
        # Keys up to the last query (the runtime's case), sometimes a few or many more.
        extra = rng.choice([0, int(rng.integers(0, 4)), int(rng.integers(0, L))], p=[0.5, 0.3, 0.2])
        seq_lens[r] = min(L, first + n + extra)
        q_req += [r] * n
        q_pos += range(first, first + n)
    while len(q_req) < T:
        if rng.random() < 0.5 or num_reqs >= R:
            q_req.append(0)
            q_pos.append(0)
        else:
            q_req.append(R - 1)  # a batch row with no keys: zeros
            q_pos.append(int(rng.integers(0, L)))
    q_req, q_pos = np.asarray(q_req, np.int32), np.asarray(q_pos, np.int32)
    if shuffle:
        order = rng.permutation(T)
        q_req, q_pos = q_req[order], q_pos[order]
    num_pages = 1 + R * cfg.table_width
    table = rng.permutation(np.arange(1, num_pages)).reshape(R, cfg.table_width)
    num_heads = cfg.num_kv_heads * cfg.group
    dtype = jnp.dtype(cfg.dtype)

    def normal(*shape):  # rounded to the input dtype, so the oracle sees what the kernel sees
        return np.asarray(jnp.asarray(rng.normal(size=shape), dtype).astype(jnp.float32))

    return dict(
        q=normal(T, num_heads, cfg.head_dim),
        q_pos=q_pos,
        q_req=q_req,
        k=normal(num_pages * cfg.page_size, cfg.num_kv_heads, cfg.head_dim),
        v=normal(num_pages * cfg.page_size, cfg.num_kv_heads, cfg.head_dim),
        table=table.astype(np.int32),
        seq_lens=seq_lens,
    )


def run(fn, batch, cfg, **kwargs):
    dtype = jnp.dtype(cfg.dtype)
    out = fn(jnp.asarray(batch["q"], dtype), batch["q_pos"], batch["q_req"],
             jnp.asarray(batch["k"], dtype), jnp.asarray(batch["v"], dtype), batch["table"],
             batch["seq_lens"], page_size=cfg.page_size, rule=cfg.rule, **kwargs)
    assert out.dtype == dtype
    return np.asarray(out.astype(jnp.float32))


def check_batch(batch, cfg, what):
    got = run(paged_attention_pallas, batch, cfg, **dict(cfg.kernel_kwargs))
    want_ref = run(reference, batch, cfg)
    want = oracle(batch, cfg)
    tol = TOLERANCE[cfg.dtype]
    assert not np.isnan(got).any(), f"{what}: unwritten (NaN) outputs"
    np.testing.assert_allclose(got, want, **tol, err_msg=f"{what}: kernel vs oracle")
    np.testing.assert_allclose(got, want_ref, **tol, err_msg=f"{what}: kernel vs reference")
    # Tokens whose row has no keys (or sees none) are exactly zero, like the reference's.
    empty = batch["seq_lens"][batch["q_req"]] == 0
    np.testing.assert_array_equal(got[empty], 0)


# --------------------------------------------------------------------------------------
# Fuzzing.
# --------------------------------------------------------------------------------------

CAUSAL, FULL = LayerAttention(True), LayerAttention(False)

FUZZ = {
    # name: (config, request counts, examples)
    "causal_gqa4_f32_p16": (Config(CAUSAL, "float32", 16, 2, 4, 32, 64, 6, 8), (1, 3, 6), 12),
    "causal_gqa2_bf16_p32": (Config(CAUSAL, "bfloat16", 32, 2, 2, 64, 48, 4, 4), (1, 2, 4), 10),
    "noncausal_mqa8_bf16_p16": (Config(FULL, "bfloat16", 16, 1, 8, 16, 40, 5, 6), (1, 5), 10),
    "window_causal_gqa3_f32_p32_split2": (
        Config(LayerAttention(True, 20), "float32", 32, 2, 3, 32, 48, 4, 5,
               (("kv_splits", 2),)), (1, 4), 10),
    "window_noncausal_mha_bf16_p16_bk16": (
        Config(LayerAttention(False, 24), "bfloat16", 16, 4, 1, 16, 40, 5, 6,
               (("block_k", 16),)), (1, 5), 10),
    "window5_noncausal_gqa4_f32_p16_bk16": (
        Config(LayerAttention(False, 5), "float32", 16, 2, 4, 16, 32, 4, 6,
               (("block_k", 16),)), (1, 4), 10),
    "decode_rows_causal_f32_p16": (Config(CAUSAL, "float32", 16, 2, 4, 32, 8, 8, 8), (4, 8), 8),
    # the drafter's rows: non-causal, full and windowed, with the splits the runtime picks at batch 1
    "noncausal_gqa2_f32_p16_split16": (
        Config(FULL, "float32", 16, 2, 2, 32, 48, 4, 6, (("kv_splits", 16), ("block_k", 16))), (1, 2), 6),
    "window_noncausal_gqa2_bf16_p16_split8": (
        Config(LayerAttention(False, 12), "bfloat16", 16, 2, 2, 32, 48, 4, 6, (("kv_splits", 8),)), (1, 2), 6),
    "causal_f32_p16_split4_bq4": (
        Config(CAUSAL, "float32", 16, 2, 4, 32, 48, 4, 8,
               (("kv_splits", 4), ("block_k", 16), ("block_q", 4))), (1, 4), 8),
    "causal_gqa4_bf16_p16_split4_pages_ahead": (
        Config(CAUSAL, "bfloat16", 16, 2, 4, 32, 64, 6, 8,
               (("kv_splits", 4), ("block_k", 16), ("pages_ahead", True))), (1, 3), 4),
}


@pytest.mark.parametrize("name", list(FUZZ))
def test_fuzz_kernel_reference_oracle(name):
    cfg, request_counts, examples = FUZZ[name]

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**32 - 1), num_reqs=st.sampled_from(request_counts),
           prefill_share=st.sampled_from([0.0, 0.3, 1.0]),
           shuffle=st.sampled_from([False] * 4 + [True]))
    def check(seed, num_reqs, prefill_share, shuffle):
        batch = random_batch(np.random.default_rng(seed), cfg, num_reqs=num_reqs,
                             prefill_share=prefill_share, shuffle=shuffle)
        check_batch(batch, cfg, f"{name} seed={seed}")

    check()


# --------------------------------------------------------------------------------------
# Explicit cases.
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("splits", [1, 4])
def test_attention_sinks(splits):
    """gpt-oss's sinks: a logit per query head in the denominator, one key split or several."""
    cfg = Config(LayerAttention(True, 20), "float32", 16, 2, 4, 32, 48, 4, 6, (("kv_splits", splits),))
    rng = np.random.default_rng(splits)
    batch = random_batch(rng, cfg, num_reqs=3, prefill_share=0.3, shuffle=False)
    sinks = rng.normal(size=cfg.num_kv_heads * cfg.group).astype(np.float32) * 2
    want = oracle(batch, cfg, sinks)
    for fn, kwargs in ((reference, {}), (paged_attention_pallas, dict(cfg.kernel_kwargs))):
        got = run(fn, batch, cfg, sinks_U=jnp.asarray(sinks), **kwargs)
        np.testing.assert_allclose(got, want, **TOLERANCE["float32"], err_msg=fn.__name__)
    assert np.abs(want - oracle(batch, cfg)).max() > 1e-2  # the sinks changed the outputs


def test_query_blocks_docstring_example():
    blocks = query_blocks(jnp.array([0, 0, 0, 0, 0, 0, 1, 2, 2, 2, 0, 0]), 4)
    assert np.asarray(blocks.first).tolist() == [0, 4, 6, 7, 10] + [12] * 8
    assert np.asarray(blocks.num_blocks).tolist() == [5]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_chunk_with_verify_rows_and_padding(dtype):
    """A 100-token prefill chunk, then a 16-row and a 1-row verify block, then padding."""
    cfg = Config(CAUSAL, dtype, 16, 2, 4, 32, 128, 4, 10)
    rng = np.random.default_rng(1)
    batch = random_batch(rng, cfg, num_reqs=0)
    q_req = np.array([0] * 100 + [1] * 16 + [2] + [0] * 11, np.int32)
    q_pos = np.r_[np.arange(30, 130), np.arange(140, 156), [7], [0] * 11].astype(np.int32)
    batch.update(q_req=q_req, q_pos=q_pos, seq_lens=np.array([130, 156, 8, 0], np.int32))
    check_batch(batch, cfg, "prefill")
    # The same with hoisted query blocks, a smaller block_q, and key splits.
    blocks = query_blocks(q_req, 8)
    got = run(paged_attention_pallas, batch, cfg, block_q=8, blocks=blocks, kv_splits=2)
    np.testing.assert_allclose(got, oracle(batch, cfg), **TOLERANCE[dtype])


@pytest.mark.parametrize("num_tokens, num_rows, kv_heads, want", [
    (1, 1, 8, 32),      # batch-1 decode: 8 programs alone would each walk every chunk
    (16, 1, 8, 32),     # batch-1 verify block: one query block
    (8, 8, 8, 4),       # batch-8 decode: a block a row
    (128, 8, 8, 4),     # batch-8 verify
    (32, 32, 8, 1),     # batch-32 decode fills the GPU without splits
    (2048, 1, 8, 1),    # a prefill chunk
    (1, 1, 4, 32),      # Qwen3.5-9B's 4 kv heads: at most 32 splits
    (16, 1, 4, 32),
    (8, 8, 4, 8),
    (1, 1, 2, 32),
    (4, 4, 3, 16),      # SmolLM2's 3 kv heads: 256 / 3 / 4 blocks rounds down to a power of two
])
def test_key_splits_follow_the_query_blocks(num_tokens, num_rows, kv_heads, want):
    block_q = default_block_q(num_tokens, num_rows, group=4)
    assert default_kv_splits(num_tokens, num_rows, block_q, kv_heads) == want


@pytest.mark.parametrize("kv_heads", range(1, 17))
def test_key_splits_are_a_power_of_two_the_kernel_accepts(kv_heads):
    for num_rows in (1, 2, 3, 4, 5, 8, 16, 32):
        for num_tokens in (num_rows, 4 * num_rows, 16 * num_rows):
            block_q = default_block_q(num_tokens, num_rows, group=4)
            splits = default_kv_splits(num_tokens, num_rows, block_q, kv_heads)
            assert 1 <= splits <= 32 and splits & (splits - 1) == 0, (num_tokens, num_rows, kv_heads, splits)


AHEAD = dict(block_k=64, num_stages=3, pages_ahead=True)


@pytest.mark.parametrize("kv_splits, block_rows, head_dim, f32, want", [
    (32, 64, 256, False, dict(AHEAD, num_warps=8)),   # Qwen3.5 verify block
    (32, 16, 256, False, dict(AHEAD, num_warps=4)),   # its decode step
    (32, 64, 128, False, dict(AHEAD, num_warps=4)),   # its drafter's block
    (1, 64, 256, False, dict(block_k=64, num_stages=2, pages_ahead=False, num_warps=4)),  # unsplit: prefill, big batches
    (4, 16, 256, False, dict(block_k=128, num_stages=2, pages_ahead=False, num_warps=4)),  # a few splits: programs
    # enough to hide the waits
    (32, 64, 128, True, dict(block_k=64, num_stages=2, pages_ahead=False, num_warps=4)),  # three stages of float32
    # tiles would not fit shared memory
    (32, 128, 256, False, dict(block_k=64, num_stages=2, pages_ahead=False, num_warps=8)),  # nor would 128 x 256's
])
def test_split_calls_load_ahead_where_their_tiles_fit(kv_splits, block_rows, head_dim, f32, want):
    assert default_settings(kv_splits, block_rows, head_dim, f32) == want


@pytest.mark.parametrize("num_tokens, num_rows, group, want_bf16, want_f32", [
    (16, 1, 3, 16, 8),       # SmolLM2 verify block: 64 rows in bf16, 32 in float32
    (2048, 1, 4, 32, 8),     # a prefill chunk: 128 rows / 32 rows
    (1, 1, 4, 4, 4),         # decode: 16 rows either way
])
def test_float32_query_blocks_stay_small(num_tokens, num_rows, group, want_bf16, want_f32):
    assert default_block_q(num_tokens, num_rows, group) == want_bf16
    assert default_block_q(num_tokens, num_rows, group, f32=True) == want_f32


def test_rows_with_nothing_visible_are_zero():
    """Windowed non-causal rows far past their keys, and rows of an empty batch row."""
    cfg = Config(LayerAttention(False, 4), "float32", 16, 2, 2, 16, 16, 3, 4)
    batch = random_batch(np.random.default_rng(2), cfg, num_reqs=0)
    batch.update(q_req=np.array([0] * 8 + [1] * 8, np.int32),
                 q_pos=np.r_[np.arange(50, 58), np.arange(8)].astype(np.int32),
                 seq_lens=np.array([20, 0, 0], np.int32))
    got = run(paged_attention_pallas, batch, cfg)
    np.testing.assert_array_equal(got, 0)
    np.testing.assert_array_equal(run(reference, batch, cfg), 0)


def test_reference_knobs_are_accepted():
    cfg = Config(CAUSAL, "float32", 16, 1, 16, 16, 16, 2, 2)
    batch = random_batch(np.random.default_rng(3), cfg, num_reqs=2)
    got = run(paged_attention_pallas, batch, cfg, token_tile=8, key_chunk=32)
    np.testing.assert_allclose(got, oracle(batch, cfg), **TOLERANCE["float32"])


def test_bad_inputs_are_value_errors():
    q = jnp.zeros((4, 4, 12), jnp.float32)
    kv = jnp.zeros((32, 2, 12), jnp.float32)
    args = (jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32))
    table, lens = jnp.zeros((1, 2), jnp.int32), jnp.zeros(1, jnp.int32)
    with pytest.raises(ValueError, match="power of two >= 16"):
        paged_attention_pallas(q, *args, kv, kv, table, lens, page_size=16, rule=CAUSAL)
    q, kv = jnp.zeros((4, 4, 16), jnp.float32), jnp.zeros((32, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="share one of"):
        paged_attention_pallas(q, *args, kv, kv, table, lens, page_size=16, rule=CAUSAL)
    kv = kv.astype(jnp.float32)
    with pytest.raises(ValueError, match="block_k must be"):
        paged_attention_pallas(q, *args, kv, kv, table, lens, page_size=16, rule=CAUSAL,
                               block_k=8)
    with pytest.raises(ValueError, match="blocks were cut with block_q=16"):
        paged_attention_pallas(q, *args, kv, kv, table, lens, page_size=16, rule=CAUSAL,
                               block_q=8, blocks=query_blocks(args[1], 16))


# --------------------------------------------------------------------------------------
# GPU: the compiled (Triton) kernel against the reference at Qwen3-8B attention shapes.
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads", ["qwen3-8b", "qwen3_5-9b", "gpt-oss-20b"])
@pytest.mark.parametrize("settings", [dict(kv_splits=1), dict(kv_splits=16),
                                      dict(kv_splits=16, pages_ahead=True, num_stages=3)],
                         ids=["splits1", "splits16", "splits16_ahead_stages3"])
def test_kernel_lowers_to_triton_for_a_gpu_from_any_host(heads, settings):
    """A 17-row verify block over 32k keys with each model's heads (query heads, kv heads, head
    dim; gpt-oss: a 128-key window and sinks) lowers for CUDA to one Triton call (the splits'
    merge is XLA's)."""
    from conftest import triton_calls_for_cuda

    num_heads, num_kv_heads, head_dim, rule = {
        "qwen3-8b": (32, 8, 128, CAUSAL), "qwen3_5-9b": (16, 4, 256, CAUSAL),
        "gpt-oss-20b": (64, 8, 64, LayerAttention(True, 128))}[heads]
    T, page_size, pages = 17, 16, 2048
    S = jax.ShapeDtypeStruct
    arrays = [S((T, num_heads, head_dim), jnp.bfloat16), S((T,), jnp.int32), S((T,), jnp.int32),
              S((pages * page_size, num_kv_heads, head_dim), jnp.bfloat16),
              S((pages * page_size, num_kv_heads, head_dim), jnp.bfloat16), S((1, pages), jnp.int32), S((1,), jnp.int32)]
    sinks = [S((num_heads,), jnp.float32)] if heads == "gpt-oss-20b" else []

    def kernel(*a):
        return paged_attention_pallas(*a[:7], page_size=page_size, rule=rule, **settings, interpret=False,
                                      sinks_U=a[7] if sinks else None)

    assert triton_calls_for_cuda(kernel, *arrays, *sinks) == 1


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel_kwargs", [(), (("kv_splits", 4),), (("kv_splits", 16),),
                                           (("kv_splits", 16), ("pages_ahead", True), ("num_stages", 3))],
                         ids=["splits1", "splits4", "splits16", "splits16_ahead_stages3"])
@pytest.mark.parametrize("rule", [CAUSAL, FULL, LayerAttention(True, 64),
                                  LayerAttention(False, 64)], ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_compiled_kernel_matches_reference(dtype, rule, kernel_kwargs):
    cfg = Config(rule, dtype, 16, 8, 4, 128, 512, 16, 64, kernel_kwargs)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
        for num_reqs in (1, 5, 16):
            batch = random_batch(rng, cfg, num_reqs=num_reqs, prefill_share=0.3)
            got = run(functools.partial(paged_attention_pallas, interpret=False), batch, cfg,
                      **dict(kernel_kwargs))
            with jax.default_matmul_precision("highest"):  # no TF32 in the f32 reference
                want = run(reference, batch, cfg)
            assert not np.isnan(got).any()
            np.testing.assert_allclose(got, want, **TOLERANCE[dtype])
