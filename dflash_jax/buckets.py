"""The step programs an Engine compiles: which (rows, tokens) shapes, greedy or sampling.

A batch of r requests and t tokens (verify rows and prefill chunks) runs padded to one of a
few static shapes. Rows round up to a power of two b <= max_num_reqs, and tokens take one of
two sizes for that b (the Engine passes its sizes rounded up to powers of two):

- `b * num_query`, when the batch fits it: every row verifying its 1 + N rows (the decode
  steps, nearly all steps of a long answer) runs with no padding past its rows bucket;
- `max_num_tokens` otherwise: a batch with a prefill chunk is padded to the step's budget.

Prefill steps are rare next to decode steps (one per chunk of a prompt), so their padding
costs little; one shape per rows bucket instead of one per power of two of tokens is what
keeps the count small. Each decode shape has a greedy program (sampling compiled down to
argmaxes) and a sampling one; a prefill shape only the sampling one, whose temperature-0
rows take the same argmax path behind one runtime branch. For 8 requests that is
4 rows buckets x (2 + 1) = 12 programs.

`programs` lists them in warm-up order, fewest rows first: for each rows bucket the budget
shape first (sampling), which runs any batch of that many requests, then the decode shapes. The
first program alone serves one request of any kind, slowly: a server opens its port after it
and, while the rest compile, runs each batch on the smallest compiled program that holds it.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.common import next_pow2


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled step: its static rows and tokens, and whether it only samples greedily."""

    rows: int
    tokens: int
    greedy: bool


def rows_buckets(max_num_reqs: int) -> list[int]:
    """1, 2, 4, ... up to max_num_reqs (a power of two)."""
    return [1 << i for i in range(max_num_reqs.bit_length()) if 1 << i <= max_num_reqs]


def bucket_for(num_rows: int, num_tokens: int, *, max_num_tokens: int, num_query: int) -> tuple[int, int]:
    """The (rows, tokens) shape a batch of `num_rows` requests and `num_tokens` tokens runs in."""
    rows = next_pow2(num_rows)
    decode = rows * num_query
    return rows, decode if num_tokens <= decode else max_num_tokens


def programs(*, max_num_reqs: int, max_num_tokens: int, num_query: int) -> list[Program]:
    """Every program a batch can need, in warm-up order (see the module docstring)."""
    out = []
    for rows in rows_buckets(max_num_reqs):
        decode = rows * num_query
        if decode < max_num_tokens:
            out.append(Program(rows, max_num_tokens, greedy=False))
        out.extend((Program(rows, decode, greedy=False), Program(rows, decode, greedy=True)))
    return out


def program_for(num_rows: int, num_tokens: int, greedy: bool, *, max_num_tokens: int, num_query: int) -> Program:
    """The program a batch runs: its bucket's greedy program only for an all-greedy decode shape."""
    rows, tokens = bucket_for(num_rows, num_tokens, max_num_tokens=max_num_tokens, num_query=num_query)
    return Program(rows, tokens, greedy and tokens == rows * num_query)


def holds(program: Program, num_rows: int, num_tokens: int, greedy: bool) -> bool:
    """Whether `program` can run a batch: enough rows and tokens, and sampling unless the batch is all greedy."""
    return program.rows >= num_rows and program.tokens >= num_tokens and (greedy or not program.greedy)
