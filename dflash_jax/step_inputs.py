"""The Engine's host -> device step inputs, declared once: what each field is, its shape and
its padding value. The host fills one int32 buffer row by row (numpy views named after the
fields; the float32 fields are views of the same bytes) and moves it to the device as one
array, one transfer per step; the step program cuts it apart again with the same static
layout (`unpack`). Each step starts from a copy of its shapes' blank buffer, all padding, made
once: building the views and padding anew is host time on every step.

A verifying row's tokens, positions and KV slots, and its anchor position, come from the
device state (`cycle.fill_verify_rows`): the host leaves them blank and never needs to know
a step's tokens to schedule the next one.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from dflash_jax.cycle import CycleBatch, LogitsAdjustment, PenaltyRows, SamplingRows
from dflash_jax.kv_cache import NULL_PAGE
from dflash_jax.requests import MAX_LOGIT_BIAS
from dflash_jax.scheduler import Work
from dflash_jax.steps import TargetBatch

# (name, shape in letters as in docs/ARCHITECTURE.md, padding value); window_table_{i}: the
# page table of windowed drafter cache group i.
INT_FIELDS = (
    ("tokens", "T", 0),
    ("positions", "T", 0),
    ("rows", "T", 0),  # batch row of each token (0 for padding)
    ("query_start_loc", "R+1", 0),
    ("page_table", "RP", NULL_PAGE),
    ("verify_rows", "RQ", 0),  # target rows whose logits verify (a prefill row: its last, repeated)
    ("slot", "R", None),  # request slot (max_num_reqs for padding rows: writes dropped)
    ("anchor_pos", "R", 0),  # a prefill row's last position (verifying rows: from the state)
    ("last_pos", "R", 0),  # the request's last position (prompt + max new tokens - 1)
    ("verifying", "R", 0),  # 1: anchor + drafts from the state, 0: a prefill chunk
    ("samples", "R", 0),  # 1 if the row commits a token this step, 0 mid-prefill or padding
    ("next_prefill", "R", 0),  # the next prompt token of a row mid-prefill
    ("stop_ids", "RE", -1),
    ("top_k", "R", 0),
    ("seeds", "R", 0),
    ("cycles", "1", 1),  # verify cycles the step runs (more than one only when every row verifies)
    ("bias_ids", "RW", -1),  # the row's logit bias: token ids
    ("min_stop_pos", "R", 0),  # no stop token before this position (prompt + min_tokens)
    ("prompt_len", "R", 0),
    ("restore_state", "R", -1),  # hybrid targets: the saved state a prefill row starts from
    ("save_state", "R", -1),  # hybrid targets: where the row's state after it is saved
)
FLOAT_FIELDS = (("temperature", "R", 0.0), ("top_p", "R", 1.0), ("bias", "RW", 0.0), ("presence", "R", 0.0),
                ("frequency", "R", 0.0), ("repetition", "R", 1.0))


class StepInputs:
    """One step's inputs as numpy views into one int32 buffer; `layout` (static) says where
    each field lies and of which dtype, for `unpack`."""

    def __init__(self, *, num_rows: int, num_tokens: int, num_query: int, pages_per_req: int, max_num_reqs: int,
                 num_window_groups: int, max_stop_ids: int):
        blank, self.layout = _blank(num_rows, num_tokens, num_query, pages_per_req, max_num_reqs, num_window_groups,
                                    max_stop_ids)
        self.buffer = blank.copy()
        for name, shape, offset, dtype in self.layout:
            setattr(self, name, _view(self.buffer, shape, offset, dtype))
        self.window_tables = tuple(getattr(self, f"window_table_{i}") for i in range(num_window_groups))

    def fill(self, work: list[Work], num_query: int) -> None:
        """Rows for `work`, in order: each request's tokens (a prefill chunk) or blank verify
        rows, its pages and its sampling parameters; the step's cycles (`Work.cycles`, the
        same for every share of a step)."""
        self.cycles[0] = work[0].cycles
        start = 0
        for r, w in enumerate(work):
            request, rows = w.request, w.rows
            span = slice(start, start + rows)
            if w.verifying:
                self.verify_rows[r] = start + np.arange(num_query)
            else:
                positions = np.arange(request.num_computed, request.num_computed + rows)
                self.tokens[span] = request.tokens[request.num_computed : request.num_computed + rows]
                self.positions[span] = positions
                self.verify_rows[r] = start + rows - 1
                self.anchor_pos[r] = positions[-1]
                if not w.samples:
                    self.next_prefill[r] = request.tokens[request.num_computed + rows]
                self.restore_state[r], self.save_state[r] = w.restore, w.save
            self.verifying[r] = w.verifying
            self.samples[r] = w.samples
            self.rows[span] = r
            self.page_table[r, : len(request.pages)] = request.pages
            for window_table, pages in zip(self.window_tables, request.window_pages):
                window_table[r, : len(pages)] = pages
            self.last_pos[r] = request.last_pos
            self.slot[r] = request.slot
            params = request.params
            stops = sorted(set(params.stop_token_ids))
            self.stop_ids[r, : len(stops)] = stops
            self.temperature[r], self.top_k[r], self.top_p[r] = params.temperature, params.top_k, params.top_p
            self.seeds[r] = params.seed
            if params.logit_bias:
                ids, biases = zip(*params.logit_bias)
                self.bias_ids[r, : len(ids)], self.bias[r, : len(ids)] = ids, biases
            self.min_stop_pos[r] = request.prompt_len + params.min_tokens
            self.prompt_len[r] = request.prompt_len
            self.presence[r], self.frequency[r] = params.presence_penalty, params.frequency_penalty
            self.repetition[r] = params.repetition_penalty
            start += rows
            self.query_start_loc[r + 1] = start
        self.query_start_loc[len(work) + 1 :] = start


@functools.lru_cache(maxsize=None)
def _blank(num_rows, num_tokens, num_query, pages_per_req, max_num_reqs, num_window_groups, max_stop_ids):
    """(the padding-filled buffer, the layout) of steps of these sizes; the buffer is copied, never written."""
    sizes = {"T": num_tokens, "R": num_rows, "R+1": num_rows + 1, "Q": num_query, "P": pages_per_req,
             "E": max_stop_ids, "W": MAX_LOGIT_BIAS, "1": 1}
    fields = [(name, letters, fill, "int32") for name, letters, fill in INT_FIELDS]
    fields += [(f"window_table_{i}", "RP", NULL_PAGE, "int32") for i in range(num_window_groups)]
    fields += [(name, letters, fill, "float32") for name, letters, fill in FLOAT_FIELDS]
    shapes = [(sizes[letters],) if letters in sizes else tuple(sizes[letter] for letter in letters)
              for _, letters, _, _ in fields]
    counts = [int(np.prod(shape)) for shape in shapes]
    blank = np.empty(sum(counts), np.int32)
    layout, offset = [], 0
    for (name, _, fill, dtype), shape, count in zip(fields, shapes, counts):
        _view(blank, shape, offset, dtype)[...] = max_num_reqs if fill is None else fill
        layout.append((name, shape, offset, dtype))
        offset += count
    return blank, tuple(layout)


def _view(buffer, shape, offset: int, dtype: str):
    """The field at `offset` of `shape` in the int32 `buffer` (numpy or jax), as `dtype`."""
    field = buffer[offset : offset + int(np.prod(shape))]
    if dtype != "int32":
        field = field.view(dtype) if isinstance(field, np.ndarray) else jax.lax.bitcast_convert_type(field, dtype)
    return field.reshape(shape)


def unpack(buffer, layout) -> tuple[CycleBatch, object]:
    """(the step's `CycleBatch`, the step's cycles) from
    `StepInputs`' buffer and static layout. The batch's `remaining_R` holds the rows' `samples`
    flags: the step turns them into counts once the verify rows' anchor positions are known."""
    f = {name: _view(buffer, shape, offset, dtype) for name, shape, offset, dtype in layout}
    target = TargetBatch(
        token_ids=f["tokens"], positions=f["positions"], rows=f["rows"], slots=None,  # `fill_verify_rows`
        query_start_loc=f["query_start_loc"], page_table=f["page_table"], logits_rows=f["verify_rows"].reshape(-1),
    )
    window_tables = tuple(f[name] for name, _, _, _ in layout if name.startswith("window_table_"))
    batch = CycleBatch(
        target=target, draft_page_tables=(f["page_table"], *window_tables), slots_R=f["slot"],
        verify_rows_RQ=f["verify_rows"], anchor_pos_R=f["anchor_pos"], verifying_R=f["verifying"] != 0,
        remaining_R=f["samples"], next_prefill_tokens_R=f["next_prefill"], stop_ids_RE=f["stop_ids"],
        sampling=SamplingRows(temperature_R=f["temperature"], top_k_R=f["top_k"], top_p_R=f["top_p"],
                              seeds_R=f["seeds"]),
        adjustment=LogitsAdjustment(bias_ids_RW=f["bias_ids"], bias_RW=f["bias"], min_stop_pos_R=f["min_stop_pos"]),
        penalties=PenaltyRows(presence_R=f["presence"], frequency_R=f["frequency"], repetition_R=f["repetition"],
                              prompt_len_R=f["prompt_len"]),
        restore_R=f["restore_state"], save_R=f["save_state"], last_pos_R=f["last_pos"],
    )
    return batch, f["cycles"][0]
