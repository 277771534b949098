"""Compiled executables kept on disk between runs: JAX's persistent compilation cache.

A large model's decode step takes about a minute to compile (Qwen3-30B-A3B shape on an H200,
benchmarks/RESULTS.md) and a server compiles one per decode bucket and one per prefill chunk
bucket; with the cache a restart with the same model, configuration, jax and device loads them
instead. The key is the compiled program itself (with the jax version, backend and device
kind), so a changed model or setting compiles afresh. Programs that call back into Python
(`jax.pure_callback`, the CPU backend's handoff) are never cached by JAX; the FFI handoff is.

The cache is process-wide JAX state: `enable` sets it for every later compile of the process.
The command line enables it by default (`--compile-cache DIR`, `--no-compile-cache`).
"""

from __future__ import annotations

import os

import jax

from freetoken_jax.paths import cache_dir


def default_dir() -> str:
    return os.path.join(cache_dir(), "xla")


def enable(path: str | None = None, min_compile_seconds: float = 1.0) -> str:
    """Keeps executables whose compile took at least `min_compile_seconds` in `path` (default
    `<cache dir>/freetoken_jax/xla`); returns the directory. Delete it to start afresh."""
    path = os.path.abspath(os.path.expanduser(path or default_dir()))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
