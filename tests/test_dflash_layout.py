"""The DFlash layout: Pallas kernel (interpret mode on CPU), jnp reference, and a numpy
oracle written per request straight from the spec (section 6), on fuzzed batches and
on one explicit test per rule."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels.dflash_layout import DFlashLayout, prepare_dflash_inputs

MASK = 151669
FIELDS = [f.name for f in dataclasses.fields(DFlashLayout)]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The static sizes of one fuzzed configuration (one compile per request count)."""

    max_num_reqs: int
    num_steps: int        # N
    block_size: int       # page
    max_blocks: int       # block table width W
    num_target_rows: int  # T
    max_model_len: int
    cp_size: int = 1
    cp_interleave: int = 1
    extra_query_rows: int = 5   # max_num_tokens = max_num_reqs * (1 + N) + this

    @property
    def max_num_tokens(self):
        return self.max_num_reqs * (self.num_steps + 1) + self.extra_query_rows

    def static_kwargs(self):
        return dict(block_size=self.block_size, parallel_drafting_token_id=MASK,
                    num_speculative_steps=self.num_steps, max_num_reqs=self.max_num_reqs,
                    max_num_tokens=self.max_num_tokens, max_model_len=self.max_model_len,
                    cp_size=self.cp_size, cp_interleave=self.cp_interleave)


# --------------------------------------------------------------------------------------
# The oracle: one request at a time, as the spec words it.
# --------------------------------------------------------------------------------------

def oracle_layout(batch, sizes, cp_rank=0, pad_slot=-1):
    s, b = sizes, batch
    page, C, I, W = s.block_size, s.cp_size, s.cp_interleave, s.max_blocks
    N, Q, L, MR = s.num_steps, s.num_steps + 1, s.max_model_len, s.max_num_reqs
    T, R = len(b["target_positions"]), len(b["idx_mapping"])

    def slot_block(r, pos):
        return b["block_table"][r][min(pos // (page * C), W - 1)]

    def slot(r, pos):
        block = slot_block(r, pos)
        if block == 0:
            return pad_slot                      # the null page: no K/V write
        o = pos % (page * C)
        if (o // I) % C != cp_rank:
            return pad_slot                      # another rank holds this token
        return block * page + (o // (I * C)) * I + o % I

    out = dict(input_ids=[0] * s.max_num_tokens, query_positions=[0] * s.max_num_tokens,
               query_slot_mapping=[pad_slot] * s.max_num_tokens,
               query_start_loc=[R * Q] * (MR + 1), seq_lens=[0] * MR,
               context_positions=[0] * T, context_slot_mapping=[pad_slot] * T,
               sample_indices=[0] * (MR * N), sample_pos=[0] * (MR * N),
               sample_idx_mapping=[-1] * (MR * N), temperature=[0.0] * MR, seeds=[0] * MR)
    for r in range(R):
        start, end = b["target_query_start_loc"][r], b["target_query_start_loc"][r + 1]
        num_valid = end - start - b["num_rejected"][r]
        for j in range(num_valid):               # rejected rows stay at 0 / pad
            pos = b["target_positions"][start + j]
            if slot_block(r, pos) != 0:          # so do rows on the null page
                out["context_positions"][start + j] = pos
                out["context_slot_mapping"][start + j] = slot(r, pos)
        last_valid_pos = b["target_positions"][start + num_valid - 1]
        state = b["idx_mapping"][r]
        if b["num_sampled"][r] > 0:
            bonus = b["last_sampled"][state]
        else:
            bonus = b["next_prefill_tokens"][state]
        for k in range(Q):
            row, pos = r * Q + k, last_valid_pos + 1 + k
            out["input_ids"][row] = bonus if k == 0 else MASK
            out["query_positions"][row] = min(pos, L - 1)
            out["query_slot_mapping"][row] = slot(r, pos)
            if k >= 1:
                out["sample_indices"][r * N + k - 1] = row
                out["sample_pos"][r * N + k - 1] = pos
                out["sample_idx_mapping"][r * N + k - 1] = state
        out["query_start_loc"][r] = r * Q
        out["seq_lens"][r] = min(last_valid_pos + 1 + Q, L)
        out["temperature"][state] = b["temperature"][state]
        out["seeds"][state] = b["seeds"][state]
    return {k: np.asarray(v, np.float32 if k == "temperature" else np.int32)
            for k, v in out.items()}


# --------------------------------------------------------------------------------------
# Random batches.
# --------------------------------------------------------------------------------------

def random_batch(rng, sizes, num_reqs, *, prefill_share=0.4, near_end_share=0.3,
                 null_page_share=0.2, leading_rows=0):
    """A valid ragged batch: verify requests (1 + N rows, 0..N rejected) and chunked
    prefill requests in a shuffled order of request states, padded target rows after."""
    s, R = sizes, num_reqs
    Q, L = s.num_steps + 1, s.max_model_len
    rows_left = s.num_target_rows - leading_rows
    starts, positions = [leading_rows], list(rng.integers(0, L, leading_rows))
    num_rejected, num_sampled = [], []
    for r in range(R):
        budget = rows_left - (R - r - 1)          # leave a row for every later request
        if rng.random() < prefill_share:
            num_ctx = int(rng.integers(1, max(1, min(budget, 3 * Q)) + 1))
            rejected, sampled = 0, int(rng.random() < 0.3)
        else:
            num_ctx = min(Q, budget)
            rejected = int(rng.integers(0, num_ctx))
            sampled = int(rng.integers(1, Q + 1))
        if rng.random() < near_end_share:
            first = L - num_ctx - int(rng.integers(0, min(Q, L - num_ctx) + 1))
        else:
            first = int(rng.integers(0, L - num_ctx + 1))
        positions += range(first, first + num_ctx)
        starts.append(starts[-1] + num_ctx)
        rows_left -= num_ctx
        num_rejected.append(rejected)
        num_sampled.append(sampled)
    positions += list(rng.integers(0, L, s.num_target_rows - len(positions)))
    block_table = rng.integers(1, 1000, (R, s.max_blocks))
    block_table[rng.random((R, s.max_blocks)) < null_page_share] = 0
    MR = s.max_num_reqs
    return dict(
        target_positions=np.asarray(positions, np.int32),
        target_query_start_loc=np.asarray(starts, np.int32),
        idx_mapping=rng.permutation(MR)[:R].astype(np.int32),
        last_sampled=rng.integers(0, 150000, MR).astype(np.int32),
        next_prefill_tokens=rng.integers(0, 150000, MR).astype(np.int32),
        num_sampled=np.asarray(num_sampled, np.int32),
        num_rejected=np.asarray(num_rejected, np.int32),
        temperature=rng.random(MR).astype(np.float32),
        seeds=rng.integers(0, 2**31 - 1, MR).astype(np.int32),
        block_table=block_table.astype(np.int32))


def assert_layout_equal(layout, expected, what):
    for name in FIELDS:
        got = np.asarray(getattr(layout, name))
        want = np.asarray(expected[name])
        assert got.dtype == want.dtype, f"{what}: {name} dtype {got.dtype} != {want.dtype}"
        np.testing.assert_array_equal(got, want, err_msg=f"{what}: {name}")


def as_dict(layout):
    return {name: np.asarray(getattr(layout, name)) for name in FIELDS}


def assert_layout_equal_dict(got, want):
    for name in FIELDS:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# --------------------------------------------------------------------------------------
# Fuzzing: kernel (interpret mode) == reference == oracle.
# --------------------------------------------------------------------------------------

FUZZ_SIZES = {
    # name: (sizes, request counts drawn from, examples)
    "plain": (Sizes(8, 3, 4, 6, 40, 96), (1, 2, 5, 8), 200),
    "page1_n1": (Sizes(6, 1, 1, 24, 24, 40), (1, 2, 6), 160),
    "n15_cp2": (Sizes(4, 15, 16, 3, 72, 120, cp_size=2), (1, 2, 4), 160),
    "page64_cp4_i4": (Sizes(5, 7, 64, 2, 48, 700, cp_size=4, cp_interleave=4), (1, 3, 5), 160),
    "cp3_i2_prefill": (Sizes(3, 5, 8, 5, 90, 80, cp_size=3, cp_interleave=2), (1, 3), 160),
    "near_len": (Sizes(7, 4, 2, 9, 40, 24), (1, 4, 7), 160),
}


@pytest.mark.parametrize("config", list(FUZZ_SIZES))
def test_fuzz_kernel_reference_oracle(config):
    sizes, request_counts, examples = FUZZ_SIZES[config]

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**32 - 1), num_reqs=st.sampled_from(request_counts),
           cp_rank=st.integers(0, sizes.cp_size - 1), leading_rows=st.sampled_from([0, 0, 0, 2]),
           prefill_share=st.sampled_from([0.0, 0.4, 1.0]))
    def check(seed, num_reqs, cp_rank, leading_rows, prefill_share):
        batch = random_batch(np.random.default_rng(seed), sizes, num_reqs,
                             prefill_share=prefill_share, leading_rows=leading_rows)
        expected = oracle_layout(batch, sizes, cp_rank)
        for impl in ("pallas", "reference"):
            layout = prepare_dflash_inputs(**batch, **sizes.static_kwargs(), cp_rank=cp_rank,
                                           impl=impl)
            assert_layout_equal(layout, expected, f"{impl} seed={seed}")

    check()


# --------------------------------------------------------------------------------------
# One test per rule, on both implementations.
# --------------------------------------------------------------------------------------

IMPLS = ["pallas", "reference"]
EXAMPLE_SIZES = Sizes(max_num_reqs=4, num_steps=2, block_size=4, max_blocks=4,
                      num_target_rows=8, max_model_len=64, extra_query_rows=4)


def example_batch(**changes):
    """The module docstring's worked example; request states 2 and 0."""
    batch = dict(
        target_positions=np.array([9, 10, 11, 0, 1, 2, 3, 4], np.int32),
        target_query_start_loc=np.array([0, 3, 8], np.int32),
        idx_mapping=np.array([2, 0], np.int32),
        last_sampled=np.array([100, 101, 102, 103], np.int32),
        next_prefill_tokens=np.array([200, 201, 202, 203], np.int32),
        num_sampled=np.array([1, 0], np.int32),
        num_rejected=np.array([1, 0], np.int32),
        temperature=np.array([0.5, 0.25, 0.75, 1.0], np.float32),
        seeds=np.array([7, 8, 9, 10], np.int32),
        block_table=np.array([[5, 0, 7, 2], [3, 6, 1, 1]], np.int32))
    batch.update({k: np.asarray(v, batch[k].dtype) for k, v in changes.items()})
    return batch


def run(impl, batch, sizes=EXAMPLE_SIZES, **kwargs):
    layout = prepare_dflash_inputs(**batch, **{**sizes.static_kwargs(), **kwargs}, impl=impl)
    return as_dict(layout)


@pytest.mark.parametrize("impl", IMPLS)
def test_worked_example(impl):
    out = run(impl, example_batch())
    assert out["context_positions"].tolist() == [9, 10, 0, 0, 1, 2, 3, 4]
    assert out["context_slot_mapping"].tolist() == [29, 30, -1, 12, 13, 14, 15, 24]
    assert out["query_positions"].tolist() == [11, 12, 13, 5, 6, 7] + [0] * 10
    assert out["query_slot_mapping"].tolist() == [31, 8, 9, 25, 26, 27] + [-1] * 10
    assert out["input_ids"].tolist() == [102, MASK, MASK, 200, MASK, MASK] + [0] * 10
    assert out["sample_indices"].tolist() == [1, 2, 4, 5, 0, 0, 0, 0]
    assert out["sample_pos"].tolist() == [12, 13, 6, 7, 0, 0, 0, 0]
    assert out["sample_idx_mapping"].tolist() == [2, 2, 0, 0, -1, -1, -1, -1]
    assert out["query_start_loc"].tolist() == [0, 3, 6, 6, 6]
    assert out["seq_lens"].tolist() == [14, 8, 0, 0]
    assert out["temperature"].tolist() == [0.5, 0.0, 0.75, 0.0]
    assert out["seeds"].tolist() == [7, 0, 9, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_rejected_rows_get_position_zero_and_pad_slot(impl):
    out = run(impl, example_batch(num_rejected=[2, 3]))
    assert out["context_positions"].tolist() == [9, 0, 0, 0, 1, 0, 0, 0]
    assert out["context_slot_mapping"].tolist() == [29, -1, -1, 12, 13, -1, -1, -1]
    # Query rows start right after the last valid row.
    assert out["query_positions"][:6].tolist() == [10, 11, 12, 2, 3, 4]


@pytest.mark.parametrize("impl", IMPLS)
def test_null_page_rows_get_position_zero_and_pad_slot(impl):
    table = [[5, 0, 0, 2], [0, 6, 1, 1]]  # request 0's position 9, 10 and request 1's 0..3
    out = run(impl, example_batch(block_table=table))
    assert out["context_slot_mapping"].tolist() == [-1, -1, -1, -1, -1, -1, -1, 24]
    assert out["context_positions"].tolist() == [0, 0, 0, 0, 0, 0, 0, 4]
    assert out["query_slot_mapping"][:6].tolist() == [-1, 8, 9, 25, 26, 27]


@pytest.mark.parametrize("impl", IMPLS)
def test_query_positions_clamped_to_max_model_len(impl):
    out = run(impl, example_batch(), max_model_len=13)
    assert out["query_positions"][:3].tolist() == [11, 12, 12]
    assert out["seq_lens"][:2].tolist() == [13, 8]
    assert out["sample_pos"][:2].tolist() == [12, 13]  # unclamped, as in the seed
    assert out["query_slot_mapping"][:3].tolist() == [31, 8, 9]  # slots from unclamped


@pytest.mark.parametrize("impl", IMPLS)
def test_bonus_token_from_next_prefill_tokens_while_num_sampled_is_zero(impl):
    out = run(impl, example_batch(num_sampled=[0, 3]))
    assert out["input_ids"][[0, 3]].tolist() == [202, 100]


@pytest.mark.parametrize("impl", IMPLS)
def test_context_parallel_slots(impl):
    # Page 2, C = 2, I = 1: virtual pages of 4 tokens, even offsets on rank 0.
    sizes = dataclasses.replace(EXAMPLE_SIZES, block_size=2, cp_size=2)
    batch = example_batch(target_positions=[5, 6, 7, 0, 1, 2, 3, 4], num_rejected=[0, 0],
                          block_table=[[5, 3, 7, 2], [3, 6, 1, 1]])
    rank0 = run(impl, batch, sizes, cp_rank=0)
    rank1 = run(impl, batch, sizes, cp_rank=1)
    # Request 0, positions 5, 6, 7 on virtual page 1 -> block 3: offsets 1, 2, 3.
    assert rank0["context_slot_mapping"][:3].tolist() == [-1, 3 * 2 + 1, -1]
    assert rank1["context_slot_mapping"][:3].tolist() == [3 * 2 + 0, -1, 3 * 2 + 1]
    # Every token lands on exactly one rank.
    both = np.stack([rank0["context_slot_mapping"], rank1["context_slot_mapping"]])
    assert ((both != -1).sum(0) == 1).all()
    # Interleave 2: offsets 0, 1 on rank 0, 2, 3 on rank 1.
    sizes = dataclasses.replace(sizes, cp_interleave=2)
    rank1 = run(impl, batch, sizes, cp_rank=1)
    assert rank1["context_slot_mapping"][:3].tolist() == [-1, 3 * 2 + 0, 3 * 2 + 1]


@pytest.mark.parametrize("impl", IMPLS)
def test_cp_rank_may_be_traced(impl):
    sizes = dataclasses.replace(EXAMPLE_SIZES, block_size=2, cp_size=2)
    batch = example_batch()
    step = jax.jit(lambda rank: prepare_dflash_inputs(
        **batch, **sizes.static_kwargs(), cp_rank=rank, impl=impl))
    for rank in (0, 1):
        assert_layout_equal_dict(as_dict(step(jnp.int32(rank))),
                                 oracle_layout(batch, sizes, rank))


@pytest.mark.parametrize("impl", IMPLS)
def test_page_index_clamped_to_table_width(impl):
    sizes = dataclasses.replace(EXAMPLE_SIZES, max_blocks=2)
    batch = example_batch(block_table=[[5, 9], [3, 6]])
    out = run(impl, batch, sizes)
    # Position 9 is on page 2, past the 2-wide table: the last column (block 9) is used.
    assert out["context_slot_mapping"][:2].tolist() == [9 * 4 + 1, 9 * 4 + 2]


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_to_static_sizes(impl):
    sizes = dataclasses.replace(EXAMPLE_SIZES, max_num_reqs=6, extra_query_rows=7)
    batch = example_batch(last_sampled=range(6), next_prefill_tokens=range(6),
                          temperature=np.linspace(0.1, 0.6, 6), seeds=range(1, 7))
    out = run(impl, batch, sizes)
    assert out["query_start_loc"].tolist() == [0, 3, 6, 6, 6, 6, 6]
    assert out["seq_lens"][2:].tolist() == [0] * 4
    assert out["sample_indices"][4:].tolist() == [0] * 8
    assert out["sample_idx_mapping"][4:].tolist() == [-1] * 8
    assert out["sample_pos"][4:].tolist() == [0] * 8
    assert out["query_slot_mapping"][6:].tolist() == [-1] * (sizes.max_num_tokens - 6)
    assert out["input_ids"][6:].tolist() == [0] * (sizes.max_num_tokens - 6)
    assert out["query_positions"][6:].tolist() == [0] * (sizes.max_num_tokens - 6)
    # Request states 1, 3, 4, 5 are not in the batch.
    assert out["seeds"].tolist() == [1, 0, 3, 0, 0, 0]
    assert out["temperature"][[1, 3, 4, 5]].tolist() == [0.0] * 4


@pytest.mark.parametrize("impl", IMPLS)
def test_context_rows_outside_the_batch(impl):
    # Target rows padded to 12; rows 8..11 belong to no request, so do rows 0..1 when the
    # batch starts at row 2.
    batch = example_batch(target_positions=[50, 51, 9, 10, 11, 0, 1, 2, 3, 4, 60, 61],
                          target_query_start_loc=[2, 5, 10])
    sizes = dataclasses.replace(EXAMPLE_SIZES, num_target_rows=12)
    out = run(impl, batch, sizes)
    assert out["context_positions"].tolist() == [0, 0, 9, 10, 0, 0, 1, 2, 3, 4, 0, 0]
    assert out["context_slot_mapping"].tolist() == [-1, -1, 29, 30, -1, 12, 13, 14, 15, 24,
                                                    -1, -1]


def test_impls_agree_on_a_long_prefill_chunk():
    sizes = Sizes(max_num_reqs=4, num_steps=3, block_size=16, max_blocks=40,
                  num_target_rows=600, max_model_len=640)
    batch = random_batch(np.random.default_rng(0), sizes, 2, prefill_share=1.0)
    batch["target_query_start_loc"][:] = [0, 580, 600]  # a 580-row and a 20-row chunk
    batch["target_positions"][:] = np.r_[np.arange(580), np.arange(20)]
    expected = oracle_layout(batch, sizes)
    for impl in IMPLS:
        assert_layout_equal(prepare_dflash_inputs(**batch, **sizes.static_kwargs(), impl=impl),
                            expected, impl)


def test_layout_is_a_pytree():
    layout = prepare_dflash_inputs(**example_batch(), **EXAMPLE_SIZES.static_kwargs(),
                                   impl="reference")
    leaves, treedef = jax.tree_util.tree_flatten(layout)
    assert len(leaves) == len(FIELDS)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert all(getattr(rebuilt, name) is getattr(layout, name) for name in FIELDS)
    assert all(leaf.dtype in (jnp.int32, jnp.float32) for leaf in leaves)


# --------------------------------------------------------------------------------------
# Errors for bad input.
# --------------------------------------------------------------------------------------

def test_unknown_impl_is_a_value_error():
    with pytest.raises(ValueError, match="impl='cuda'"):
        prepare_dflash_inputs(**example_batch(), **EXAMPLE_SIZES.static_kwargs(), impl="cuda")


def test_too_many_requests_is_a_value_error():
    with pytest.raises(ValueError, match="raise max_num_reqs"):
        prepare_dflash_inputs(**example_batch(), **{**EXAMPLE_SIZES.static_kwargs(),
                                                    "max_num_reqs": 1})


def test_too_few_query_rows_is_a_value_error():
    with pytest.raises(ValueError, match="raise max_num_tokens"):
        prepare_dflash_inputs(**example_batch(), **{**EXAMPLE_SIZES.static_kwargs(),
                                                    "max_num_tokens": 5})


def test_wrong_block_table_shape_is_a_value_error():
    with pytest.raises(ValueError, match="block_table"):
        prepare_dflash_inputs(**example_batch(block_table=[[1, 2, 3, 4]]),
                              **EXAMPLE_SIZES.static_kwargs())


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="jax-triton may be installed")
def test_triton_without_gpu_jax_says_how_to_install():
    with pytest.raises(ValueError, match=r"pip install dflash-jax\[triton\]"):
        prepare_dflash_inputs(**example_batch(), **EXAMPLE_SIZES.static_kwargs(),
                              impl="triton")


# --------------------------------------------------------------------------------------
# GPU: the Triton-lowered Pallas kernel and the jax-triton kernel against the reference.
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_reqs", [1, 256])
def test_pallas_kernel_lowers_to_triton_for_a_gpu_from_any_host(num_reqs):
    from conftest import triton_calls_for_cuda

    sizes = Sizes(256, 15, 16, 64, 256 * 16 + 64, 2048, extra_query_rows=64)
    batch = random_batch(np.random.default_rng(0), sizes, num_reqs)
    names = list(batch)

    def layout(*arrays):
        return prepare_dflash_inputs(**dict(zip(names, arrays)), **sizes.static_kwargs(), impl="pallas",
                                     interpret=False)

    assert triton_calls_for_cuda(layout, *(np.asarray(batch[name]) for name in names)) == 1


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["pallas", "triton"])
def test_gpu_kernels_match_reference(impl):
    if impl == "triton":
        pytest.importorskip("jax_triton")
    sizes = Sizes(256, 15, 16, 64, 256 * 16 + 64, 2048, extra_query_rows=64)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for _ in range(50):
            batch = random_batch(rng, sizes, int(rng.choice([1, 32, 256])))
            expected = as_dict(prepare_dflash_inputs(**batch, **sizes.static_kwargs(),
                                                     impl="reference"))
            layout = prepare_dflash_inputs(**batch, **sizes.static_kwargs(), impl=impl)
            assert_layout_equal(layout, expected, impl)
