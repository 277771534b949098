"""Benchmarks users run on their own machine: `python -m freetoken_jax.bench bw`."""
