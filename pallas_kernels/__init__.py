"""Pallas kernels of freetoken_jax: one module per kernel, each with a jnp reference beside it
and an `interpret` switch (interpret mode is how they run on the CPU backend)."""
