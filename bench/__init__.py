"""Benchmarks, result files and notes of dflash-jax (not installed with the package)."""
