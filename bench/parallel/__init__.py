"""Tensor parallelism: a cost model of what it should gain, and the table of what it did."""
