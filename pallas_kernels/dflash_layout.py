"""The DFlash layout step: query, context and sampling rows for a ragged paged batch.

After the target has run a flat ragged batch (request r owns target rows
``target_query_start_loc[r] .. target_query_start_loc[r + 1]``, a prefill chunk or the
1 + N verify rows, of which the last ``num_rejected[r]`` are rejected drafts), the
drafter needs, in one launch and with no host sync:

* context rows (one per target row): the position and KV slot at which the drafter
  stores that row's context K/V; rejected rows, rows on the null page and rows outside
  the batch get position 0 and the pad slot, so they write nothing;
* query rows (exactly B = 1 + N per request, at ``r * B + k``): the block's token ids
  (the bonus token, then N mask tokens), positions and KV slots;
* sample rows (N per request, at ``r * N + k - 1`` for k >= 1): which query row to
  sample, at which position, for which request state;
* per-request ``query_start_loc`` / ``seq_lens`` and the sampling state, padded out to
  the static sizes so padded rows are inert.

Worked example (page 4, no context parallelism, N = 2 so B = 3, pad slot -1)::

    target_query_start_loc = [0, 3, 8]       # request 0: 3 verify rows; 1: a 5-row prefill chunk
    target_positions       = [9, 10, 11,  0, 1, 2, 3, 4]
    num_rejected           = [1, 0]          # request 0's row at position 11 was rejected
    block_table            = [[5, 0, 7, 2],  # request 0: position 9 -> page 9 // 4 = 2 -> block 7
                              [3, 6, 1, 1]]  # request 1: positions 0..3 -> block 3, 4 -> block 6

    context_positions      = [9, 10, 0,  0, 1, 2, 3, 4]
    context_slot_mapping   = [29, 30, -1,  12, 13, 14, 15, 24]   # 7*4 + 9%4 = 29; rejected -> -1
    # request 0's last valid position is 10, so its query rows sit at 11, 12, 13:
    query_positions[0:3]   = [11, 12, 13]    # slots 7*4 + 3 = 31, then page 3 -> block 2: 8, 9
    query_positions[3:6]   = [5, 6, 7]       # request 1 continues its prompt after position 4
    input_ids[0:3]         = [bonus_0, MASK, MASK]
    sample_indices[0:4]    = [1, 2, 4, 5]    # query rows k >= 1; sample_pos = [12, 13, 6, 7]
    query_start_loc        = [0, 3, 6, 6, ...]; seq_lens = [14, 8, 0, ...]

With context parallelism over C ranks and interleave I, a virtual page holds page * C
tokens: for ``o = pos % (page * C)`` the token lives on rank ``(o // I) % C`` at local
offset ``(o // (I * C)) * I + o % I`` of block ``block_table[r, pos // (page * C)]``.
With page 2, C = 2, I = 1, position 7 has o = 3: rank 1, local offset 1, so on rank 1
its slot is ``block * 2 + 1`` and on rank 0 the pad slot.

Three implementations sit behind ``prepare_dflash_inputs``: a Pallas kernel (Triton
lowering on the GPU, interpret mode on CPU), the same kernel written in Triton and
called through jax-triton, and a vectorised jnp reference. They agree element for
element; every element of every output is written, so the outputs can be replayed
from static-shape buffers without stale values.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, runs_interpreted

IMPLS = ("auto", "pallas", "triton", "reference")

# Rows written per step by the padding program.
_PAD_BLOCK = 512
# Request states checked per step, and batch rows compared against them at once, when
# the padding program zeroes the sampling state of request states not in the batch.
_STATE_BLOCK = 32
_BATCH_BLOCK = 128
# Programs the grid aims for along its second axis, summed over requests.
_TARGET_PROGRAMS = 1024
# At least this many, so the padding program's work is split even for one request.
_MIN_PROGRAMS_PER_REQ = 4


@functools.partial(jax.tree_util.register_dataclass, data_fields=[
    "input_ids", "query_positions", "query_slot_mapping", "query_start_loc",
    "seq_lens", "context_positions", "context_slot_mapping", "sample_indices",
    "sample_pos", "sample_idx_mapping", "temperature", "seeds"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DFlashLayout:
    """The draft step's inputs. B = 1 + N query rows per request, T target rows."""

    input_ids: jax.Array             # [max_num_tokens] bonus token, then N mask tokens
    query_positions: jax.Array       # [max_num_tokens] clamped to max_model_len - 1
    query_slot_mapping: jax.Array    # [max_num_tokens] pad slot past num_reqs * B
    query_start_loc: jax.Array       # [max_num_reqs + 1] r * B, then num_reqs * B
    seq_lens: jax.Array              # [max_num_reqs] context + query length, then 0
    context_positions: jax.Array     # [T] 0 for rejected / null-page / outside rows
    context_slot_mapping: jax.Array  # [T] pad slot for those rows
    sample_indices: jax.Array        # [max_num_reqs * N] query row to sample (0 past the batch)
    sample_pos: jax.Array            # [max_num_reqs * N] that row's position (unclamped)
    sample_idx_mapping: jax.Array    # [max_num_reqs * N] request state, -1 past the batch
    temperature: jax.Array           # [max_num_reqs] float32, 0 for states not in the batch
    seeds: jax.Array                 # [max_num_reqs] 0 for states not in the batch


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static sizes and constants of one layout call (hashable, closed over by kernels)."""

    num_target_rows: int   # T
    num_reqs: int          # R
    max_blocks: int        # W, the block table's width
    block_size: int
    token_id: int          # parallel_drafting_token_id (MASK)
    num_steps: int         # N
    max_num_reqs: int
    max_num_tokens: int
    max_model_len: int
    cp_size: int
    cp_interleave: int
    pad_slot_id: int

    @property
    def query_len(self):   # B
        return self.num_steps + 1

    @property
    def query_block(self):
        return next_pow2(self.query_len)

    @property
    def row_block(self):
        """Context rows per step of a request program: about one request's share of T."""
        share = -(-self.num_target_rows // self.num_reqs)
        return min(256, max(16, next_pow2(share)))

    @property
    def programs_per_req(self):
        """Programs per request; each loops over every programs_per_req-th row block."""
        row_blocks = max(1, -(-self.num_target_rows // self.row_block))
        spread = min(row_blocks, _TARGET_PROGRAMS // (self.num_reqs + 1))
        return max(_MIN_PROGRAMS_PER_REQ, spread)


def cp_local_slot(pos, block_id, cp_rank, cfg):
    """KV slot of ``pos`` on this rank, or the pad slot if another rank owns it.

    Page 4, C = 2, I = 2: a virtual page holds 8 tokens; position 13 has o = 5, so it
    lives on rank (5 // 2) % 2 = 0 at local offset (5 // 4) * 2 + 5 % 2 = 3.
    """
    virtual_page = cfg.block_size * cfg.cp_size
    offset = pos % virtual_page
    owner = (offset // cfg.cp_interleave) % cfg.cp_size
    local = (offset // (cfg.cp_interleave * cfg.cp_size)) * cfg.cp_interleave \
        + offset % cfg.cp_interleave
    return jnp.where(owner == cp_rank, block_id * cfg.block_size + local, cfg.pad_slot_id)


def _page_index(pos, cfg):
    """Index into the block table of the (virtual) page holding ``pos``, clamped to W - 1."""
    return jnp.minimum(pos // (cfg.block_size * cfg.cp_size), cfg.max_blocks - 1)


# --------------------------------------------------------------------------------------
# Reference: vectorised jnp.
# --------------------------------------------------------------------------------------

def _reference_layout(cfg, positions, start_loc, idx_mapping, last_sampled,
                      next_prefill_tokens, num_sampled, num_rejected, temperature, seeds,
                      block_table, cp_rank):
    """Every row at once: find each target row's request with a search over the ends."""
    T, R, B, N = cfg.num_target_rows, cfg.num_reqs, cfg.query_len, cfg.num_steps
    pad = cfg.pad_slot_id
    start_loc = jnp.clip(start_loc, 0, T)
    end_R = start_loc[1:]
    valid_end_R = end_R - num_rejected
    last_valid_pos_R = positions[jnp.clip(valid_end_R - 1, 0, T - 1)]
    state_R = jnp.clip(idx_mapping, 0, cfg.max_num_reqs - 1)

    # Context rows: row t belongs to request (number of requests ending at or before t),
    # counted with a scatter and a cumsum (jnp.searchsorted is a slow loop on the GPU).
    row_T = jnp.arange(T, dtype=jnp.int32)
    ends_at_T = jnp.zeros(T, jnp.int32).at[end_R].add(1, mode="drop")
    req_T = jnp.minimum(jnp.cumsum(ends_at_T), R - 1)
    valid_T = (row_T >= start_loc[0]) & (row_T < end_R[-1]) & (row_T < valid_end_R[req_T])
    pos_T = jnp.where(valid_T, positions, 0)
    block_T = jnp.where(valid_T, block_table[req_T, _page_index(pos_T, cfg)], 0)
    resident_T = valid_T & (block_T != 0)
    ctx_pos_T = jnp.where(resident_T, pos_T, 0)
    ctx_slot_T = jnp.where(resident_T, cp_local_slot(pos_T, block_T, cp_rank, cfg), pad)

    # Query rows: B per request, positions after the last valid context row.
    k_B = jnp.arange(B, dtype=jnp.int32)
    q_pos_RB = last_valid_pos_R[:, None] + 1 + k_B
    q_block_RB = block_table[jnp.arange(R)[:, None], _page_index(q_pos_RB, cfg)]
    q_slot_RB = jnp.where(q_block_RB != 0, cp_local_slot(q_pos_RB, q_block_RB, cp_rank, cfg),
                          pad)
    bonus_R = jnp.where(num_sampled > 0, last_sampled[state_R], next_prefill_tokens[state_R])
    ids_RB = jnp.where(k_B == 0, bonus_R[:, None], cfg.token_id)

    query_pad = cfg.max_num_tokens - R * B
    input_ids = jnp.pad(ids_RB.reshape(-1), (0, query_pad))
    query_positions = jnp.pad(jnp.minimum(q_pos_RB, cfg.max_model_len - 1).reshape(-1),
                              (0, query_pad))
    query_slot_mapping = jnp.pad(q_slot_RB.reshape(-1), (0, query_pad), constant_values=pad)

    sample_pad = (cfg.max_num_reqs - R) * N
    sample_rows_RN = jnp.arange(R, dtype=jnp.int32)[:, None] * B + k_B[1:]
    sample_indices = jnp.pad(sample_rows_RN.reshape(-1), (0, sample_pad))
    sample_pos = jnp.pad(q_pos_RB[:, 1:].reshape(-1), (0, sample_pad))
    sample_idx_mapping = jnp.pad(jnp.repeat(idx_mapping, N), (0, sample_pad),
                                 constant_values=-1)

    req_slots = jnp.arange(cfg.max_num_reqs + 1, dtype=jnp.int32)
    query_start_loc = jnp.minimum(req_slots, R) * B
    seq_lens = jnp.pad(jnp.minimum(last_valid_pos_R + 1 + B, cfg.max_model_len),
                       (0, cfg.max_num_reqs - R))
    in_batch = jnp.zeros(cfg.max_num_reqs, bool).at[idx_mapping].set(True, mode="drop")
    return DFlashLayout(
        input_ids=input_ids, query_positions=query_positions,
        query_slot_mapping=query_slot_mapping, query_start_loc=query_start_loc,
        seq_lens=seq_lens, context_positions=ctx_pos_T, context_slot_mapping=ctx_slot_T,
        sample_indices=sample_indices, sample_pos=sample_pos,
        sample_idx_mapping=sample_idx_mapping,
        temperature=jnp.where(in_batch, temperature, 0.0),
        seeds=jnp.where(in_batch, seeds, 0))


# --------------------------------------------------------------------------------------
# Pallas kernel: grid (num_reqs + 1, programs_per_req).
# --------------------------------------------------------------------------------------

def _layout_kernel(cfg, positions_ref, start_loc_ref, idx_mapping_ref, last_sampled_ref,
                   next_prefill_ref, num_sampled_ref, num_rejected_ref, temperature_ref,
                   seeds_ref, block_table_ref, cp_rank_ref,
                   input_ids_ref, query_pos_ref, query_slot_ref, query_start_ref,
                   seq_lens_ref, ctx_pos_ref, ctx_slot_ref, sample_idx_ref, sample_pos_ref,
                   sample_map_ref, temperature_out_ref, seeds_out_ref):
    """Program (r, b) for r < R lays out request r; program (R, b) writes the padding.

    Each output element has exactly one writer, so programs need no ordering. Request
    program b handles context row blocks b, b + G, ... of its request (G programs per
    request); b = 0 also writes the request's B query rows, N sample rows and scalars.
    Contiguous rows are read and written through ``pl.ds`` windows with masks; masked
    lanes past an array's end are never touched on the GPU, and interpret mode pads.
    """
    T, R, B, N = cfg.num_target_rows, cfg.num_reqs, cfg.query_len, cfg.num_steps
    G, BLOCK, QB = cfg.programs_per_req, cfg.row_block, cfg.query_block
    pad = cfg.pad_slot_id
    r = pl.program_id(0)
    b = pl.program_id(1)
    cp_rank = cp_rank_ref[0]

    def block_id(row_in_table, pos, mask):
        index = row_in_table * cfg.max_blocks + _page_index(pos, cfg)
        return plgpu.load(block_table_ref.at[index], mask=mask, other=0)

    @pl.when(r < R)
    def _request():
        ctx_start = jnp.clip(start_loc_ref[r], 0, T)
        ctx_end = jnp.clip(start_loc_ref[r + 1], 0, T)
        num_ctx = ctx_end - ctx_start
        num_valid = num_ctx - num_rejected_ref[r]
        last_valid_pos = positions_ref[jnp.clip(ctx_start + num_valid - 1, 0, T - 1)]

        def context_block(i, carry):
            first = (b + i * G) * BLOCK
            j = first + lax.iota(jnp.int32, BLOCK)
            is_ctx = j < num_ctx
            valid = j < num_valid
            rows = pl.ds(ctx_start + first, BLOCK)
            pos = plgpu.load(positions_ref.at[rows], mask=valid, other=0)
            block = block_id(r, pos, valid)
            resident = valid & (block != 0)
            slot = jnp.where(resident, cp_local_slot(pos, block, cp_rank, cfg), pad)
            plgpu.store(ctx_pos_ref.at[rows], jnp.where(resident, pos, 0), mask=is_ctx)
            plgpu.store(ctx_slot_ref.at[rows], slot, mask=is_ctx)
            return carry

        num_blocks = (num_ctx + BLOCK - 1) // BLOCK
        trips = jnp.maximum(num_blocks - b + G - 1, 0) // G
        lax.fori_loop(0, trips, context_block, 0)

        @pl.when(b == 0)
        def _query_rows():
            state = jnp.clip(idx_mapping_ref[r], 0, cfg.max_num_reqs - 1)
            k = lax.iota(jnp.int32, QB)
            is_query = k < B
            q_pos = last_valid_pos + 1 + k
            block = block_id(r, q_pos, is_query)
            slot = jnp.where(block != 0, cp_local_slot(q_pos, block, cp_rank, cfg), pad)
            bonus = jnp.where(num_sampled_ref[r] > 0, last_sampled_ref[state],
                              next_prefill_ref[state])
            ids = jnp.where(k == 0, bonus, cfg.token_id)
            rows = pl.ds(r * B, QB)
            plgpu.store(input_ids_ref.at[rows], ids, mask=is_query)
            plgpu.store(query_pos_ref.at[rows], jnp.minimum(q_pos, cfg.max_model_len - 1),
                        mask=is_query)
            plgpu.store(query_slot_ref.at[rows], slot, mask=is_query)
            # Sample row r * N + k samples query row r * B + k + 1.
            is_sample = k < N
            samples = pl.ds(r * N, QB)
            plgpu.store(sample_idx_ref.at[samples], r * B + 1 + k, mask=is_sample)
            plgpu.store(sample_pos_ref.at[samples], q_pos + 1, mask=is_sample)
            plgpu.store(sample_map_ref.at[samples], jnp.full((QB,), idx_mapping_ref[r]),
                        mask=is_sample)
            query_start_ref[r] = r * B
            seq_lens_ref[r] = jnp.minimum(last_valid_pos + 1 + B, cfg.max_model_len)

    @pl.when(r == R)
    def _padding():
        def fill(begin, end, block, write):
            """Calls write(first, lanes, mask) on blocks b, b + G, ... of [begin, end)."""
            num_blocks = -(-(end - begin) // block)
            if num_blocks <= 0:
                return

            def body(i, carry):
                first = begin + (b + i * G) * block
                lanes = first + lax.iota(jnp.int32, block)
                write(first, lanes, lanes < end)
                return carry

            lax.fori_loop(0, -(-num_blocks // G), body, 0)

        def queries(first, lanes, mask):
            rows = pl.ds(first, _PAD_BLOCK)
            zeros = jnp.zeros((_PAD_BLOCK,), jnp.int32)
            plgpu.store(input_ids_ref.at[rows], zeros, mask=mask)
            plgpu.store(query_pos_ref.at[rows], zeros, mask=mask)
            plgpu.store(query_slot_ref.at[rows], zeros + pad, mask=mask)

        def samples(first, lanes, mask):
            rows = pl.ds(first, _PAD_BLOCK)
            zeros = jnp.zeros((_PAD_BLOCK,), jnp.int32)
            plgpu.store(sample_idx_ref.at[rows], zeros, mask=mask)
            plgpu.store(sample_pos_ref.at[rows], zeros, mask=mask)
            plgpu.store(sample_map_ref.at[rows], zeros - 1, mask=mask)

        def query_starts(first, lanes, mask):
            plgpu.store(query_start_ref.at[pl.ds(first, _PAD_BLOCK)],
                        jnp.full((_PAD_BLOCK,), R * B, jnp.int32), mask=mask)

        def seq_lens(first, lanes, mask):
            plgpu.store(seq_lens_ref.at[pl.ds(first, _PAD_BLOCK)],
                        jnp.zeros((_PAD_BLOCK,), jnp.int32), mask=mask)

        batch_begin = jnp.clip(start_loc_ref[0], 0, T)
        batch_end = jnp.clip(start_loc_ref[R], 0, T)

        def context_outside(first, lanes, mask):
            outside = mask & ((lanes < batch_begin) | (lanes >= batch_end))
            rows = pl.ds(first, _PAD_BLOCK)
            zeros = jnp.zeros((_PAD_BLOCK,), jnp.int32)
            plgpu.store(ctx_pos_ref.at[rows], zeros, mask=outside)
            plgpu.store(ctx_slot_ref.at[rows], zeros + pad, mask=outside)

        def sampling_state(first, states, mask):
            """Copies temperature and seed of the states in the batch, zeroes the rest."""
            batch_blocks = -(-R // _BATCH_BLOCK)

            def compare(i, hits):
                rows = i * _BATCH_BLOCK + lax.iota(jnp.int32, _BATCH_BLOCK)
                batch_states = plgpu.load(idx_mapping_ref.at[jnp.minimum(rows, R - 1)])
                batch_states = jnp.where(rows < R, batch_states, -1)
                equal = states[:, None] == batch_states[None, :]
                return jnp.maximum(hits, jnp.max(equal.astype(jnp.int32), axis=1))

            hits = lax.fori_loop(0, batch_blocks, compare,
                                 jnp.zeros((_STATE_BLOCK,), jnp.int32))
            in_batch = hits > 0
            window = pl.ds(first, _STATE_BLOCK)
            temperature = plgpu.load(temperature_ref.at[window], mask=mask, other=0.0)
            seed = plgpu.load(seeds_ref.at[window], mask=mask, other=0)
            plgpu.store(temperature_out_ref.at[window],
                        jnp.where(in_batch, temperature, 0.0), mask=mask)
            plgpu.store(seeds_out_ref.at[window], jnp.where(in_batch, seed, 0), mask=mask)

        fill(R * B, cfg.max_num_tokens, _PAD_BLOCK, queries)
        fill(R * N, cfg.max_num_reqs * N, _PAD_BLOCK, samples)
        fill(R, cfg.max_num_reqs + 1, _PAD_BLOCK, query_starts)
        fill(R, cfg.max_num_reqs, _PAD_BLOCK, seq_lens)
        fill(0, T, _PAD_BLOCK, context_outside)
        fill(0, cfg.max_num_reqs, _STATE_BLOCK, sampling_state)


def _output_shapes(cfg):
    i32 = jnp.int32
    sds = jax.ShapeDtypeStruct
    return DFlashLayout(
        input_ids=sds((cfg.max_num_tokens,), i32),
        query_positions=sds((cfg.max_num_tokens,), i32),
        query_slot_mapping=sds((cfg.max_num_tokens,), i32),
        query_start_loc=sds((cfg.max_num_reqs + 1,), i32),
        seq_lens=sds((cfg.max_num_reqs,), i32),
        context_positions=sds((cfg.num_target_rows,), i32),
        context_slot_mapping=sds((cfg.num_target_rows,), i32),
        sample_indices=sds((cfg.max_num_reqs * cfg.num_steps,), i32),
        sample_pos=sds((cfg.max_num_reqs * cfg.num_steps,), i32),
        sample_idx_mapping=sds((cfg.max_num_reqs * cfg.num_steps,), i32),
        temperature=sds((cfg.max_num_reqs,), jnp.float32),
        seeds=sds((cfg.max_num_reqs,), i32))


def _num_warps(cfg):
    return 4 if cfg.row_block >= 128 else 2


def _pallas_layout(cfg, *inputs, interpret):
    out_shapes = _output_shapes(cfg)
    outputs = pl.pallas_call(
        functools.partial(_layout_kernel, cfg),
        out_shape=jax.tree_util.tree_leaves(out_shapes),
        grid=(cfg.num_reqs + 1, cfg.programs_per_req),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=_num_warps(cfg), num_stages=1),
        name="dflash_layout",
    )(*inputs)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shapes), outputs)


def _triton_layout(cfg, *inputs):
    try:
        import jax_triton
        from pallas_kernels import dflash_layout_triton
    except Exception as error:  # jax-triton raises more than ImportError on a CPU jax.
        raise ValueError(
            "impl='triton' needs jax-triton and a GPU build of jax (import failed: "
            f"{error!r}); install it with `pip install dflash-jax[triton]` on a CUDA jax, "
            "or use impl='pallas'.") from error
    out_shapes = _output_shapes(cfg)
    outputs = jax_triton.triton_call(
        *inputs,
        kernel=dflash_layout_triton.layout_kernel,
        out_shape=jax.tree_util.tree_leaves(out_shapes),
        grid=(cfg.num_reqs + 1, cfg.programs_per_req),
        num_warps=_num_warps(cfg),
        num_stages=1,
        **dflash_layout_triton.kernel_constants(cfg, _PAD_BLOCK, _STATE_BLOCK, _BATCH_BLOCK),
    )
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shapes), outputs)


# --------------------------------------------------------------------------------------
# Entry point.
# --------------------------------------------------------------------------------------

def _check_inputs(cfg, impl, arrays):
    """Raises ValueError with what is wrong for bad static settings or shapes."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}; pick one of those.")
    for name, value, low in [("block_size", cfg.block_size, 1),
                             ("num_speculative_steps", cfg.num_steps, 1),
                             ("max_model_len", cfg.max_model_len, 1),
                             ("cp_size", cfg.cp_size, 1), ("cp_interleave", cfg.cp_interleave, 1)]:
        if value < low:
            raise ValueError(f"{name} must be at least {low}, got {value}.")
    R = cfg.num_reqs
    if R < 1:
        raise ValueError("idx_mapping is empty: the layout needs at least one request.")
    if R > cfg.max_num_reqs:
        raise ValueError(f"the batch has {R} requests but max_num_reqs is "
                         f"{cfg.max_num_reqs}; raise max_num_reqs.")
    if R * cfg.query_len > cfg.max_num_tokens:
        raise ValueError(f"{R} requests need {R * cfg.query_len} query rows but "
                         f"max_num_tokens is {cfg.max_num_tokens}; raise max_num_tokens.")
    if cfg.num_target_rows < 1:
        raise ValueError("target_positions is empty: the target ran no rows.")
    expected = {"target_query_start_loc": (R + 1,), "num_sampled": (R,),
                "num_rejected": (R,), "last_sampled": (cfg.max_num_reqs,),
                "next_prefill_tokens": (cfg.max_num_reqs,), "temperature": (cfg.max_num_reqs,),
                "seeds": (cfg.max_num_reqs,)}
    for name, shape in expected.items():
        if arrays[name].shape != shape:
            raise ValueError(f"{name} has shape {arrays[name].shape}, expected {shape} "
                             f"(num_reqs={R}, max_num_reqs={cfg.max_num_reqs}).")
    block_table = arrays["block_table"]
    if block_table.ndim != 2 or block_table.shape[0] != R or block_table.shape[1] < 1:
        raise ValueError(f"block_table has shape {block_table.shape}, expected "
                         f"[num_reqs={R}, max_blocks >= 1]: row r is batch row r's pages.")


@functools.partial(jax.jit, static_argnames=(
    "block_size", "parallel_drafting_token_id", "num_speculative_steps", "max_num_reqs",
    "max_num_tokens", "max_model_len", "cp_size", "cp_interleave", "pad_slot_id", "impl", "interpret"))
def prepare_dflash_inputs(target_positions, target_query_start_loc, idx_mapping,
                          last_sampled, next_prefill_tokens, num_sampled, num_rejected,
                          temperature, seeds, block_table, *, block_size,
                          parallel_drafting_token_id, num_speculative_steps, max_num_reqs,
                          max_num_tokens, max_model_len, cp_rank=0, cp_size=1,
                          cp_interleave=1, pad_slot_id=-1, impl="auto", interpret=None):
    """Lays out the draft step's query, context and sample rows; see the module docstring.

    Integer inputs are int32 (temperature float32). ``cp_rank`` may be traced (e.g.
    ``lax.axis_index`` under shard_map); every other keyword is static. Requests' target
    rows must be in order (``target_query_start_loc`` non-decreasing) and each request
    needs at least one unrejected row. A multi-group drafter calls this once per KV-cache
    group with that group's block table and page size.

    impl: "pallas" (Triton lowering on GPU, interpret mode elsewhere), "triton" (native
    Triton through jax-triton, GPU only), "reference" (vectorised jnp), or "auto"
    (pallas on GPU and CPU, the reference on other backends). interpret (pallas): None runs
    compiled on a GPU backend and in interpret mode elsewhere.
    """
    i32 = jnp.int32
    arrays = dict(
        target_positions=jnp.asarray(target_positions, i32),
        target_query_start_loc=jnp.asarray(target_query_start_loc, i32),
        idx_mapping=jnp.asarray(idx_mapping, i32),
        last_sampled=jnp.asarray(last_sampled, i32),
        next_prefill_tokens=jnp.asarray(next_prefill_tokens, i32),
        num_sampled=jnp.asarray(num_sampled, i32),
        num_rejected=jnp.asarray(num_rejected, i32),
        temperature=jnp.asarray(temperature, jnp.float32),
        seeds=jnp.asarray(seeds, i32),
        block_table=jnp.asarray(block_table, i32))
    if arrays["target_positions"].ndim != 1 or arrays["idx_mapping"].ndim != 1:
        raise ValueError("target_positions and idx_mapping must be 1-D arrays.")
    cfg = _Config(
        num_target_rows=arrays["target_positions"].shape[0],
        num_reqs=arrays["idx_mapping"].shape[0],
        max_blocks=arrays["block_table"].shape[-1], block_size=block_size,
        token_id=parallel_drafting_token_id, num_steps=num_speculative_steps,
        max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens,
        max_model_len=max_model_len, cp_size=cp_size, cp_interleave=cp_interleave,
        pad_slot_id=pad_slot_id)
    _check_inputs(cfg, impl, arrays)
    cp_rank = jnp.asarray(cp_rank, i32)
    backend = jax.default_backend()
    if impl == "auto":
        impl = "pallas" if backend in ("gpu", "cpu") else "reference"
    if impl == "reference":
        return _reference_layout(cfg, *arrays.values(), cp_rank)
    kernel_inputs = list(arrays.values())
    kernel_inputs[-1] = kernel_inputs[-1].reshape(-1)  # block table, flattened
    kernel_inputs.append(cp_rank.reshape(1))
    if impl == "triton":
        return _triton_layout(cfg, *kernel_inputs)
    return _pallas_layout(cfg, *kernel_inputs, interpret=runs_interpreted(interpret))
