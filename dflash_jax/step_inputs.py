"""The Engine's host -> device step inputs, declared once: what each field is, its shape and
its padding value. The host fills one int32 and one float32 buffer row by row (numpy views
named after the fields) and moves them to the device as two arrays, not one transfer per
field; the step program cuts them apart again with the same static layout (`unpack`).

A verifying row's tokens, positions and KV slots, and its anchor position, come from the
device state (`cycle.fill_verify_rows`): the host leaves them blank and never needs to know
a step's tokens to schedule the next one.
"""

from __future__ import annotations

import numpy as np

from dflash_jax.cycle import CycleBatch, SamplingRows
from dflash_jax.kv_cache import NULL_PAGE
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
)
FLOAT_FIELDS = (("temperature", "R", 0.0), ("top_p", "R", 1.0))


class StepInputs:
    """One step's inputs as numpy views into two buffers; `layout` (static) says where each
    field lies, for `unpack`."""

    def __init__(self, *, num_rows: int, num_tokens: int, num_query: int, pages_per_req: int, max_num_reqs: int,
                 num_window_groups: int, max_stop_ids: int):
        sizes = {"T": num_tokens, "R": num_rows, "R+1": num_rows + 1, "Q": num_query, "P": pages_per_req,
                 "E": max_stop_ids}
        int_fields = list(INT_FIELDS) + [(f"window_table_{i}", "RP", NULL_PAGE) for i in range(num_window_groups)]
        self.ints, int_layout = self._buffer(int_fields, sizes, np.int32, pad_slot=max_num_reqs)
        self.floats, float_layout = self._buffer(FLOAT_FIELDS, sizes, np.float32, pad_slot=max_num_reqs)
        self.layout = (int_layout, float_layout)
        self.window_tables = tuple(getattr(self, f"window_table_{i}") for i in range(num_window_groups))

    def _buffer(self, fields, sizes, dtype, pad_slot):
        """One buffer for `fields`, each also set as a named view; returns (buffer, layout)."""
        shapes = [self._shape(letters, sizes) for _, letters, _ in fields]
        counts = [int(np.prod(shape)) for shape in shapes]
        buffer = np.empty(sum(counts), dtype)
        layout, offset = [], 0
        for (name, _, fill), shape, count in zip(fields, shapes, counts):
            view = buffer[offset : offset + count].reshape(shape)
            view[...] = pad_slot if fill is None else fill
            setattr(self, name, view)
            layout.append((name, shape, offset))
            offset += count
        return buffer, tuple(layout)

    @staticmethod
    def _shape(letters: str, sizes) -> tuple[int, ...]:
        return (sizes[letters],) if letters in sizes else tuple(sizes[letter] for letter in letters)

    def fill(self, work: list[Work], num_query: int) -> None:
        """Rows for `work`, in order: each request's tokens (a prefill chunk) or blank verify
        rows, its pages and its sampling parameters."""
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
            start += rows
            self.query_start_loc[r + 1] = start
        self.query_start_loc[len(work) + 1 :] = start


def unpack(ints, floats, layout) -> tuple[CycleBatch, object]:
    """(the step's `CycleBatch`, each row's last position) from `StepInputs`' two buffers and
    static layout. The batch's `remaining_R` holds the rows' `samples` flags: the step turns
    them into counts once the verify rows' anchor positions are known."""
    f = {name: buffer[offset : offset + int(np.prod(shape))].reshape(shape)
         for buffer, fields in zip((ints, floats), layout) for name, shape, offset in fields}
    target = TargetBatch(
        token_ids=f["tokens"], positions=f["positions"], rows=f["rows"], slots=None,  # `fill_verify_rows`
        query_start_loc=f["query_start_loc"], page_table=f["page_table"], logits_rows=f["verify_rows"].reshape(-1),
    )
    window_tables = tuple(f[name] for name, _, _ in layout[0] if name.startswith("window_table_"))
    batch = CycleBatch(
        target=target, draft_page_tables=(f["page_table"], *window_tables), slots_R=f["slot"],
        verify_rows_RQ=f["verify_rows"], anchor_pos_R=f["anchor_pos"], verifying_R=f["verifying"] != 0,
        remaining_R=f["samples"], next_prefill_tokens_R=f["next_prefill"], stop_ids_RE=f["stop_ids"],
        sampling=SamplingRows(temperature_R=f["temperature"], top_k_R=f["top_k"], top_p_R=f["top_p"],
                              seeds_R=f["seeds"]),
    )
    return batch, f["last_pos"]
