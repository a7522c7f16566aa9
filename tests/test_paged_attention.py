"""paged_attention (chunked online softmax over pages) against dense attention per token."""

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.attention import dense_attention
from pallas_kernels.attention_mask import position_mask
from pallas_kernels.paged_attention_reference import paged_attention_reference as paged_attention
from dflash_jax.config import LayerAttention

RULES = [LayerAttention(True), LayerAttention(False), LayerAttention(True, 5), LayerAttention(False, 9)]


@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("page_size, key_chunk", [(4, 32), (16, 256), (1, 8)])
@pytest.mark.parametrize("one_row", [False, True], ids=["rows", "one-row"])  # one row: keys gathered once
def test_paged_attention_equals_dense(rule, page_size, key_chunk, one_row):
    rng = np.random.default_rng(page_size)
    num_kv_heads, group, head_dim, num_rows, max_blocks = 2, 3, 8, 3, 160 // page_size
    num_pages = 1 + num_rows * max_blocks
    k = jnp.asarray(rng.normal(size=(num_pages * page_size, num_kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(num_pages * page_size, num_kv_heads, head_dim)), jnp.float32)
    table = rng.permutation(np.arange(1, num_pages)).reshape(num_rows, max_blocks).astype(np.int32)
    seq_lens = np.array([150, 7, 0], np.int32)  # a long row, a short one, padding
    rows = np.array([0] * 70 + [1] * 5 + [2] * 3, np.int32)  # 78 tokens: more than one tile
    positions = np.concatenate([np.arange(80, 150), np.arange(2, 7), [0, 0, 0]]).astype(np.int32)
    if one_row:  # a batch of one: its 78 tokens (e.g. a prompt chunk) all in row 0
        table, seq_lens, rows, positions = table[:1], seq_lens[:1], np.zeros(78, np.int32), np.arange(72, 150, dtype=np.int32)
    q = jnp.asarray(rng.normal(size=(len(rows), num_kv_heads * group, head_dim)), jnp.float32)
    out = np.asarray(paged_attention(
        q, jnp.asarray(positions), jnp.asarray(rows), k, v, jnp.asarray(table), jnp.asarray(seq_lens),
        page_size=page_size, rule=rule, key_chunk=key_chunk,
    ))
    for t, row in enumerate(rows):
        if seq_lens[row] == 0:
            np.testing.assert_array_equal(out[t], 0)  # padding rows read nothing
            continue
        key_pos = np.arange(seq_lens[row])
        slots = table[row, key_pos // page_size] * page_size + key_pos % page_size
        mask = position_mask(jnp.asarray(positions[t : t + 1]), jnp.asarray(key_pos), rule)
        expected = dense_attention(q[t : t + 1], k[slots], v[slots], mask)[0]
        np.testing.assert_allclose(out[t], expected, atol=2e-6)


def numpy_attention(q, positions, rows, k, v, table, seq_lens, page_size, rule):
    """Per token, a float64 softmax over exactly the keys its row holds and `rule` lets it see."""
    out = np.zeros(q.shape, np.float64)
    group = q.shape[1] // k.shape[1]
    for t, (row, q_pos) in enumerate(zip(rows, positions)):
        key_pos = np.arange(seq_lens[row])
        visible = np.ones(len(key_pos), bool)
        if rule.causal:
            visible &= key_pos <= q_pos
        if rule.window is not None:
            visible &= q_pos - key_pos < rule.window
            if not rule.causal:
                visible &= key_pos - q_pos < rule.window
        key_pos = key_pos[visible]
        slots = table[row, key_pos // page_size] * page_size + key_pos % page_size
        for n in range(q.shape[1]):
            if len(slots):
                scores = k[slots, n // group].astype(np.float64) @ q[t, n] / np.sqrt(q.shape[-1])
                probs = np.exp(scores - scores.max())
                out[t, n] = probs / probs.sum() @ v[slots, n // group]
    return out


def ragged_batch(layout, rng):
    """(rows, positions, seq_lens) of the tokens: rows interleaved, one token per row (decode),
    or long runs of a row out of order; then padding tokens (row 0, position 0) as the runtime
    pads. Row 2 has no keys (a padding row)."""
    seq_lens = np.array([40, 3, 0, 48, 17, 25, 9, 31, 1], np.int32)
    if layout == "interleaved":
        rows = rng.choice(len(seq_lens), 30)
    elif layout == "decode":
        rows = rng.permutation(len(seq_lens))
    else:
        rows = np.repeat(rng.permutation([0, 3, 5, 7]), 9)
    positions = np.array([rng.integers(0, max(seq_lens[r], 1)) for r in rows])
    if layout == "decode":
        positions = np.maximum(seq_lens[rows] - 1, 0)
    rows, positions = np.concatenate([rows, [0] * 5]), np.concatenate([positions, [0] * 5])
    return rows.astype(np.int32), positions.astype(np.int32), seq_lens


@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("layout, key_chunk, token_tile", [
    ("interleaved", 8, 64),  # many small key chunks; query blocks cut wherever the row changes
    ("decode", 256, 64),     # one token per row: query blocks batched to a step; one chunk per row
    ("runs", 8, 4),          # runs of 9 tokens cut into query blocks of 4
])
def test_several_rows_equal_numpy_softmax(rule, layout, key_chunk, token_tile):
    """The reference with several block-table rows against a float64 numpy softmax per token,
    on a ragged batch whose rows are out of order, with padding tokens and a padding row."""
    rng = np.random.default_rng(7)
    page_size, num_kv_heads, group, head_dim, max_pages = 4, 2, 3, 8, 12
    rows, positions, seq_lens = ragged_batch(layout, rng)
    num_pages = 1 + len(seq_lens) * max_pages
    k = rng.normal(size=(num_pages * page_size, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.normal(size=(num_pages * page_size, num_kv_heads, head_dim)).astype(np.float32)
    table = rng.permutation(np.arange(1, num_pages)).reshape(len(seq_lens), max_pages).astype(np.int32)
    q = rng.normal(size=(len(rows), num_kv_heads * group, head_dim)).astype(np.float32)
    out = np.asarray(paged_attention(
        jnp.asarray(q), jnp.asarray(positions), jnp.asarray(rows), jnp.asarray(k), jnp.asarray(v),
        jnp.asarray(table), jnp.asarray(seq_lens), page_size=page_size, rule=rule, key_chunk=key_chunk,
        token_tile=token_tile,
    ))
    expected = numpy_attention(q, positions, rows, k, v, table, seq_lens, page_size, rule)
    np.testing.assert_allclose(out, expected, atol=2e-6)
    np.testing.assert_array_equal(out[rows == 2], 0)  # a row with no keys reads nothing
