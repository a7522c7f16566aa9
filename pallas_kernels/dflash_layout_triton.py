"""The DFlash layout kernel in native Triton, called through jax-triton.

The same program as ``dflash_layout._layout_kernel`` (read its docstrings for the
index arithmetic and the worked example): grid (num_reqs + 1, G); program (r, b) with
r < R lays out request r's context row blocks b, b + G, ..., and b = 0 also its query
and sample rows; program (R, b) writes the padding. It exists for when jax drops
Pallas' Triton backend. Imported lazily: it needs triton, and jax-triton needs a GPU jax.
"""

import triton
import triton.language as tl


def kernel_constants(cfg, pad_block, state_block, batch_block):
    """The kernel's constexpr arguments for a layout ``_Config``."""
    return dict(
        T=cfg.num_target_rows, R=cfg.num_reqs, W=cfg.max_blocks, PAGE=cfg.block_size,
        TOKEN_ID=cfg.token_id, N=cfg.num_steps, MAX_REQS=cfg.max_num_reqs,
        MAX_TOKENS=cfg.max_num_tokens, MAX_LEN=cfg.max_model_len, CP_SIZE=cfg.cp_size,
        CP_INTERLEAVE=cfg.cp_interleave, PAD_SLOT=cfg.pad_slot_id,
        G=cfg.programs_per_req, BLOCK=cfg.row_block, QB=cfg.query_block,
        PAD_BLOCK=pad_block, STATE_BLOCK=state_block, BATCH_BLOCK=batch_block)


@triton.jit
def _block_id(block_table_ptr, r, pos, mask, W: tl.constexpr, PAGE: tl.constexpr,
              CP_SIZE: tl.constexpr):
    page_index = tl.minimum(pos // (PAGE * CP_SIZE), W - 1)
    return tl.load(block_table_ptr + r * W + page_index, mask=mask, other=0)


@triton.jit
def _slot(pos, block, resident, cp_rank, PAGE: tl.constexpr, CP_SIZE: tl.constexpr,
          CP_INTERLEAVE: tl.constexpr, PAD_SLOT: tl.constexpr):
    offset = pos % (PAGE * CP_SIZE)
    owner = (offset // CP_INTERLEAVE) % CP_SIZE
    local = (offset // (CP_INTERLEAVE * CP_SIZE)) * CP_INTERLEAVE + offset % CP_INTERLEAVE
    on_rank = resident & (block != 0) & (owner == cp_rank)
    return tl.where(on_rank, block * PAGE + local, PAD_SLOT)


@triton.jit
def _fill(ptr, begin, end, value, b, G: tl.constexpr, BLOCK: tl.constexpr):
    """Writes value to [begin, end) in blocks b, b + G, ... (begin, end static)."""
    num_blocks = (end - begin + BLOCK - 1) // BLOCK
    for i in range(0, (num_blocks + G - 1) // G):
        lanes = begin + (b + i * G) * BLOCK + tl.arange(0, BLOCK)
        tl.store(ptr + lanes, tl.zeros((BLOCK,), tl.int32) + value, mask=lanes < end)


@triton.jit
def layout_kernel(
        positions_ptr, start_loc_ptr, idx_mapping_ptr, last_sampled_ptr, next_prefill_ptr,
        num_sampled_ptr, num_rejected_ptr, temperature_ptr, seeds_ptr, block_table_ptr,
        cp_rank_ptr,
        input_ids_ptr, query_pos_ptr, query_slot_ptr, query_start_ptr, seq_lens_ptr,
        ctx_pos_ptr, ctx_slot_ptr, sample_idx_ptr, sample_pos_ptr, sample_map_ptr,
        temperature_out_ptr, seeds_out_ptr,
        T: tl.constexpr, R: tl.constexpr, W: tl.constexpr, PAGE: tl.constexpr,
        TOKEN_ID: tl.constexpr, N: tl.constexpr, MAX_REQS: tl.constexpr,
        MAX_TOKENS: tl.constexpr, MAX_LEN: tl.constexpr, CP_SIZE: tl.constexpr,
        CP_INTERLEAVE: tl.constexpr, PAD_SLOT: tl.constexpr, G: tl.constexpr,
        BLOCK: tl.constexpr, QB: tl.constexpr, PAD_BLOCK: tl.constexpr,
        STATE_BLOCK: tl.constexpr, BATCH_BLOCK: tl.constexpr):
    B: tl.constexpr = N + 1
    r = tl.program_id(0)
    b = tl.program_id(1)
    cp_rank = tl.load(cp_rank_ptr)
    if r < R:
        ctx_start = tl.minimum(tl.maximum(tl.load(start_loc_ptr + r), 0), T)
        ctx_end = tl.minimum(tl.maximum(tl.load(start_loc_ptr + r + 1), 0), T)
        num_ctx = ctx_end - ctx_start
        num_valid = num_ctx - tl.load(num_rejected_ptr + r)
        last_row = tl.minimum(tl.maximum(ctx_start + num_valid - 1, 0), T - 1)
        last_valid_pos = tl.load(positions_ptr + last_row)

        num_blocks = (num_ctx + BLOCK - 1) // BLOCK
        trips = tl.maximum(num_blocks - b + G - 1, 0) // G
        for i in range(0, trips):
            j = (b + i * G) * BLOCK + tl.arange(0, BLOCK)
            is_ctx = j < num_ctx
            valid = j < num_valid
            pos = tl.load(positions_ptr + ctx_start + j, mask=valid, other=0)
            block = _block_id(block_table_ptr, r, pos, valid, W, PAGE, CP_SIZE)
            slot = _slot(pos, block, valid, cp_rank, PAGE, CP_SIZE, CP_INTERLEAVE, PAD_SLOT)
            tl.store(ctx_pos_ptr + ctx_start + j, tl.where(valid & (block != 0), pos, 0),
                     mask=is_ctx)
            tl.store(ctx_slot_ptr + ctx_start + j, slot, mask=is_ctx)

        if b == 0:
            batch_state = tl.load(idx_mapping_ptr + r)
            state = tl.minimum(tl.maximum(batch_state, 0), MAX_REQS - 1)
            k = tl.arange(0, QB)
            is_query = k < B
            q_pos = last_valid_pos + 1 + k
            block = _block_id(block_table_ptr, r, q_pos, is_query, W, PAGE, CP_SIZE)
            slot = _slot(q_pos, block, is_query, cp_rank, PAGE, CP_SIZE, CP_INTERLEAVE,
                         PAD_SLOT)
            bonus = tl.where(tl.load(num_sampled_ptr + r) > 0,
                             tl.load(last_sampled_ptr + state),
                             tl.load(next_prefill_ptr + state))
            ids = tl.where(k == 0, bonus, TOKEN_ID)
            tl.store(input_ids_ptr + r * B + k, ids, mask=is_query)
            tl.store(query_pos_ptr + r * B + k, tl.minimum(q_pos, MAX_LEN - 1), mask=is_query)
            tl.store(query_slot_ptr + r * B + k, slot, mask=is_query)
            is_sample = k < N
            tl.store(sample_idx_ptr + r * N + k, r * B + 1 + k, mask=is_sample)
            tl.store(sample_pos_ptr + r * N + k, q_pos + 1, mask=is_sample)
            tl.store(sample_map_ptr + r * N + k, tl.zeros((QB,), tl.int32) + batch_state,
                     mask=is_sample)
            tl.store(query_start_ptr + r, r * B)
            tl.store(seq_lens_ptr + r, tl.minimum(last_valid_pos + 1 + B, MAX_LEN))
    else:
        _fill(input_ids_ptr, R * B, MAX_TOKENS, 0, b, G, PAD_BLOCK)
        _fill(query_pos_ptr, R * B, MAX_TOKENS, 0, b, G, PAD_BLOCK)
        _fill(query_slot_ptr, R * B, MAX_TOKENS, PAD_SLOT, b, G, PAD_BLOCK)
        _fill(sample_idx_ptr, R * N, MAX_REQS * N, 0, b, G, PAD_BLOCK)
        _fill(sample_pos_ptr, R * N, MAX_REQS * N, 0, b, G, PAD_BLOCK)
        _fill(sample_map_ptr, R * N, MAX_REQS * N, -1, b, G, PAD_BLOCK)
        _fill(query_start_ptr, R, MAX_REQS + 1, R * B, b, G, PAD_BLOCK)
        _fill(seq_lens_ptr, R, MAX_REQS, 0, b, G, PAD_BLOCK)

        batch_begin = tl.minimum(tl.maximum(tl.load(start_loc_ptr), 0), T)
        batch_end = tl.minimum(tl.maximum(tl.load(start_loc_ptr + R), 0), T)
        ctx_blocks: tl.constexpr = (T + PAD_BLOCK - 1) // PAD_BLOCK
        for i in range(0, (ctx_blocks + G - 1) // G):
            rows = (b + i * G) * PAD_BLOCK + tl.arange(0, PAD_BLOCK)
            outside = (rows < T) & ((rows < batch_begin) | (rows >= batch_end))
            tl.store(ctx_pos_ptr + rows, tl.zeros((PAD_BLOCK,), tl.int32), mask=outside)
            tl.store(ctx_slot_ptr + rows, tl.zeros((PAD_BLOCK,), tl.int32) + PAD_SLOT,
                     mask=outside)

        state_blocks: tl.constexpr = (MAX_REQS + STATE_BLOCK - 1) // STATE_BLOCK
        for i in range(0, (state_blocks + G - 1) // G):
            states = (b + i * G) * STATE_BLOCK + tl.arange(0, STATE_BLOCK)
            is_state = states < MAX_REQS
            hits = tl.zeros((STATE_BLOCK,), tl.int32)
            for c in range(0, (R + BATCH_BLOCK - 1) // BATCH_BLOCK):
                rows = c * BATCH_BLOCK + tl.arange(0, BATCH_BLOCK)
                batch_states = tl.load(idx_mapping_ptr + rows, mask=rows < R, other=-1)
                equal = states[:, None] == batch_states[None, :]
                hits = tl.maximum(hits, tl.max(equal.to(tl.int32), axis=1))
            in_batch = hits > 0
            temperature = tl.load(temperature_ptr + states, mask=is_state, other=0.0)
            seed = tl.load(seeds_ptr + states, mask=is_state, other=0)
            tl.store(temperature_out_ptr + states, tl.where(in_batch, temperature, 0.0),
                     mask=is_state)
            tl.store(seeds_out_ptr + states, tl.where(in_batch, seed, 0), mask=is_state)
