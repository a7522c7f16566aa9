"""Decode speed: the AR step, the DFlash cycle and its parts, the Engine step, generate's fixed
cost, and batch-1 tokens/s with real weights."""
