"""Elastic memory: change the number of expert slots and KV pages of a running engine.

Runs on the scheduler's loop thread while no request is running (callers either get `Busy` or
ask to drain first), or on an engine no scheduler owns (`FreeTokenEngine.rebuild_runtime_cache`,
between generations). Phases:

1. validate — the new geometry must pass the memory planner, hold at least one step's experts,
   and the decode step for it must compile; on a GPU its memory analysis must fit what the old
   geometry frees plus what is free. A rejected target changes nothing.
2. switch — free the old KV pool and slot arrays, allocate the new ones (host banks stay; slots
   start cold). Cached prefixes survive when the pool grows (their pages are copied); a smaller
   pool drops the prefix cache.
3. on any failure in 2, rebuild the previous geometry; if that fails too, the scheduler enters a
   failed state: `Health` says so and new work is refused rather than served wrong.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.config import ConfigError
from freetoken_jax.memory.budget import device_memory_bytes, plan_memory
from freetoken_jax.memory.expert_cache import init_slot_cache
from freetoken_jax.memory.kv_pages import PageAllocator
from freetoken_jax.models import jnp_dtype
from freetoken_jax.runtime.kv_cache import cache_bytes, init_cache
from freetoken_jax.runtime.steps import DecodeBatch, DecodeState, on_device, shapes
from freetoken_jax.scheduler.radix import RadixCache


class Busy(RuntimeError):
    """Requests are running; retry, or ask to drain first."""


class RebuildFailed(RuntimeError):
    """The new geometry could not be built; the previous one was restored (or, if that failed too,
    the engine is in a failed state)."""


def status(sched) -> dict:
    e = sched.engine
    return dict(
        moe_strategy=e.engine_config.moe_strategy,
        expert_slots=e.plan.slots if e.engine_config.uses_slots else None,
        kv_pages=e.pages.num_pages,
        kv_pages_free=e.pages.free_pages,
        prefix_cached_pages=sched.radix.cached_pages if sched.radix else 0,
        plan=e.plan.describe(),
        failed=sched.failed,
        rebuilds=sched.metrics.get("rebuilds", 0),
    )


def _validate(sched, expert_slots, kv_pages):
    eng = sched.engine
    ecfg = eng.engine_config
    if expert_slots is None and kv_pages is None:
        raise ConfigError("give expert_slots and/or kv_pages")
    if expert_slots is not None:
        if not ecfg.uses_slots:
            raise ConfigError(f"strategy {ecfg.moe_strategy!r} has no expert slots to resize (only 'offload' and 'hybrid' do)")
        if not isinstance(expert_slots, int) or isinstance(expert_slots, bool) or expert_slots <= 0:
            raise ConfigError(f"expert_slots must be a positive integer, got {expert_slots!r}")
    if kv_pages is not None:
        if not isinstance(kv_pages, int) or isinstance(kv_pages, bool) or kv_pages < 2:
            raise ConfigError(f"kv_pages must be an integer of at least 2 (page 0 is reserved), got {kv_pages!r}")
        need = eng.pages.pages_for(ecfg.max_context)
        if kv_pages - 1 < need:
            raise ConfigError(
                f"kv_pages={kv_pages} cannot hold one full-length sequence ({need} pages of {ecfg.page_size} tokens + the reserved page)"
            )
    new = ecfg.replace(
        kv_pages=kv_pages if kv_pages is not None else eng.pages.num_pages,
        expert_slots=expert_slots if expert_slots is not None else (eng.plan.slots if ecfg.uses_slots else None),
        total_vram_gb=ecfg.total_vram_gb,
        initial_expert_capacity=None,
    )
    itemsize = jnp.dtype(jnp_dtype(new.dtype)).itemsize
    plan = plan_memory(
        eng.model_config, new, eng.plan.dense_bytes, cache_bytes(eng.model_config, new, itemsize), itemsize, device_memory_bytes()
    )
    try:
        _compile_check(sched, new, plan)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a geometry that does not compile is refused, untouched
        raise ConfigError(f"the new geometry failed to compile: {type(e).__name__}: {e}") from e
    return new, plan


def _abstract_state(eng, new, plan):
    """The new geometry's decode state as shapes, placed as `DecodeState.start` places it."""
    cfg, dtype, B = eng.model_config, jnp_dtype(new.dtype), new.max_batch
    state = jax.eval_shape(
        lambda: DecodeState(
            init_cache(cfg, new, dtype),
            jnp.zeros((B,), jnp.int32),
            jnp.zeros((B,), jnp.int32),
            init_slot_cache(cfg, plan.slots, B, dtype) if new.uses_slots else None,
        )
    )
    return shapes(state, committed=True)


def _compile_check(sched, new, plan) -> None:
    """Compiles the decode step of the new geometry and checks its memory against the device.
    It is compiled through the engine's own jitted step with the arguments placed as the serving
    loop will place them, so the loop's first step after the resize finds it compiled."""
    eng = sched.engine
    B, P = new.max_batch, new.pages_per_sequence
    compiled = eng.decode.lower(eng.weights, _abstract_state(eng, new, plan), DecodeBatch.shapes(B, P)).compile()
    limit = device_memory_bytes()
    ma = compiled.memory_analysis() if limit else None
    if ma is not None:
        stats = jax.devices()[0].memory_stats() or {}
        in_use = stats.get("bytes_in_use", 0)
        old = sum(x.nbytes for x in jax.tree.leaves((sched.state.cache, sched.state.experts)))
        need = cache_bytes(eng.model_config, new, jnp.dtype(jnp_dtype(new.dtype)).itemsize) + plan.slot_bytes * (new.uses_slots)
        need += getattr(ma, "temp_size_in_bytes", 0)
        if in_use - old + need > limit:
            raise ConfigError(
                f"the new geometry needs {need / 2**30:.2f} GiB; after freeing the old one only {(limit - in_use + old) / 2**30:.2f} GiB would be free"
            )


def _allocate(sched, new, plan, keep_prefix: bool) -> None:
    """Frees the old pool and slots and builds the new ones (the destructive phase)."""
    eng, old_state = sched.engine, sched.state
    cfg, dtype = eng.model_config, jnp_dtype(new.dtype)
    old_kv, old_alloc = old_state.cache, eng.pages
    grow = keep_prefix and sched.radix is not None and new.total_kv_pages >= old_alloc.num_pages
    if grow:
        kv = tuple(tuple(jnp.zeros((new.total_kv_pages, *a.shape[1:]), a.dtype).at[: a.shape[0]].set(a) for a in layer) for layer in old_kv)
        alloc = PageAllocator(new.total_kv_pages, new.page_size)
        held = set(range(1, old_alloc.num_pages)) - set(old_alloc._free)
        alloc._free = [p for p in alloc._free if p not in held]
    else:
        for a in jax.tree.leaves(old_kv):
            a.delete()
        kv = on_device(init_cache(cfg, new, dtype))
        alloc = PageAllocator(new.total_kv_pages, new.page_size)
        if sched.radix is not None:
            sched.radix = RadixCache(new.page_size)
    if old_state.experts is not None:
        for a in jax.tree.leaves(old_state.experts):
            a.delete()
    experts = init_slot_cache(cfg, plan.slots, new.max_batch, dtype) if new.uses_slots else None
    sched.state = DecodeState.start(kv, np.zeros(new.max_batch), np.zeros(new.max_batch), experts)
    eng.pages, eng.engine_config, eng.plan = alloc, new, plan


def rebuild(sched, expert_slots: int | None = None, kv_pages: int | None = None) -> dict:
    """Runs on the loop thread with no request running. Returns the new status."""
    eng = sched.engine
    new, plan = _validate(sched, expert_slots, kv_pages)  # nothing touched yet
    prev = (eng.engine_config, eng.plan)
    try:
        _allocate(sched, new, plan, keep_prefix=True)
    except Exception as e:  # noqa: BLE001 - roll back whatever went wrong
        try:
            _allocate(sched, prev[0], prev[1], keep_prefix=False)
        except Exception as e2:  # noqa: BLE001
            sched.failed = f"rebuild failed ({e}) and restoring the previous geometry failed too ({e2}); restart the server"
            raise RebuildFailed(sched.failed) from e2
        raise RebuildFailed(
            f"rebuild to {dataclasses.asdict(new)} failed ({type(e).__name__}: {e}); the previous geometry was restored"
        ) from e
    sched.metrics["rebuilds"] = sched.metrics.get("rebuilds", 0) + 1
    return status(sched)


class _EngineOwner:
    """An engine's own caches in the form `rebuild` works on (an engine no scheduler owns)."""

    def __init__(self, eng):
        B = eng.engine_config.max_batch
        self.engine, self.radix, self.metrics, self.failed = eng, None, eng._m, None
        self.state = DecodeState.start(eng.cache, np.zeros(B), np.zeros(B), eng.slots)


def rebuild_engine(eng, expert_slots: int | None = None, kv_pages: int | None = None) -> dict:
    """`rebuild` for an engine used directly (`generate`, `generate_batch`), between generations."""
    if eng.failed:
        raise RebuildFailed(eng.failed)
    if eng.cache is None:
        raise Busy("a generation is running, or a scheduler owns this engine's caches (resize through it: Scheduler.rebuild_cache)")
    owner = _EngineOwner(eng)
    try:
        out = rebuild(owner, expert_slots, kv_pages)
    finally:
        eng.cache, eng.slots, eng.failed = owner.state.cache, owner.state.experts, owner.failed
    del out["prefix_cached_pages"]
    return out
