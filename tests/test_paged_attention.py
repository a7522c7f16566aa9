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
