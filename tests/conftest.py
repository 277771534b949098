import os
import tempfile

# The suite's time is mostly XLA compiling tiny models' steps on the CPU: compile them without
# LLVM's optimisations (the programs run for microseconds). Subprocesses inherit it.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
).strip()

# The demo model is written to the cache directory on first use: keep tests out of the user's.
os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="freetoken-test-cache-"))

import pytest  # noqa: E402

from freetoken_jax import compile_cache  # noqa: E402

# Tests build many engines of the same shapes: identical steps compile once per session (a
# persistent cache in this session's fresh cache directory, so nothing carries over).
compile_cache.enable(os.path.join(os.environ["XDG_CACHE_HOME"], "xla-tests"), min_compile_seconds=0.0)

from freetoken_jax import EngineConfig, FreeTokenEngine  # noqa: E402


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_checkpoints"))


@pytest.fixture(scope="session")
def small_engine_config():
    # Pages of 4 tokens and chunks of 16 make 21-token prompts span pages and prefill chunks.
    return EngineConfig(dtype="float32", max_context=64, max_batch=4, page_size=4, prefill_chunk=16)


@pytest.fixture(scope="session")
def demo_engine():
    return FreeTokenEngine.from_pretrained(
        "demo", EngineConfig(dtype="float32", max_context=128, max_batch=4, page_size=8, prefill_chunk=32)
    )


@pytest.fixture
def demo_scheduler():
    """`demo_scheduler(engine_config, **kw)`: a scheduler over a fresh demo engine, shut down
    after the test."""
    from freetoken_jax.scheduler.scheduler import Scheduler

    made = []

    def start(ecfg: EngineConfig, **kw):
        made.append(Scheduler(FreeTokenEngine.from_pretrained("demo", ecfg), **kw))
        return made[-1]

    yield start
    for s in made:
        s.shutdown()


@pytest.fixture
def full_float32_products():
    """float32 products in float32 on a GPU too (XLA's default there rounds them through TF32,
    three decimal digits; the element-wise tests that use this compare to 1e-5 or finer)."""
    import jax

    with jax.default_matmul_precision("highest"):
        yield
