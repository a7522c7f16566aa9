"""KV caches stored as their values' bits where the jnp references write them on a CPU: the
same values read back, written in place (no step copies a cache), and a step's memory that
does not grow with the Engine's max length."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from conftest import make_hf_target, save_hf
from dflash_jax.kernels import REFERENCE, Kernels
from dflash_jax.kv_cache import kv_cache_bytes, storage_dtype
from pallas_kernels.attention_mask import CAUSAL
from pallas_kernels.common import as_stored, as_values
from pallas_kernels.finish_heads import write_slots
from pallas_kernels.paged_attention_reference import paged_attention_reference

PAGE = 4


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's storage choice")
def test_storage_dtype_on_a_cpu():
    assert storage_dtype(jnp.bfloat16, REFERENCE) == jnp.uint16
    assert storage_dtype(jnp.float16, Kernels()) == jnp.uint16  # "auto" is the reference on a CPU
    assert storage_dtype(jnp.float32, REFERENCE) == jnp.float32
    assert storage_dtype(jnp.bfloat16, Kernels(attention="pallas")) == jnp.bfloat16  # the kernel's own form


def test_writes_and_reads_through_bits_equal_those_of_values():
    """The same rows written to a bfloat16 cache and to one of its bits, then attended to
    through two rows' page tables, give bit-identical caches and outputs; pad slots write nothing."""
    rng = np.random.default_rng(0)
    num_slots, kv_heads, head_dim = 8 * PAGE, 2, 8
    values = jnp.asarray(rng.normal(size=(num_slots, kv_heads, head_dim)), jnp.bfloat16)
    bits = as_stored(values, jnp.uint16)
    rows = jnp.asarray(rng.normal(size=(5, kv_heads, head_dim)), jnp.bfloat16)
    slots = jnp.array([3, -1, 9, 10, 30], jnp.int32)
    written = write_slots(values, slots, rows)
    written_bits = write_slots(bits, slots, rows)
    assert written_bits.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(as_values(written_bits, jnp.bfloat16)), np.asarray(written))
    np.testing.assert_array_equal(np.asarray(written[1]), np.asarray(values[1]))  # untouched by the pad slot

    q = jnp.asarray(rng.normal(size=(6, 4, head_dim)), jnp.bfloat16)
    positions, q_rows = jnp.array([0, 1, 2, 0, 1, 2], jnp.int32), jnp.array([0, 0, 0, 1, 1, 1], jnp.int32)
    table = jnp.array([[1, 2], [3, 7]], jnp.int32)
    seq_lens = jnp.array([3, 3], jnp.int32)
    args = dict(page_size=PAGE, rule=CAUSAL)
    out = paged_attention_reference(q, positions, q_rows, written, written, table, seq_lens, **args)
    out_bits = paged_attention_reference(q, positions, q_rows, written_bits, written_bits, table, seq_lens, **args)
    np.testing.assert_array_equal(np.asarray(out_bits), np.asarray(out))


def test_rows_of_another_width_are_refused():
    with pytest.raises(ValueError, match="cannot go to a cache of uint16 bits"):
        write_slots(jnp.zeros((4, 1, 2), jnp.uint16), jnp.array([0]), jnp.ones((1, 1, 2), jnp.float32))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the reference kernels' storage, on a CPU")
@pytest.mark.parametrize("cycles_per_step", [1, 3])
def test_engine_steps_write_the_caches_in_place(tmp_path, cycles_per_step):
    """A bfloat16 Engine at an 8192-position max length: every step program's temporary
    memory is a small fraction of the caches. A step that copied them needs their size or
    twice it: a float32 round trip around a bfloat16 scatter does that on a CPU, and so did
    one-token steps whose attention read the caches through a view taken outside its loop.
    Steps of several cycles carry the caches through a loop, in place as well."""
    target = dflash_jax.load_target(save_hf(make_hf_target(seed=1, max_position_embeddings=8192), tmp_path / "t"),
                                    dtype="bfloat16")
    engine = dflash_jax.Engine(target, None, max_num_reqs=2, max_num_tokens=16, cycles_per_step=cycles_per_step)
    cache = kv_cache_bytes(num_layers=target.cfg.num_layers, num_pages=engine.scheduler.allocator.num_pages,
                           page_size=engine.page_size, num_kv_heads=target.cfg.num_kv_heads,
                           head_dim=target.cfg.head_dim, dtype=target.dtype)
    for program in engine.programs:
        memory = engine.memory_analysis(program)
        assert memory.alias_size_in_bytes >= cache  # donated: the caches come back in their own buffers
        assert memory.temp_size_in_bytes < cache / 8, (program, memory.temp_size_in_bytes, cache)
