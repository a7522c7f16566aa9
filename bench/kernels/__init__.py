"""Kernels and products on their own: correct against their references, and how fast."""
