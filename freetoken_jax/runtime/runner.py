"""The one owner of a model's device state, and the one place steps are compiled.

`ModelRunner` holds the weights and their expert backend, the memory plan, the page allocator
and the decode state (paged KV cache, each row's last token and position, the expert slot
cache); it runs prefill chunks, decode steps and scoring on that state, and resizes it
(`resize`). Nobody else keeps a reference to the state between calls: the batcher asks the
runner to run a step and gets tokens back.

`StepSet` holds the jitted steps (decode, the three prefills, score), counts how often each is
traced (= compiled: one executable per shape bucket), and compiles ahead of time for serving
warm-up, resize validation and benchmarks (`precompile`).

Elastic resize (between generations, no row running): (1) validate — the new geometry passes the
memory planner, holds at least one step's experts, and its decode step compiles; on a GPU its
memory analysis must fit what the old geometry frees plus what is free; a rejected target
changes nothing. (2) switch — free the old KV pool and slot arrays, allocate the new ones (host
banks stay; slots start cold); pages held by the caller's prefix cache survive when the pool
grows (copied), otherwise the caller drops its prefix cache. (3) on a failure in (2), rebuild
the previous geometry; if that fails too, the runner is `failed` and refuses work.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax import _cpu_ext
from freetoken_jax.config import ConfigError, EngineConfig, MoEModelConfig, Strategy, env_choice
from freetoken_jax.memory.budget import MemoryPlan, device_memory_bytes, host_memory_available, plan_memory, size
from freetoken_jax.memory.kv_cache import cache_bytes, copy_pages, grown_cache, init_cache, ring_groups, ring_pages, ring_pool_pages
from freetoken_jax.memory.kv_pages import PageAllocator
from freetoken_jax.memory.slot_cache import init_slot_cache
from freetoken_jax.models import jnp_dtype
from freetoken_jax.runtime import buckets
from freetoken_jax.runtime.balance import QBalance
from freetoken_jax.runtime.experts import ExpertBackend
from freetoken_jax.runtime.sampling import Logprobs, prompt_counts
from freetoken_jax.runtime.steps import (
    DecodeBatch,
    DecodeState,
    PrefillBatch,
    Sampling,
    Weights,
    decode_forward,
    decode_step,
    decode_step_plain,
    on_device,
    prefill_step,
    prefill_step_buffered,
    prefill_step_slots,
    sample_step,
    score_step,
    shapes,
)

log = logging.getLogger("freetoken_jax")

BALANCE_STEPS = 8  # decode steps between moves of hybrid's q (24-layer steps: ~190 handoffs summed)


class RebuildFailed(RuntimeError):
    """The new geometry could not be built; the previous one was restored (or, if that failed too,
    the runner is in a failed state)."""


def _traced(step, dtype: str, traces: dict[str, int]):
    """A fresh function object per step set (jit caches executables per function object), traced
    with full-precision float32 matmuls when the model runs in float32 (GPUs otherwise use
    reduced-precision passes for float32 dots). `traces` counts how often each step is traced,
    which is how often it is compiled."""

    @functools.wraps(step)
    def run(*args, **kw):
        traces[step.__name__] = traces.get(step.__name__, 0) + 1
        if dtype == "float32":
            with jax.default_matmul_precision("highest"):
                return step(*args, **kw)
        return step(*args, **kw)

    return run


def _token_last(step):
    """`step` returning (token, *rest) as (*rest, token), with its name (`_traced` counts by it).

    jit gives a donated input's buffer to the first output of the same shape and dtype. Listed
    first, the sampled token [rows] would take the buffer of the state's `tokens_B`, `tokens_B`
    that of `positions_B`, and `positions_B` a new one: three arrays at new device addresses every
    step, and XLA re-records every CUDA graph command that reads them before each step runs (on
    the H200, 1-2 ms of a 24-layer decode step). Listed last, the token is the one fresh output."""

    @functools.wraps(step)
    def run(*args, **kw):
        tok, *rest = step(*args, **kw)
        return (*rest, tok)

    return run


class _TokenFirst:
    """A jitted `_token_last` step called as the step itself: (token, *rest)."""

    def __init__(self, jitted):
        self.jitted = jitted

    def __call__(self, *args, **kw):
        *rest, tok = self.jitted(*args, **kw)
        return (tok, *rest)

    def lower(self, *args, **kw):
        return self.jitted.lower(*args, **kw)


def _dropping(step, index: int):
    """`step` without its output `index` (a copy of another output: the sampled token, which the
    step also returns as the state's tokens), with its name (`_traced` counts by it)."""

    @functools.wraps(step)
    def run(*args, **kw):
        out = step(*args, **kw)
        return (*out[:index], *out[index + 1 :])

    return run


def _into_buffer(forward):
    """A decode step's model half (`steps.decode_forward`) taking one more argument, a buffer of
    its logits' shape and dtype that the jitted step donates (and keeps: jit prunes unused
    arguments by default), so that the logits are written over it; with its name (`_traced`
    counts by it)."""

    def run(weights, state, batch, experts, logits_buffer):
        return forward(weights, state, batch, experts)

    run.__name__ = run.__qualname__ = forward.__name__
    return run


class _TokenCopied(_TokenFirst):
    """A jitted step that returns the state's new tokens (not a copy of them as well) called as
    the step itself, the sampled token first: a copy of those tokens made by a program of its own
    (`_copy_tokens`). Every output of the step then overwrites a donated input, so no array the step
    writes moves between steps: XLA records a decode step into one CUDA graph, and a fresh output
    of that graph (the token, at a new address each step) had it re-recorded before every step (on
    an H100, about 1 ms of a 24-layer fused step's host time: benchmarks/RESULTS.md). The copy, one
    small kernel outside the graph, reads the tokens before the next step donates them (one stream
    orders them). `tokens`: where the tokens are among the step's outputs."""

    def __init__(self, jitted, tokens):
        super().__init__(jitted)
        self.tokens = tokens

    def __call__(self, *args, **kw):
        out = self.jitted(*args, **kw)
        return (_copy_tokens(self.tokens(out)), *out)


def decode_outputs() -> str:
    """What the decode programs return, FREETOKEN_DECODE_OUTPUTS: "donated" (the default) — only
    arrays written over donated inputs: the state (a program of its own copies the sampled token
    out of it, `_TokenCopied`) and the model half's logits, written over a buffer the runner keeps
    (log-probabilities, where a row asks for them, stay outputs of their own); "fresh" — the token
    (and the logits) as outputs of their own, at new addresses each step. Read when the steps are
    made."""
    return env_choice("FREETOKEN_DECODE_OUTPUTS", "donated", ("donated", "fresh"))


@jax.jit
def _copy_tokens(tokens_B):
    """The decode state's tokens in a buffer of their own, which outlives the next step's donation."""
    return jnp.copy(tokens_B)


class StepSet:
    """The jitted steps of one model, state donated: `decode(weights, state, batch, experts)`
    (`steps.decode_step_plain`: greedy or temperature alone) and `decode_filtered` (`steps.decode_step`:
    top-k and top-p besides, which sort the vocabulary),
    `prefill(weights, cache, batch, experts)`, `prefill_buffered` / `prefill_slots(weights, cache,
    batch, slots, experts)` and `score(weights, cache, batch, experts)`; and the decode step in
    two halves for batches with rows that ask for more than temperature, top-k and top-p,
    `decode_logits` (`steps.decode_forward`) and `sample` (`steps.sample_step`: penalties, bias,
    log-probabilities, grammar masks, which the host computes while the model half runs)."""

    def __init__(self, dtype: str):
        self.traces: dict[str, int] = {}
        jit = lambda f, donate, **kw: jax.jit(_traced(f, dtype, self.traces), donate_argnums=donate, **kw)  # noqa: E731
        sampled = lambda f, donate, **kw: _TokenFirst(jit(_token_last(f), donate, **kw))  # noqa: E731
        self.donated = decode_outputs() == "donated"
        if self.donated:  # (token, state) from the state alone; the model half's logits written over a donated buffer
            state_only = lambda f: _TokenCopied(jit(_dropping(f, 0), (1,)), lambda out: out[0].tokens_B)  # noqa: E731
            self.decode = state_only(decode_step_plain)
            self.decode_filtered = state_only(decode_step)
            # unused, the buffer would be pruned: kept
            self.decode_logits = jit(_into_buffer(decode_forward), (1, 4), keep_unused=True)
            self.sample = _TokenCopied(jit(_dropping(sample_step, 0), (1, 2, 3), static_argnames=("logprobs",)), lambda out: out[0])
        else:
            self.decode = sampled(decode_step_plain, (1,))
            self.decode_filtered = sampled(decode_step, (1,))
            self.decode_logits = jit(decode_forward, (1,))
            self.sample = sampled(sample_step, (1, 2, 3), static_argnames=("logprobs",))  # with and without log-probabilities
        self.prefill = sampled(prefill_step, (1,))
        self.prefill_buffered = sampled(prefill_step_buffered, (1, 3))
        self.prefill_slots = sampled(prefill_step_slots, (1, 3))
        self.score = jit(score_step, (1,))

    def compilations(self) -> dict[str, int]:
        """Executables compiled so far per step kind (one per bucket)."""
        t = self.traces
        return dict(
            prefill=t.get("prefill_step", 0) + t.get("prefill_step_buffered", 0) + t.get("prefill_step_slots", 0),
            decode=t.get("decode_step_plain", 0) + t.get("decode_step", 0) + t.get("decode_forward", 0),
            score=t.get("score_step", 0),
        )

    @staticmethod
    def precompile(jobs: list[tuple], workers: int = 1) -> None:
        """Compiles each (jitted step, argument shapes[, static keyword arguments]) on `workers`
        threads. The shapes must be placed as the calls' arguments will be (`steps.shapes`), so
        the calls find them compiled. A bar counts the steps done (on a terminal)."""
        from freetoken_jax.progress import progress

        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool, progress(len(jobs), "compiling steps", unit="step") as bar:
            todo = [pool.submit(lambda job: job[0].lower(*job[1], **(job[2] if len(job) > 2 else {})).compile(), job) for job in jobs]
            for f in concurrent.futures.as_completed(todo):
                f.result()
                bar.update(1)


def state_shapes(cfg: MoEModelConfig, ecfg: EngineConfig, slots: int | None, dtype) -> DecodeState:
    """The shapes of a runner's decode state for `ecfg` (`slots` expert slots, or None), placed
    as the runner places its state (`steps.shapes`); nothing is allocated."""
    B = ecfg.max_batch
    state = jax.eval_shape(lambda: DecodeState(
        init_cache(cfg, ecfg, dtype), jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32),
        None if slots is None else init_slot_cache(cfg, slots, B, dtype), jnp.zeros((B, cfg.vocab_size), jnp.int32),
    ))  # fmt: skip
    return shapes(state, committed=True)


def table_widths(cfg: MoEModelConfig, ecfg: EngineConfig) -> tuple[int, int]:
    """(pages of a row's page table, pages of its ring; 0 without rings): the batches' table shapes."""
    return ecfg.pages_per_sequence, ring_pages(cfg, ecfg)


def decode_job(steps: StepSet, weights: Weights, experts: ExpertBackend, state: DecodeState, tables: tuple[int, int],
               filters: bool = False) -> tuple:  # fmt: skip
    """(decode step, its argument shapes) for a state of these shapes (`steps.shapes`) and
    batches of `tables` (`table_widths`); `filters`: the step that samples with top-k / top-p."""
    step = steps.decode_filtered if filters else steps.decode
    return step, (weights, state, DecodeBatch.shapes(state.tokens_B.shape[0], *tables), experts)


class ModelRunner:
    """Runs steps on the device state it owns. `rows` = `engine_config.max_batch` decode rows."""

    def __init__(
        self,
        model_config: MoEModelConfig,
        engine_config: EngineConfig,
        weights: Weights,
        experts: ExpertBackend,
        plan: MemoryPlan,
        steps: StepSet | None = None,
    ):
        self.model_config, self.engine_config, self.weights, self.experts, self.plan = model_config, engine_config, weights, experts, plan
        self.steps = steps or StepSet(engine_config.dtype)
        self.pages = PageAllocator(engine_config.total_kv_pages, engine_config.page_size)
        self.ring_pool = self._ring_pool(engine_config)
        self.state = self._fresh_state(engine_config, plan)
        self.logprobs: Logprobs | None = None  # the last `sample`'s (device arrays; None after `decode`)
        self._logits: jax.Array | None = None  # what the model half wrote its logits over (`decode_logits`)
        self.prompt_logprobs: Logprobs | None = None  # the last scored prefill chunk's (`prefill`)
        self.failed: str | None = None  # set when a resize failed and the old geometry could not be restored
        self._prefill_note: str | None = None
        self._set_rows = jax.jit(
            lambda st, rows, tok, pos: dataclasses.replace(
                st, tokens_B=st.tokens_B.at[rows].set(tok, mode="drop"), positions_B=st.positions_B.at[rows].set(pos, mode="drop")
            ),
            donate_argnums=(0,),
        )
        self._set_counts = jax.jit(lambda counts, rows, new: counts.at[rows].set(new, mode="drop"), donate_argnums=(0,))
        self._balance, self._balance_steps = self._balancer(experts), 0
        self._copy_pages = jax.jit(copy_pages, static_argnums=(1,), donate_argnums=(0,))

    def _ring_pool(self, ecfg: EngineConfig) -> PageAllocator | None:
        """The allocator of the sliding layers' ring pool (`kv_cache.ring_pages`), or None."""
        n = ring_pool_pages(self.model_config, ecfg)
        return PageAllocator(n, ecfg.page_size) if n else None

    @property
    def tables(self) -> tuple[int, int]:
        """`table_widths` of this runner's batches."""
        return table_widths(self.model_config, self.engine_config)

    def copy_ring_pages(self, src: list[int], dst: list[int]) -> None:
        """Copies pages of the ring pool (a cached prefix's window into a row's ring, or back),
        in stream order with the steps around it."""
        if not src:
            return
        n = -(-len(src) // 8) * 8  # few executables: padded with page 0 onto itself
        pad = [0] * (n - len(src))
        groups = ring_groups(self.model_config, self.engine_config, self.state.cache)
        cache = self._copy_pages(self.state.cache, groups, jnp.asarray(src + pad, jnp.int32), jnp.asarray(dst + pad, jnp.int32))
        self.state = dataclasses.replace(self.state, cache=cache)

    def _fresh_state(self, ecfg: EngineConfig, plan: MemoryPlan) -> DecodeState:
        cfg, dtype, B = self.model_config, jnp_dtype(ecfg.dtype), ecfg.max_batch
        slots = init_slot_cache(cfg, plan.slots, B, dtype) if self.experts.uses_slots else None
        # Committed to the device like every later version of it: one executable per step (`on_device`).
        return DecodeState.start(on_device(init_cache(cfg, ecfg, dtype)), np.zeros(B), np.zeros(B), slots, cfg.vocab_size)

    def reset_slots(self) -> None:
        """Empties the slot cache (a cold start for a measurement)."""
        if self.state.slots is not None:
            for a in jax.tree.leaves(self.state.slots):
                a.delete()
            cfg, ecfg = self.model_config, self.engine_config
            slots = on_device(init_slot_cache(cfg, self.plan.slots, ecfg.max_batch, jnp_dtype(ecfg.dtype)))
            self.state = dataclasses.replace(self.state, slots=slots)

    def close(self) -> None:
        """Frees the device state now (a runner that will not run again)."""
        for a in jax.tree.leaves(self.state):
            a.delete()

    @property
    def rows(self) -> int:
        return self.engine_config.max_batch

    @property
    def slots(self):
        """The expert slot cache (offload / hybrid), else None."""
        return self.state.slots

    def use(self, experts: ExpertBackend, *, over_slots: bool = False, balance: bool = True) -> None:
        """Runs later steps with `experts` (same slot geometry: a hybrid backend at another q, or
        offload over the same slots); the engine config follows (strategy, hybrid's q).
        `over_slots`: any backend may run over a state that has slots (a backend without them
        leaves them as they are: a measurement; `switch_to_slotless` frees them for good).
        `balance=False`: hybrid's q stays as given (a probe of that q)."""
        if experts.uses_slots != self.experts.uses_slots and not (over_slots and self.state.slots is not None):
            raise ValueError(f"{experts.strategy} and {self.experts.strategy} differ in whether they keep a slot cache")
        self.experts = experts
        ecfg = self.engine_config.replace(moe_strategy=experts.strategy)
        if experts.strategy is Strategy.HYBRID:
            ecfg = ecfg.replace(hybrid_q=float(experts.q))
        self.engine_config = ecfg
        self._balance = self._balancer(experts) if balance else None

    def _balancer(self, experts: ExpertBackend) -> QBalance | None:
        """Hybrid's q controller (`runtime/balance.py`) where the config asks for one."""
        if experts.strategy is Strategy.HYBRID and self.engine_config.hybrid_balance:
            return QBalance(float(experts.q))
        return None

    def _rebalance(self) -> None:
        """Every BALANCE_STEPS decode steps, moves hybrid's q (the step takes it as a traced
        argument: no new executable)."""
        if self._balance is None:
            return
        self._balance_steps += 1
        if self._balance_steps % BALANCE_STEPS:
            return
        q = self._balance.observe(_cpu_ext.handoff_stats(False))
        if q is not None:
            self.experts = self.experts.with_q(q)
            self.engine_config = self.engine_config.replace(hybrid_q=q)

    def switch_to_slotless(self, experts: ExpertBackend) -> None:
        """Runs later steps with `experts`, a backend without slots (cpu), and frees the slot cache:
        the state is rebuilt at the same KV pool without slots (`resize`; its pages start free)."""
        prev = (self.experts, self.engine_config)
        self.use(experts, over_slots=True)
        try:
            self.resize(kv_pages=self.pages.num_pages)
        except Exception:
            self.experts, self.engine_config = prev
            raise

    # Steps -------------------------------------------------------------------------------------------
    def _prefill_fn(self, tokens: int):
        """(jitted step, whether it takes the slot cache, the expert backend it runs with) for a
        prefill chunk of `tokens` (rows × length): the path the backend picks for the slot cache
        (`ExpertBackend.prefill_path`); without slots each layer's whole bank is streamed, or the
        backend's own way (`ExpertBackend.for_prefill`)."""
        slots, experts = self.state.slots, self.experts.for_prefill(self.model_config, tokens)
        path = "stream" if slots is None else experts.prefill_path(self.model_config, tokens, slots.num_slots)
        if path == "slots":
            return self.steps.prefill_slots, True, experts
        if path == "buffered":
            return self.steps.prefill_buffered, True, experts
        if slots is not None and self._prefill_note is None:
            E = self.model_config.num_experts
            self._prefill_note = f"prefill streams whole layers without double buffering: {slots.num_slots} slots < 2 x {E} experts"
            log.info(self._prefill_note)
        return self.steps.prefill, False, experts

    def prefill(self, batch: PrefillBatch) -> jax.Array:
        """One prefill chunk into the runner's KV (and slot) cache; returns each row's token after
        its last valid position in the chunk. A batch with targets leaves the chunk's
        `steps.chunk_logprobs` in `prompt_logprobs` (device arrays; None after a batch without)."""
        step, with_slots, experts = self._prefill_fn(batch.tokens_BT.size)
        st = self.state
        if with_slots:
            tok, cache, slots, *scored = step(self.weights, st.cache, batch, st.slots, experts)
        else:
            (tok, cache, *scored), slots = step(self.weights, st.cache, batch, experts), st.slots
        self.state = dataclasses.replace(st, cache=cache, slots=slots)
        self.prompt_logprobs = scored[0] if scored else None
        return tok

    def decode(self, batch: DecodeBatch, filters: bool = False) -> jax.Array:
        """One decode step over all rows (inactive rows masked), greedy or with a temperature, and
        with `filters` top-k and top-p too (a step that sorts the vocabulary); returns the tokens
        [rows]."""
        step = self.steps.decode_filtered if filters else self.steps.decode
        tok, self.state = step(self.weights, self.state, batch, self.experts)
        self.logprobs = None
        self._rebalance()
        return tok

    def decode_logits(self, batch: DecodeBatch) -> jax.Array:
        """The model half of a decode step (`StepSet`): the logits [rows, V], on the device. The
        next call must be `sample`, which leaves the step's `logprobs`; the logits stay valid until
        the next `decode_logits` (which writes its own over them: `decode_outputs`)."""
        args = (self.weights, self.state, batch, self.experts)
        if self.steps.donated:
            args += (self._logits_buffer(),)
        logits, self.state = self.steps.decode_logits(*args)
        self._logits = logits if self.steps.donated else None
        self._rebalance()
        return logits

    def _logits_buffer(self) -> jax.Array:
        """The buffer the model half writes its logits over: the last step's, or a new one."""
        shape = (self.rows, self.model_config.vocab_size)
        if self._logits is None or self._logits.shape != shape or self._logits.is_deleted():
            self._logits = on_device(jnp.zeros(shape, jnp.float32))
        return self._logits

    def sample(self, logits, batch: DecodeBatch, mask_BW, logprobs: bool = False) -> jax.Array:
        """The sampling half of the decode step whose `logits` these are, under the grammar
        bitmask `mask_BW` [rows, ceil(V / 32)]; returns the tokens [rows] (and with `logprobs`
        leaves their `Logprobs` in `logprobs`)."""
        st = self.state
        tok, tokens, positions, counts, self.logprobs = self.steps.sample(logits, st.tokens_B, st.positions_B, st.counts_BV, batch, mask_BW,
                                                                          logprobs=logprobs)  # fmt: skip
        self.state = dataclasses.replace(st, tokens_B=tokens, positions_B=positions, counts_BV=counts)
        return tok

    def set_counts(self, rows: list[int], prompts: list[list[int]]) -> None:
        """Resets the token counts of decode rows `rows` for requests about to sample their first
        token after `prompts` (the repetition penalty covers the prompt)."""
        V = self.model_config.vocab_size
        new = np.stack([prompt_counts(p, V) for p in prompts])
        self.state = dataclasses.replace(self.state, counts_BV=self._set_counts(self.state.counts_BV, jnp.asarray(rows, jnp.int32), new))

    def set_rows(self, rows: np.ndarray, tokens_R, positions_R) -> None:
        """Sets the next input token and position of decode rows `rows` (entries ≥ `rows` are
        ignored: padding)."""
        self.state = self._set_rows(self.state, jnp.asarray(rows, jnp.int32), tokens_R, jnp.asarray(positions_R, jnp.int32))

    def score(self, batch: PrefillBatch) -> jax.Array:
        """Float32 logits [B, T, V] of a chunk; its K/V is written to the cache like a prefill's."""
        logits, cache = self.steps.score(
            self.weights, self.state.cache, batch, self.experts.for_prefill(self.model_config, batch.tokens_BT.size)
        )
        self.state = dataclasses.replace(self.state, cache=cache)
        return logits

    def score_prompt(self, ids: list[int]) -> np.ndarray:
        """Float32 logits at every position of `ids`, chunk by chunk: [len(ids), V]."""
        P, R = self.tables
        pages, ring = self.pages.allocate(len(ids)), []
        try:
            if R:
                ring = self.ring_pool.allocate(min(R, len(pages)) * self.engine_config.page_size)
            table, ring_table = np.zeros((1, P), np.int32), np.zeros((1, R), np.int32) if R else None
            table[0, : len(pages)] = pages
            if R:
                ring_table[0, : len(ring)] = ring
            out, start = [], 0
            while start < len(ids):
                T = buckets.chunk_bucket(len(ids) - start, self.engine_config.chunk)
                seg = ids[start : start + T]
                batch = PrefillBatch.chunk([seg], [start], table, T, Sampling.greedy(1), ring_table)
                out.append(np.asarray(self.score(batch))[0, : len(seg)])
                start += T
            return np.concatenate(out, axis=0)
        finally:
            self.pages.release(pages)
            if ring:
                self.ring_pool.release(ring)

    # Ahead-of-time compiles ------------------------------------------------------------------------
    def decode_job(self, state: DecodeState | None = None, filters: bool = False) -> tuple:
        """(decode step, argument shapes) placed as the calls place them; `state`: the shapes of
        another geometry's state; `filters`: the step with top-k / top-p."""
        st = state or shapes(self.state, committed=True)
        return decode_job(self.steps, self.weights, self.experts, st, self.tables, filters)

    def sample_jobs(self) -> list[tuple]:
        """(step, argument shapes[, static arguments]) of the decode step's two halves (rows
        asking for penalties, log-probabilities or a grammar), the sampling half with and without
        log-probabilities."""
        st, B = shapes(self.state, committed=True), self.rows
        batch = DecodeBatch.shapes(B, *self.tables)
        logits = jax.ShapeDtypeStruct((B, self.model_config.vocab_size), jnp.float32, sharding=st.tokens_B.sharding)
        mask = jax.ShapeDtypeStruct((B, (self.model_config.vocab_size + 31) // 32), jnp.int32)
        args = (logits, st.tokens_B, st.positions_B, st.counts_BV, batch, mask)
        model = (self.weights, st, batch, self.experts) + ((logits,) if self.steps.donated else ())
        return [(self.steps.decode_logits, model), (self.steps.sample, args, {"logprobs": False}),
                (self.steps.sample, args, {"logprobs": True})]  # fmt: skip

    def prefill_jobs(self, chunks: list[int], rows: int = 1, scored: bool = False) -> list[tuple]:
        """(prefill step, argument shapes) of a chunk of `rows` × T tokens for each T in `chunks`;
        `scored`: of a chunk that scores its prompt (`PrefillBatch.targets_BT`)."""
        st, jobs = shapes(self.state, committed=True), []
        for T in chunks:
            step, with_slots, experts = self._prefill_fn(rows * T)
            args = (self.weights, st.cache, PrefillBatch.shapes(rows, T, *self.tables, scored=scored))
            jobs.append((step, args + ((st.slots, experts) if with_slots else (experts,))))
        return jobs

    def prompt_jobs(self, prompt_len: int, filters: bool = False) -> list[tuple]:
        """The steps one prompt of `prompt_len` tokens runs: its prefill chunks and the decode step
        (with `filters`, the one that samples with top-k / top-p)."""
        Ts, left = set(), prompt_len
        while left > 0:
            T = buckets.chunk_bucket(left, self.engine_config.chunk)
            Ts.add(T)
            left -= T
        return [self.decode_job(filters=filters), *self.prefill_jobs(sorted(Ts))]

    def chunk_buckets(self) -> list[int]:
        chunk = self.engine_config.chunk
        return sorted({buckets.chunk_bucket(n, chunk) for n in range(1, chunk + 1)})

    def warm_up(self, workers: int = 4, prefill_rows: int = 1, scoring: bool = False) -> dict:
        """Compiles the decode steps (with and without top-k / top-p, and in two halves) and the
        prefill step of every chunk bucket before any request arrives (on `workers` threads), and
        with `scoring` the prefill steps that score a prompt (`GenerationParams.prompt_logprobs`);
        returns {"steps": n, "seconds": s}."""
        t0 = time.perf_counter()
        jobs = [
            self.decode_job(),
            self.decode_job(filters=True),
            *self.sample_jobs(),
            *self.prefill_jobs(self.chunk_buckets(), prefill_rows),
            *(self.prefill_jobs(self.chunk_buckets(), prefill_rows, scored=True) if scoring else []),
        ]
        log.info("warm-up: compiling %d steps on %d threads", len(jobs), workers)
        self.steps.precompile(jobs, workers)
        if self.steps.donated:
            _copy_tokens.lower(self.state.tokens_B).compile()  # the decode steps' token copy (`_TokenCopied`)
        out = dict(steps=len(jobs), seconds=time.perf_counter() - t0)
        log.info("warm-up: %d steps compiled in %.1f s", out["steps"], out["seconds"])
        return out

    # Elastic resize --------------------------------------------------------------------------------
    def status(self) -> dict:
        ecfg = self.engine_config
        return dict(
            moe_strategy=ecfg.moe_strategy.value,
            expert_slots=self.plan.slots if ecfg.uses_slots else None,
            kv_pages=self.pages.num_pages,
            kv_pages_free=self.pages.free_pages,
            ring_pages=self.ring_pool.num_pages if self.ring_pool else 0,
            ring_pages_free=self.ring_pool.free_pages if self.ring_pool else 0,
            plan=self.plan.describe(),
            failed=self.failed,
        )

    def prepare_resize(self, expert_slots: int | None = None, kv_pages: int | None = None) -> tuple:
        """Validates a new geometry and compiles its decode step without touching the current one
        (safe beside running steps): what `resize(prepared=...)` then applies without that wait."""
        return (self.engine_config, *self._validate(expert_slots, kv_pages))

    def resize(self, expert_slots: int | None = None, kv_pages: int | None = None, *, keep_held_pages: bool = False,
               prepared: tuple | None = None) -> bool:  # fmt: skip
        """Resizes the expert slots and/or the KV page pool; the caller makes sure no row runs.
        With `keep_held_pages` the pages still allocated (a prefix cache's) keep their contents
        when the pool grows. Returns whether they were kept (else every page is free again).
        `prepared`: `prepare_resize`'s answer for the same sizes (validated again if the geometry
        has changed since)."""
        if self.failed:
            raise RebuildFailed(self.failed)
        if prepared is not None and prepared[0] is self.engine_config:
            new, plan = prepared[1:]
        else:
            new, plan = self._validate(expert_slots, kv_pages)  # nothing touched yet
        prev = (self.engine_config, self.plan)
        try:
            return self._allocate(new, plan, keep_held_pages)
        except Exception as e:  # noqa: BLE001 - roll back whatever went wrong
            try:
                self._allocate(*prev, keep_held_pages=False)
            except Exception as e2:  # noqa: BLE001
                self.failed = f"rebuild failed ({e}) and restoring the previous geometry failed too ({e2}); restart the server"
                raise RebuildFailed(self.failed) from e2
            raise RebuildFailed(
                f"rebuild to {dataclasses.asdict(new)} failed ({type(e).__name__}: {e}); the previous geometry was restored"
            ) from e

    def _validate(self, expert_slots, kv_pages) -> tuple[EngineConfig, MemoryPlan]:
        ecfg = self.engine_config
        if expert_slots is None and kv_pages is None:
            raise ConfigError("give expert_slots and/or kv_pages")
        if expert_slots is not None:
            if not ecfg.uses_slots:
                raise ConfigError(f"strategy {ecfg.moe_strategy.value!r} has no expert slots to resize (only 'offload' and 'hybrid' do)")
            if not isinstance(expert_slots, int) or isinstance(expert_slots, bool) or expert_slots <= 0:
                raise ConfigError(f"expert_slots must be a positive integer, got {expert_slots!r}")
        if kv_pages is not None:
            if not isinstance(kv_pages, int) or isinstance(kv_pages, bool) or kv_pages < 2:
                raise ConfigError(f"kv_pages must be an integer of at least 2 (page 0 is reserved), got {kv_pages!r}")
            need = self.pages.pages_for(ecfg.max_context)
            if kv_pages - 1 < need:
                raise ConfigError(
                    f"kv_pages={kv_pages} cannot hold one full-length sequence ({need} pages of {ecfg.page_size} tokens + the reserved page)"
                )
        new = ecfg.replace(
            kv_pages=kv_pages if kv_pages is not None else self.pages.num_pages,
            expert_slots=expert_slots if expert_slots is not None else (self.plan.slots if ecfg.uses_slots else None),
            expert_slots_gb=None,
            initial_expert_capacity=None,
        )
        itemsize = jnp.dtype(jnp_dtype(new.dtype)).itemsize
        cfg = self.model_config
        device = device_memory_bytes()
        plan = plan_memory(cfg, new, self.plan.dense_bytes, cache_bytes(cfg, new, itemsize), itemsize, device)
        if device is None and new.total_vram_gb is None:  # the CPU backend: the caches are host RAM
            grow = plan.kv_bytes + plan.slot_bytes - (self.plan.kv_bytes + self.plan.slot_bytes)
            avail = host_memory_available()
            if avail is not None and grow > avail // 2:
                raise ConfigError(
                    f"the new KV pages and slots need {size(grow)} more memory; only {size(avail)} is available "
                    "(at most half of it is taken)"
                )
        try:
            self._compile_check(new, plan)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a geometry that does not compile is refused, untouched
            raise ConfigError(f"the new geometry failed to compile: {type(e).__name__}: {e}") from e
        return new, plan

    def _compile_check(self, new: EngineConfig, plan: MemoryPlan) -> None:
        """Compiles the new geometry's decode step (through the same jitted step, with the
        arguments placed as later calls place them, so the first step after the resize finds it
        compiled) and checks its memory against the device."""
        cfg, dtype = self.model_config, jnp_dtype(new.dtype)
        state = state_shapes(cfg, new, plan.slots if new.uses_slots else None, dtype)
        step, args = self.decode_job(state)
        compiled = step.lower(*args).compile()
        limit = device_memory_bytes()
        ma = compiled.memory_analysis() if limit else None
        if ma is not None:
            in_use = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0)
            old = sum(x.nbytes for x in jax.tree.leaves((self.state.cache, self.state.slots)))
            need = cache_bytes(cfg, new, jnp.dtype(dtype).itemsize) + plan.slot_bytes * new.uses_slots
            need += getattr(ma, "temp_size_in_bytes", 0)
            if in_use - old + need > limit:
                raise ConfigError(
                    f"the new geometry needs {need / 2**30:.2f} GiB; after freeing the old one only {(limit - in_use + old) / 2**30:.2f} GiB would be free"
                )

    def _allocate(self, new: EngineConfig, plan: MemoryPlan, keep_held_pages: bool) -> bool:
        """Frees the old pool and slots and builds the new ones (the destructive phase)."""
        cfg, dtype, old = self.model_config, jnp_dtype(new.dtype), self.state
        keep = keep_held_pages and new.total_kv_pages >= self.pages.num_pages
        if keep:  # the ring pool's size does not change with the shared pool's
            kv = grown_cache(old.cache, cfg, new)
            pages, ring_pool = self.pages.grown(new.total_kv_pages), self.ring_pool
        else:
            for a in jax.tree.leaves(old.cache):
                a.delete()
            kv = on_device(init_cache(cfg, new, dtype))
            pages, ring_pool = PageAllocator(new.total_kv_pages, new.page_size), self._ring_pool(new)
        if old.slots is not None:
            for a in jax.tree.leaves(old.slots):
                a.delete()
        slots = init_slot_cache(cfg, plan.slots, new.max_batch, dtype) if new.uses_slots else None
        old.counts_BV.delete()
        self.state = DecodeState.start(kv, np.zeros(new.max_batch), np.zeros(new.max_batch), slots, cfg.vocab_size)
        self.pages, self.ring_pool, self.engine_config, self.plan = pages, ring_pool, new, plan
        return keep
