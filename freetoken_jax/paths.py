"""Where the engine keeps files between runs: `<XDG_CACHE_HOME or ~/.cache>/freetoken_jax`
(the machine's bandwidth profile `benchbw.json`, compiled executables)."""

from __future__ import annotations

import os


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "freetoken_jax")
