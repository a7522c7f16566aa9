"""Direct tests of the speculative cycle's small helpers, with no model: what a row verifies and
commits (`cycle.drafts_to_verify`, `cycle.commit_counts`), per-slot reads and writes
(`cycle.slot_rows`, `cycle.with_slot_rows`), the verify batch (`steps.block_batch`), the host's
step inputs through `step_inputs.StepInputs.fill` / `unpack` and `cycle.fill_verify_rows`, and
the draft layouts `steps.draft_layouts` builds for each drafter cache group.

Every expected array is written out by hand (or by a plain numpy loop), with how it is derived."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_jax.cycle import DecodeState, commit_counts, drafts_to_verify, fill_verify_rows, slot_rows, with_slot_rows
from dflash_jax.kv_cache import PagedKVCache
from dflash_jax.requests import RequestStats, SamplingParams
from dflash_jax.scheduler import Request, Work
from dflash_jax.step_inputs import StepInputs, unpack
from dflash_jax.steps import TargetBatch, block_batch, draft_layouts

MASK = 95  # the stand-in drafter's mask token id


def i32(values):
    return jnp.asarray(values, jnp.int32)


def as_list(x):
    return np.asarray(x).tolist()


# --------------------------------------------------------------------------------------
# drafts_to_verify: min(max(remaining - 1, 0), N).
# --------------------------------------------------------------------------------------

def test_drafts_to_verify_leaves_room_for_the_targets_token():
    remaining = i32([0, 1, 2, 3, 4, 5, 100, -3])
    # N = 3: a row that may still commit r tokens verifies r - 1 drafts (it also commits the
    # target's token), never fewer than 0 and never more than the 3 it has.
    got = drafts_to_verify(remaining, 3)
    assert got.shape == (8,)
    assert as_list(got) == [0, 0, 1, 2, 3, 3, 3, 0]
    # N = 0 (plain decoding): nothing to verify, whatever remains.
    assert as_list(drafts_to_verify(remaining, 0)) == [0] * 8


# --------------------------------------------------------------------------------------
# commit_counts.
# --------------------------------------------------------------------------------------

_jit_commit_counts = jax.jit(commit_counts)  # as the cycle runs it: traced, in one program


def counts(tokens_RQ, accepted_R, remaining_R, stops_RX):
    count_R, stopped_R = _jit_commit_counts(i32(tokens_RQ), i32(accepted_R), i32(remaining_R), i32(stops_RX))
    assert count_R.shape == stopped_R.shape == (len(accepted_R),)
    assert jnp.issubdtype(count_R.dtype, jnp.integer) and stopped_R.dtype == jnp.bool_
    return as_list(count_R), as_list(stopped_R)


def test_commit_counts_docstring_example():
    # tokens [5, 9, 2, 7], 2 accepted: commits [5, 9] and the target's 2, which is a stop id.
    assert counts([[5, 9, 2, 7]], [2], [10], [[2]]) == ([3], [True])


def test_commit_counts_ignores_stop_ids_past_the_committed_tokens():
    # 1 accepted commits [5, 9]; the 2 at offset 2 is a rejected draft's slot: not committed.
    assert counts([[5, 9, 2, 7]], [1], [10], [[2]]) == ([2], [False])
    # The stop id is the target's token itself (offset 1 = accepted): committed, stopped.
    assert counts([[5, 9, 2, 7]], [1], [10], [[9]]) == ([2], [True])


def test_commit_counts_cuts_at_the_first_stop_id():
    # Everything accepted (3 of 3) commits 4 tokens, but 9 at offset 1 stops the row after 2.
    assert counts([[5, 9, 2, 9]], [3], [10], [[2, 9]]) == ([2], [True])
    # A stop id at offset 0 (the first accepted draft) commits only it.
    assert counts([[2, 9, 2, 9]], [3], [10], [[2, -1]]) == ([1], [True])


def test_commit_counts_nothing_accepted_commits_the_targets_token():
    assert counts([[5, 9, 2, 7]], [0], [10], [[9]]) == ([1], [False])  # 9 is past offset 0
    assert counts([[5, 9, 2, 7]], [0], [10], [[5]]) == ([1], [True])


def test_commit_counts_everything_accepted():
    assert counts([[5, 9, 2, 7]], [3], [4], [[-1]]) == ([4], [False])
    # The bonus (the target's token after all drafts) is a stop id.
    assert counts([[5, 9, 2, 7]], [3], [4], [[7]]) == ([4], [True])


def test_commit_counts_nothing_remaining_commits_nothing_even_at_a_stop_id():
    # A row with nothing left (mid-prefill, or done) commits 0 tokens and never stops, even if
    # its junk tokens hold a stop id.
    assert counts([[5, 9, 2, 7]], [0], [0], [[5]]) == ([0], [False])
    assert counts([[5, 9, 2, 7]], [2], [0], [[9]]) == ([0], [False])


def test_commit_counts_one_token_rows():
    # Q = 1 (a batch without drafts): each row commits its one token if it may.
    assert counts([[4], [4], [6]], [0, 0, 0], [1, 0, 3], [[4], [4], [4]]) == ([1, 0, 1], [True, False, False])


def test_commit_counts_several_rows_each_with_its_own_stop_ids():
    tokens = [[5, 9, 2, 7],
              [5, 9, 2, 7],
              [8, 8, 8, 8],
              [1, 2, 3, 4]]
    accepted = [3, 3, 1, 2]
    remaining = [4, 4, 2, 0]
    stops = [[2, -1],  # row 0: stops at its 2 (offset 2): 3 tokens
             [3, 4],   # row 1: neither id occurs (row 3's 3 and 4 are not row 1's concern): 4 tokens
             [8, 8],   # row 2: 8 at offset 0, a duplicated stop id: 1 token
             [1, -1]]  # row 3: nothing remaining: 0 tokens, not stopped
    assert counts(tokens, accepted, remaining, stops) == ([3, 4, 1, 0], [True, False, True, False])


def commit_counts_by_hand(tokens, accepted, remaining, stops):
    """The rule in plain Python: commit accepted + 1 tokens (0 if nothing remains), up to and
    including the first stop id."""
    if remaining <= 0:
        return 0, False
    for i in range(accepted + 1):
        if tokens[i] in stops:
            return i + 1, True
    return accepted + 1, False


R, N, X = 4, 4, 2


@settings(max_examples=100, deadline=None, database=None)
@given(st.data())
def test_commit_counts_property(data):
    """With a row verifying `drafts_to_verify(remaining)` drafts (as the cycle does), its commit
    matches the plain rule, never passes a stop id or `remaining`, and is at least 1 token
    whenever remaining > 0."""
    tokens = data.draw(st.lists(st.lists(st.integers(0, 5), min_size=N + 1, max_size=N + 1),
                                min_size=R, max_size=R))
    stops = data.draw(st.lists(st.lists(st.integers(-1, 5), min_size=X, max_size=X), min_size=R, max_size=R))
    remaining = data.draw(st.lists(st.integers(0, N + 3), min_size=R, max_size=R))
    # Drafts verified: min(max(remaining - 1, 0), N), worked out here, not by drafts_to_verify.
    accepted = [data.draw(st.integers(0, min(max(rem - 1, 0), N))) for rem in remaining]
    count_R, stopped_R = jax.device_get(_jit_commit_counts(i32(tokens), i32(accepted), i32(remaining), i32(stops)))
    for r in range(R):
        count, stopped = int(count_R[r]), bool(stopped_R[r])
        assert (count, stopped) == commit_counts_by_hand(tokens[r], accepted[r], remaining[r], stops[r])
        assert count <= remaining[r]
        assert count >= 1 if remaining[r] > 0 else count == 0
        assert not any(t in stops[r] for t in tokens[r][: max(count - 1, 0)])  # no stop id before the last
        assert stopped == (count > 0 and tokens[r][count - 1] in stops[r])


# --------------------------------------------------------------------------------------
# slot_rows / with_slot_rows: S = 4 slots, rows 0..2 in slots [2, 0, 4]; slot 4 = S is padding.
# --------------------------------------------------------------------------------------

def test_slot_rows_reads_each_rows_slot_and_padding_reads_the_last():
    array_S = i32([10, 11, 12, 13])
    # Row 0 -> slot 2 -> 12; row 1 -> slot 0 -> 10; row 2 is padding (slot 4): the last slot, 13.
    assert as_list(slot_rows(array_S, i32([2, 0, 4]))) == [12, 10, 13]
    # Per-slot rows of a 2-D array come along whole.
    array_SN = i32([[10, 20], [11, 21], [12, 22], [13, 23]])
    got = slot_rows(array_SN, i32([3, 3, 1]))
    assert got.shape == (3, 2) and as_list(got) == [[13, 23], [13, 23], [11, 21]]
    # No slots: row r is slot r, the array as it is.
    assert slot_rows(array_SN, None) is array_SN


def test_with_slot_rows_writes_each_row_to_its_slot_and_drops_padding():
    array_S = i32([10, 11, 12, 13])
    slots_R = i32([2, 0, 4])
    # Row 0's 7 -> slot 2, row 1's 8 -> slot 0; row 2 (slot 4, padding) writes nothing.
    assert as_list(with_slot_rows(array_S, slots_R, i32([7, 8, 9]))) == [8, 11, 7, 13]
    # where_R off for row 0: slot 2 keeps its 12.
    got = with_slot_rows(array_S, slots_R, i32([7, 8, 9]), jnp.array([False, True, True]))
    assert as_list(got) == [8, 11, 12, 13]
    # where_R on for the padding row still writes nothing.
    got = with_slot_rows(array_S, slots_R, i32([7, 8, 9]), jnp.array([True, False, True]))
    assert as_list(got) == [10, 11, 7, 13]
    assert as_list(array_S) == [10, 11, 12, 13]  # the input is left alone


def test_with_slot_rows_two_dimensional_values():
    array_SN = i32([[10, 20], [11, 21], [12, 22], [13, 23]])
    values_RN = i32([[1, 2], [3, 4], [5, 6]])
    got = with_slot_rows(array_SN, i32([3, 1, 4]), values_RN, jnp.array([True, False, True]))
    # Row 0 -> slot 3 written; row 1 masked off (slot 1 kept); row 2 padding dropped.
    assert got.shape == (4, 2)
    assert as_list(got) == [[10, 20], [11, 21], [12, 22], [1, 2]]


def test_with_slot_rows_when_rows_are_their_slots():
    array_SN = i32([[10, 20], [11, 21], [12, 22]])
    values_SN = i32([[1, 2], [3, 4], [5, 6]])
    # No slots and no mask: the values are the new array.
    assert as_list(with_slot_rows(array_SN, None, values_SN)) == [[1, 2], [3, 4], [5, 6]]
    # A mask picks per row, broadcast over the trailing axis.
    got = with_slot_rows(array_SN, None, values_SN, jnp.array([False, True, False]))
    assert got.shape == (3, 2) and as_list(got) == [[10, 20], [3, 4], [12, 22]]
    got = with_slot_rows(i32([10, 11, 12]), None, i32([1, 3, 5]), jnp.array([True, False, True]))
    assert as_list(got) == [1, 11, 5]


# --------------------------------------------------------------------------------------
# block_batch: 3 requests of Q = 4 tokens, page 4, starts crossing page boundaries.
# --------------------------------------------------------------------------------------

_jit_block_batch = jax.jit(block_batch, static_argnums=3)  # page_size is static


def test_block_batch_positions_slots_and_rows():
    page = 4
    tokens_RQ = i32([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    start_R = i32([6, 1, 11])
    page_table_RM = i32([[3, 8, 5, 0],
                         [2, 9, 0, 0],
                         [7, 4, 6, 11]])
    batch = _jit_block_batch(tokens_RQ, start_R, page_table_RM, page)
    assert as_list(batch.token_ids) == list(range(1, 13))
    # Row r at start_R[r] + 0..3.
    assert as_list(batch.positions) == [6, 7, 8, 9, 1, 2, 3, 4, 11, 12, 13, 14]
    # slot = page_table[r, pos // 4] * 4 + pos % 4:
    #   row 0: 6, 7 on page 1 (block 8) -> 34, 35; 8, 9 on page 2 (block 5) -> 20, 21
    #   row 1: 1, 2, 3 on page 0 (block 2) -> 9, 10, 11; 4 on page 1 (block 9) -> 36
    #   row 2: 11 on page 2 (block 6) -> 27; 12, 13, 14 on page 3 (block 11) -> 44, 45, 46
    assert as_list(batch.slots) == [34, 35, 20, 21, 9, 10, 11, 36, 27, 44, 45, 46]
    assert as_list(batch.rows) == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert as_list(batch.query_start_loc) == [0, 4, 8, 12]
    assert as_list(batch.logits_rows) == list(range(12))
    assert as_list(batch.page_table) == as_list(page_table_RM)
    for name in ("token_ids", "positions", "rows", "slots"):
        assert getattr(batch, name).shape == (12,), name
    for name in ("positions", "rows", "slots", "query_start_loc", "logits_rows"):
        assert getattr(batch, name).dtype == jnp.int32, name


def test_block_batch_one_decode_token_per_request():
    # Q = 1: the docstring's decode step; page 2, starts 3 and 0.
    batch = _jit_block_batch(i32([[40], [41]]), i32([3, 0]), i32([[5, 6], [7, 1]]), 2)
    assert as_list(batch.positions) == [3, 0]
    assert as_list(batch.slots) == [6 * 2 + 1, 7 * 2 + 0]
    assert as_list(batch.rows) == [0, 1]
    assert as_list(batch.query_start_loc) == [0, 1, 2]


# --------------------------------------------------------------------------------------
# StepInputs.fill -> unpack -> fill_verify_rows, with hand-made requests (no model).
# --------------------------------------------------------------------------------------

PAGE = 4


def make_request(request_id, tokens, prompt_len, *, num_computed, slot, pages, window_pages, **params):
    request = Request(request_id, prompt_len, list(tokens), SamplingParams(**params), RequestStats())
    request.num_computed, request.slot, request.pages, request.window_pages = num_computed, slot, pages, window_pages
    return request


def filled_step_inputs():
    """Two rows and a padding row; N = 2 (Q = 3), 12 token rows, 4 pages per request, 4 slots.

    Row 0, request A in slot 2, verifying: prompt [1..5], generated [50, 51]; positions 0..5
    are cached and the anchor 51 sits at position 6. Row 1, request B in slot 0: a prefill
    chunk of 5 of its 9 prompt tokens [20..28] from position 1, more prompt to come."""
    a = make_request(0, [1, 2, 3, 4, 5, 50, 51], 5, num_computed=6, slot=2, pages=[3, 8, 4],
                     window_pages=[[0, 9, 13]], max_new_tokens=10, temperature=0.5, top_k=5, top_p=0.9, seed=11,
                     stop_token_ids=(7, 2, 7))
    b = make_request(1, range(20, 29), 9, num_computed=1, slot=0, pages=[5, 6, 1], window_pages=[[10, 11, 12]])
    inputs = StepInputs(num_rows=3, num_tokens=12, num_query=3, pages_per_req=4, max_num_reqs=4,
                        num_window_groups=1, max_stop_ids=3)
    inputs.fill([Work(a, 3, True, True, 0), Work(b, 5, False, False, 0)], 3)
    return inputs


def test_step_inputs_fill():
    inputs = filled_step_inputs()
    # Row 0 takes token rows 0..2 (left blank: the device fills them), row 1 rows 3..7 (B's
    # tokens[1:6] at positions 1..5), rows 8..11 are padding.
    assert inputs.tokens.tolist() == [0, 0, 0, 21, 22, 23, 24, 25, 0, 0, 0, 0]
    assert inputs.positions.tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 0, 0, 0, 0]
    assert inputs.rows.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0]
    assert inputs.query_start_loc.tolist() == [0, 3, 8, 8]  # padding rows: the last end
    # A's verify rows are its 3 token rows; a prefill row's is its last token row, repeated.
    assert inputs.verify_rows.tolist() == [[0, 1, 2], [7, 7, 7], [0, 0, 0]]
    assert inputs.page_table.tolist() == [[3, 8, 4, 0], [5, 6, 1, 0], [0, 0, 0, 0]]  # NULL_PAGE padding
    assert inputs.window_table_0.tolist() == [[0, 9, 13, 0], [10, 11, 12, 0], [0, 0, 0, 0]]
    assert inputs.slot.tolist() == [2, 0, 4]  # padding row: slot max_num_reqs (writes dropped)
    assert inputs.anchor_pos.tolist() == [0, 5, 0]  # B's chunk ends at position 5
    # last position = prompt + max new tokens - 1: A 5 + 10 - 1; B 9 + 128 (the default) - 1.
    assert inputs.last_pos.tolist() == [14, 136, 0]
    assert inputs.verifying.tolist() == [1, 0, 0]
    assert inputs.samples.tolist() == [1, 0, 0]
    assert inputs.next_prefill.tolist() == [0, 26, 0]  # B's next prompt token, tokens[6]
    assert inputs.stop_ids.tolist() == [[2, 7, -1], [-1, -1, -1], [-1, -1, -1]]  # sorted, deduplicated
    assert inputs.top_k.tolist() == [5, 0, 0]
    assert inputs.seeds.tolist() == [11, 0, 0]
    assert inputs.temperature.tolist() == [0.5, 0.0, 0.0]
    assert inputs.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert inputs.cycles.tolist() == [1]  # a step with a prefill chunk runs one cycle
    # The named fields are views of the one buffer that travels to the device (floats too).
    assert inputs.buffer.ndim == 1 and inputs.buffer.dtype == np.int32 and inputs.top_p.dtype == np.float32
    for name in ("tokens", "page_table", "stop_ids", "seeds", "window_table_0", "temperature", "top_p"):
        assert np.shares_memory(getattr(inputs, name), inputs.buffer), name


def test_unpack_round_trip_under_jit():
    inputs = filled_step_inputs()
    inputs.cycles[0] = 3  # as if every row verified
    batch, cycles = jax.jit(unpack, static_argnums=1)(jnp.asarray(inputs.buffer), inputs.layout)
    assert as_list(batch.last_pos_R) == [14, 136, 0] and int(cycles) == 3
    target = batch.target
    assert as_list(target.token_ids) == inputs.tokens.tolist()
    assert as_list(target.positions) == inputs.positions.tolist()
    assert as_list(target.rows) == inputs.rows.tolist()
    assert target.slots is None  # computed on the device by fill_verify_rows
    assert as_list(target.query_start_loc) == [0, 3, 8, 8]
    assert as_list(target.page_table) == [[3, 8, 4, 0], [5, 6, 1, 0], [0, 0, 0, 0]]
    assert as_list(target.logits_rows) == [0, 1, 2, 7, 7, 7, 0, 0, 0]
    assert len(batch.draft_page_tables) == 2  # the target's table, then the window group's
    assert as_list(batch.draft_page_tables[0]) == as_list(target.page_table)
    assert as_list(batch.draft_page_tables[1]) == [[0, 9, 13, 0], [10, 11, 12, 0], [0, 0, 0, 0]]
    assert as_list(batch.slots_R) == [2, 0, 4]
    assert as_list(batch.verify_rows_RQ) == [[0, 1, 2], [7, 7, 7], [0, 0, 0]]
    assert as_list(batch.anchor_pos_R) == [0, 5, 0]
    assert batch.verifying_R.dtype == jnp.bool_ and as_list(batch.verifying_R) == [True, False, False]
    assert as_list(batch.remaining_R) == [1, 0, 0]  # the samples flags, for the step to turn into counts
    assert as_list(batch.next_prefill_tokens_R) == [0, 26, 0]
    assert as_list(batch.stop_ids_RE) == [[2, 7, -1], [-1, -1, -1], [-1, -1, -1]]
    s = batch.sampling
    assert as_list(s.temperature_R) == [0.5, 0.0, 0.0] and as_list(s.top_k_R) == [5, 0, 0]
    assert as_list(s.top_p_R) == pytest.approx([0.9, 1.0, 1.0]) and as_list(s.seeds_R) == [11, 0, 0]
    assert s.temperature_R.dtype == jnp.float32 and s.seeds_R.dtype == jnp.int32


def test_fill_verify_rows_takes_verify_rows_from_the_state():
    inputs = filled_step_inputs()
    batch, _ = unpack(jnp.asarray(inputs.buffer), inputs.layout)
    state = DecodeState(
        target_cache=PagedKVCache((), (), PAGE),  # only its page size is read
        draft_caches=(),
        drafts_SN=i32([[110, 111], [120, 121], [130, 131], [140, 141]]),
        draft_probs_SNV=jnp.zeros((4, 2, 0), jnp.float32),
        anchor_S=i32([100, 101, 102, 103]),
        anchor_pos_S=i32([30, 31, 6, 33]),
    )
    filled = jax.jit(fill_verify_rows)(batch, state)  # traced, as in the Engine's step
    target = filled.target
    # Row 0 (slot 2): anchor 102 then drafts 130, 131 at positions 6, 7, 8. Row 1 (prefill)
    # keeps its tokens and positions; padding token rows stay 0.
    assert as_list(target.token_ids) == [102, 130, 131, 21, 22, 23, 24, 25, 0, 0, 0, 0]
    assert as_list(target.positions) == [6, 7, 8, 1, 2, 3, 4, 5, 0, 0, 0, 0]
    # Slots through each row's page table (page 4): A's 6, 7 on page 1 (block 8) -> 34, 35,
    # 8 on page 2 (block 4) -> 16; B's 1..3 on page 0 (block 5) -> 21..23, 4, 5 on page 1
    # (block 6) -> 24, 25; padding token rows -> the pad slot -1.
    assert as_list(target.slots) == [34, 35, 16, 21, 22, 23, 24, 25, -1, -1, -1, -1]
    # A verifying row's anchor position comes from its slot; the others keep the batch's.
    assert as_list(filled.anchor_pos_R) == [6, 5, 0]
    # Nothing else changes.
    assert as_list(target.rows) == as_list(batch.target.rows)
    assert as_list(target.logits_rows) == as_list(batch.target.logits_rows)


# --------------------------------------------------------------------------------------
# draft_layouts: the layout kernel's rows for each drafter cache group.
# --------------------------------------------------------------------------------------

def mixed_target_batch():
    """3 batch rows over 12 target rows, N = 2 verified drafts (Q = 3), page 4:

    row 0: verify rows at positions 6, 7, 8 (target rows 0..2), 1 draft accepted -> 1 rejected
    row 1: a prefill chunk at positions 0..4 (target rows 3..7), mid-prefill: nothing sampled
    row 2: verify rows at positions 13, 14, 15 (target rows 8..10), both drafts accepted
    target row 11: padding (past query_start_loc[-1])."""
    positions = i32([6, 7, 8, 0, 1, 2, 3, 4, 13, 14, 15, 50])
    # Of the batch, draft_layouts reads positions, query_start_loc and the page table's row count.
    return TargetBatch(token_ids=jnp.zeros(12, jnp.int32), positions=positions,
                       rows=i32([0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 0]), slots=jnp.zeros(12, jnp.int32),
                       query_start_loc=i32([0, 3, 8, 11]), page_table=GROUP_TABLES[0],
                       logits_rows=i32([0, 1, 2, 7, 7, 7, 8, 9, 10]))


GROUP_TABLES = (
    # group 0 (the target's pages)
    i32([[3, 8, 5, 0, 0, 0],
         [2, 9, 10, 0, 0, 0],
         [7, 4, 6, 11, 12, 0]]),
    # group 1 (a windowed group): row 0's pages 0, 1 and row 2's pages 0..2 were evicted
    i32([[0, 0, 14, 0, 0, 0],
         [15, 16, 19, 0, 0, 0],
         [0, 0, 0, 17, 18, 0]]),
)


def test_draft_layouts_rows_for_each_cache_group():
    # The jnp reference layout (the CPU default): the Pallas kernel's agreement with it is
    # test_dflash_layout's fuzzing; what is checked here is draft_layouts' wiring.
    drafter = types.SimpleNamespace(cfg=types.SimpleNamespace(mask_token_id=MASK))
    caches = (PagedKVCache((), (), PAGE),) * 2  # only the page sizes are read
    # The drafter fills a block of D = 4 rows (bonus + 3 masks), one more than the 1 + N
    # verified; max_model_len 17, so row 2's block (16..19) runs past position 16 unclamped.
    layouts = draft_layouts(drafter, caches, GROUP_TABLES, mixed_target_batch(),
                            num_rejected_R=i32([1, 0, 0]), num_sampled_R=i32([1, 0, 1]),
                            last_sampled_R=i32([70, 999, 90]), next_prefill_tokens_R=i32([998, 80, 997]),
                            draft_block_size=4, max_model_len=17, layout_impl="reference")
    assert len(layouts) == 2
    for group, layout in enumerate(layouts):
        # Context rows: a valid row keeps its position; a rejected row (row 0's position 8),
        # a padding row (target row 11) and, per group, a row on the null page get 0.
        # Last valid positions: row 0: 7, row 1: 4, row 2: 15.
        if group == 0:
            assert as_list(layout.context_positions) == [6, 7, 0, 0, 1, 2, 3, 4, 13, 14, 15, 0]
            # 6, 7 on page 1 (block 8) -> 34, 35; 0..3 on page 0 (block 2) -> 8..11; 4 on
            # page 1 (block 9) -> 36; 13..15 on page 3 (block 11) -> 45..47.
            assert as_list(layout.context_slot_mapping) == [34, 35, -1, 8, 9, 10, 11, 36, 45, 46, 47, -1]
            # Query rows at last valid + 1 + k: row 0 8..11 on page 2 (block 5) -> 20..23;
            # row 1 5..7 on page 1 (block 9) -> 37..39, 8 on page 2 (block 10) -> 40;
            # row 2 16..19 on page 4 (block 12) -> 48..51.
            assert as_list(layout.query_slot_mapping) == [20, 21, 22, 23, 37, 38, 39, 40, 48, 49, 50, 51]
        else:
            # Row 0's 6, 7 sit on evicted page 1: position 0, pad slot. Row 1: block 15 -> 60..63,
            # block 16 -> 64. Row 2: page 3 (block 17) -> 69..71.
            assert as_list(layout.context_positions) == [0, 0, 0, 0, 1, 2, 3, 4, 13, 14, 15, 0]
            assert as_list(layout.context_slot_mapping) == [-1, -1, -1, 60, 61, 62, 63, 64, 69, 70, 71, -1]
            # Row 0: page 2 (block 14) -> 56..59; row 1: block 16 -> 65..67, block 19 -> 76;
            # row 2: page 4 (block 18) -> 72..75.
            assert as_list(layout.query_slot_mapping) == [56, 57, 58, 59, 65, 66, 67, 76, 72, 73, 74, 75]
        # The same in every group:
        assert as_list(layout.query_positions) == [8, 9, 10, 11, 5, 6, 7, 8, 16, 17, 18, 19]
        # Bonus: the last sampled token of a row that sampled (70, 90), the next prompt token
        # of the row mid-prefill (80); then D - 1 = 3 mask tokens.
        assert as_list(layout.input_ids) == [70, MASK, MASK, MASK, 80, MASK, MASK, MASK, 90, MASK, MASK, MASK]
        # Sample rows: query rows r * 4 + 1..3, at their positions, for request state r.
        assert as_list(layout.sample_indices) == [1, 2, 3, 5, 6, 7, 9, 10, 11]
        assert as_list(layout.sample_pos) == [9, 10, 11, 6, 7, 8, 17, 18, 19]
        assert as_list(layout.sample_idx_mapping) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert as_list(layout.query_start_loc) == [0, 4, 8, 12]
        # seq_lens = last valid + 1 + 4: 12, 9, 20 (under max_model_len + D = 21: no clamp).
        assert as_list(layout.seq_lens) == [12, 9, 20]


def test_each_step_inputs_start_blank():
    """Steps of the same sizes share one blank buffer, copied: what one step filled is not the next one's."""
    first = filled_step_inputs()
    second = StepInputs(num_rows=3, num_tokens=12, num_query=3, pages_per_req=4, max_num_reqs=4,
                        num_window_groups=1, max_stop_ids=3)
    assert not np.shares_memory(first.buffer, second.buffer)
    assert second.tokens.tolist() == [0] * 12 and second.slot.tolist() == [4, 4, 4]  # padding: slot S
    assert second.top_p.tolist() == [1.0] * 3 and second.stop_ids.tolist() == [[-1] * 3] * 3
