"""FreeTokenEngine: owns the weights, the paged KV cache and the jitted steps; generates tokens.

Flow of one `generate_batch` call: validate every request (nothing is allocated for a bad one);
take KV pages for prompt + max_new_tokens of each row; prefill the prompts chunk by chunk
(every row's first token is sampled by the chunk that holds its last prompt token); then decode
one token per step for all rows, one step ahead of the host so the device never waits for the
host to read tokens; finally give the pages back. Executables are keyed by buckets of batch
size, chunk length and page-table width.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.config import ConfigError, EngineConfig, MoEModelConfig
from freetoken_jax.memory.budget import GB, device_memory_bytes, host_memory_available, plan_memory
from freetoken_jax.memory.expert_cache import init_slot_cache
from freetoken_jax.memory.kv_pages import PageAllocator
from freetoken_jax.models import abstract_graphdef, build_abstract, is_expert_path, jnp_dtype, random_params
from freetoken_jax.runtime import buckets
from freetoken_jax.runtime.handoff import resolve_mode
from freetoken_jax.runtime.kv_cache import cache_bytes, init_cache
from freetoken_jax.runtime.offload import host_bank_placer, host_bank_views, slot_prefill_pays, to_host_banks
from freetoken_jax.runtime.steps import (
    DecodeBatch,
    DecodeState,
    PrefillBatch,
    Sampling,
    Weights,
    decode_step,
    on_device,
    prefill_step,
    prefill_step_buffered,
    prefill_step_slots,
    score_step,
)

log = logging.getLogger("freetoken_jax")


class RequestError(ValueError):
    """A request that cannot be served as given; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


def _resolve_auto(cfg: MoEModelConfig, ecfg: EngineConfig, dense: int, kv: int, itemsize: int) -> tuple[EngineConfig, str]:
    """fused when everything fits; else a matching benchbw.json's recommendation; else offload."""
    from freetoken_jax.bench.bw import load_profile

    try:
        plan_memory(cfg, ecfg.replace(moe_strategy="fused"), dense, kv, itemsize, device_memory_bytes())
        return ecfg.replace(moe_strategy="fused"), "every expert fits the device budget"
    except ConfigError:
        pass
    prof = load_profile()
    if prof is not None:
        rec = prof["recommendation"]
        strategy = rec["strategy"] if rec["strategy"] in ("offload", "hybrid") else "offload"
        q = rec.get("q")
        new = ecfg.replace(moe_strategy=strategy, hybrid_q=float(q) if q is not None else ecfg.hybrid_q)
        fig = prof.get("figures") or {}
        us, link = fig.get("handoff_ffi_us"), fig.get("contended_fetch_gb_s", fig.get("fetch_gb_s"))
        if isinstance(us, (int, float)) and isinstance(link, (int, float)) and us > 0 and link > 0:
            # the handoff's measured cost in units of one expert's PCIe fetch time
            new = new.replace(hybrid_overhead=us * 1e-6 / (cfg.expert_params * itemsize / (link * 1e9)))
        return new, f"the experts do not fit; benchbw.json recommends {strategy} ({rec.get('reason', '')})"
    return ecfg.replace(
        moe_strategy="offload"
    ), "the experts do not fit and no benchbw.json was measured here: offload (hybrid only on evidence)"


def _traced(step, dtype: str, traces: dict[str, int]):
    """A fresh function object per engine (jit caches executables per function object), traced
    with full-precision float32 matmuls when the model runs in float32 (GPUs otherwise use
    reduced-precision passes for float32 dots). `traces` counts how often each step is traced,
    which is how often it is compiled."""

    @functools.wraps(step)
    def run(*args):
        traces[step.__name__] = traces.get(step.__name__, 0) + 1
        if dtype == "float32":
            with jax.default_matmul_precision("highest"):
                return step(*args)
        return step(*args)

    return run


def sampling_rows(ps: Sequence[GenerationParams | None]) -> Sampling:
    """Per-row sampling arrays; rows without a request (None) are greedy."""
    ps = [p or GenerationParams() for p in ps]
    return Sampling(
        jnp.asarray([p.seed for p in ps], jnp.uint32),
        jnp.asarray([p.temperature for p in ps], jnp.float32),
        jnp.asarray([p.top_k for p in ps], jnp.int32),
        jnp.asarray([p.top_p for p in ps], jnp.float32),
    )


def _fresh_metrics() -> dict:
    return dict(requests=0, prompt_tokens=0, generated_tokens=0, decode_steps=0, prefill_seconds=0.0, decode_seconds=0.0)


class FreeTokenEngine:
    """Generates tokens from an MoE model.

    `FreeTokenEngine(model_config, engine_config)` builds seeded random weights;
    `FreeTokenEngine.from_pretrained(path | "demo")` loads a checkpoint.
    """

    def __init__(
        self,
        model_config: MoEModelConfig,
        engine_config: EngineConfig | None = None,
        *,
        params=None,
        load=None,
        tokenizer=None,
        name: str = "random",
    ):
        """`params`: a parameter state to use; `load(place)`: a loader to call once the memory plan
        is accepted; neither: seeded random weights (`EngineConfig.seed`)."""
        ecfg = engine_config or EngineConfig()
        cfg = model_config
        self.model_config, self.engine_config, self.tokenizer, self.name = cfg, ecfg, tokenizer, name
        self.model_path: str | None = None  # the checkpoint directory, when loaded from one
        dtype = jnp_dtype(ecfg.dtype)
        itemsize = jnp.dtype(dtype).itemsize
        dense = sum(
            math.prod(v.get_value().shape) * v.get_value().dtype.itemsize
            for p, v in build_abstract(cfg, ecfg.dtype).flat_state()
            if not is_expert_path(p)
        )
        self.strategy_reason = f"moe_strategy={ecfg.moe_strategy!r} was asked for"
        probe = False  # set when "auto" picks hybrid from a profile: checked by a decode probe
        if ecfg.moe_strategy == "auto":
            ecfg, self.strategy_reason = _resolve_auto(cfg, ecfg, dense, cache_bytes(cfg, ecfg, itemsize), itemsize)
            self.engine_config = ecfg
            probe = ecfg.moe_strategy == "hybrid" and ecfg.auto_probe_steps > 0 and ecfg.max_context >= 4
            log.info("moe_strategy auto -> %s: %s", ecfg.moe_strategy, self.strategy_reason)
        self.plan = plan_memory(cfg, ecfg, dense, cache_bytes(cfg, ecfg, itemsize), itemsize, device_memory_bytes())
        log.info("memory plan: %s", self.plan.describe())
        offload = ecfg.uses_slots
        place = None
        if ecfg.moe_strategy in ("offload", "hybrid", "cpu"):
            avail = host_memory_available()
            if avail is not None and self.plan.all_experts_bytes > avail:
                raise ConfigError(
                    f"the expert banks need {self.plan.all_experts_bytes / GB:.1f} GiB of host RAM but only {avail / GB:.1f} GiB is available"
                )
            place = host_bank_placer()
        graphdef, _ = abstract_graphdef(cfg, ecfg.dtype)
        if params is None:
            params = load(place) if load is not None else random_params(cfg, ecfg.dtype, ecfg.seed, place)
        elif ecfg.moe_strategy in ("offload", "hybrid", "cpu"):
            params = to_host_banks(params)
        host = host_bank_views(params) if ecfg.moe_strategy in ("cpu", "hybrid") else None
        hybrid_q = jnp.float32(ecfg.hybrid_q) if ecfg.moe_strategy == "hybrid" else None
        self.weights = Weights(
            params, graphdef, ecfg.moe_strategy, host, hybrid_q, resolve_mode(ecfg.cpu_handoff), ecfg.hybrid_overhead, ecfg.prefill_load
        )
        # Committed to the device like every later version of them: one executable per step (`on_device`).
        self.cache = on_device(init_cache(cfg, ecfg, dtype))
        self.slots = on_device(init_slot_cache(cfg, self.plan.slots, ecfg.max_batch, dtype)) if offload else None
        self.pages = PageAllocator(ecfg.total_kv_pages, ecfg.page_size)
        self._traces: dict[str, int] = {}
        self._prefill = jax.jit(_traced(prefill_step, ecfg.dtype, self._traces), donate_argnums=(1,))
        self._prefill_buffered = jax.jit(_traced(prefill_step_buffered, ecfg.dtype, self._traces), donate_argnums=(1, 3))
        self._prefill_slots = jax.jit(_traced(prefill_step_slots, ecfg.dtype, self._traces), donate_argnums=(1, 3))
        self._prefill_note = None
        self.failed: str | None = None  # set when a resize failed and the old geometry could not be restored
        self._score = jax.jit(_traced(score_step, ecfg.dtype, self._traces), donate_argnums=(1,))
        # The jitted steps a serving loop drives: `decode(weights, state, batch)` -> (tokens, state);
        # prefill through `prefill` (one chunk, any strategy) and `prefill_chunks`.
        self.decode = jax.jit(_traced(decode_step, ecfg.dtype, self._traces), donate_argnums=(1,))
        self._pick = jax.jit(lambda ends, tok, first: jnp.where(ends, tok, first))
        self._m = _fresh_metrics()
        if probe:
            self._check_hybrid_choice(ecfg.auto_probe_steps)

    def _decode_rate(self, steps: int) -> float:
        """Decode tokens/s of the current weights over `steps` steps (batch 1, sampled, after one
        step that may compile)."""
        V, ctx = self.model_config.vocab_size, self.engine_config.max_context
        prompt = [int(t) for t in np.random.default_rng(self.engine_config.seed).integers(0, V, max(1, min(8, ctx - 3)))]
        steps = max(1, min(steps, ctx - len(prompt) - 2))
        tokens = self.generate(prompt, max_new_tokens=steps + 2, temperature=1.0, seed=1, ignore_eos=True)
        next(tokens), next(tokens)  # prefill, then the first decode step (compiles)
        t0 = time.perf_counter()
        n = sum(1 for _ in tokens)
        return n / max(time.perf_counter() - t0, 1e-9)

    def _check_hybrid_choice(self, steps: int) -> None:
        """Measures hybrid at the recommended q and at q + each of `auto_probe_q_offsets` (one
        executable: q is traced), keeps the fastest q, and keeps "hybrid" only if it then decodes
        at least as fast as "offload" here."""
        hybrid, q0 = self.weights, self.engine_config.hybrid_q
        rates: dict[float, float] = {}
        for d in (0.0, *self.engine_config.auto_probe_q_offsets):
            q = round(min(1.0, max(0.0, q0 + d)), 6)
            if q not in rates:
                self.weights = dataclasses.replace(hybrid, hybrid_q=jnp.float32(q))
                rates[q] = self._decode_rate(steps)
        q = max(rates, key=lambda k: (rates[k], k == q0))  # ties keep the recommendation
        h, hybrid = rates[q], dataclasses.replace(hybrid, hybrid_q=jnp.float32(q))
        self.weights = dataclasses.replace(hybrid, strategy="offload", host_banks=None, hybrid_q=None)
        o = self._decode_rate(steps)
        if len(rates) > 1:
            tried = ", ".join(f"{k:g}: {v:.1f}" for k, v in sorted(rates.items()))
            self.strategy_reason += f"; q probe (tok/s at q {tried}): q = {q:g}"
        if h >= o:
            self.weights = hybrid
            self.engine_config = self.engine_config.replace(hybrid_q=q)
            self.strategy_reason += f"; decode probe: hybrid {h:.1f} tok/s >= offload {o:.1f} tok/s"
        else:
            self.engine_config = self.engine_config.replace(moe_strategy="offload")
            self.strategy_reason += f"; but the decode probe measured hybrid {h:.1f} tok/s < offload {o:.1f} tok/s: offload"
        log.info("moe_strategy auto: %s", self.strategy_reason)
        self._m = _fresh_metrics()  # the probe's requests are not the user's

    # Construction ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, engine_config: EngineConfig | None = None, *, verify: bool = False
    ) -> FreeTokenEngine:
        """Loads an FTW directory, a Hugging Face safetensors directory of a supported family, an
        engine-native directory, or `"demo"` (the built-in demo model, created locally on first
        use). `verify` checks every FTW tensor's checksum while loading."""
        from freetoken_jax.checkpoint.convert import load_ftw
        from freetoken_jax.checkpoint.ftw import FTWReader, is_ftw
        from freetoken_jax.checkpoint.hf import load_params
        from freetoken_jax.models.generic import config_from_json
        from freetoken_jax.models.registry import family_for
        from freetoken_jax.tokenizer import load_tokenizer

        path = os.fspath(path)
        if path == "demo":
            from freetoken_jax.demo import demo_path

            path = demo_path()
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no checkpoint directory at {path!r} (pass a directory with config.json, or 'demo')")
        ecfg = engine_config or EngineConfig()
        name = os.path.basename(os.path.normpath(path))
        if is_ftw(path):
            with FTWReader(path) as r:
                cfg = config_from_json(r.index.get("model_config") or {})
            load = lambda place: load_ftw(path, ecfg.dtype, place, verify=verify)[1]  # noqa: E731
            engine = cls(cfg, ecfg, load=load, tokenizer=load_tokenizer(path), name=name)
            engine.model_path = path
            return engine
        try:
            with open(os.path.join(path, "config.json")) as f:
                raw = json.load(f)
        except FileNotFoundError as e:
            raise ConfigError(f"{path} has no config.json") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}/config.json is not valid JSON: {e}") from e
        family = family_for(raw)
        cfg = family.parse(raw)
        load = functools.partial(load_params, path, cfg, family, ecfg.dtype)
        engine = cls(cfg, ecfg, load=load, tokenizer=load_tokenizer(path), name=name)
        engine.model_path = path
        return engine

    def export_orbax(self, path: str) -> str:
        """Writes the parameters as an Orbax checkpoint (for JAX users who fine-tune);
        `python -m freetoken_jax.convert` turns it back into FTW."""
        from freetoken_jax.checkpoint.convert import export_orbax

        return export_orbax(self.model_config, self.weights.params, path)

    # Validation -----------------------------------------------------------------------------------
    def check_request(self, prompt: Sequence[int], p: GenerationParams) -> list[int]:
        if self.failed:
            raise RequestError(f"the engine is in a failed state: {self.failed}")
        ids = [int(t) for t in prompt]
        V = self.model_config.vocab_size
        if not ids:
            raise RequestError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise RequestError(f"token ids out of range [0, {V}): {bad[:8]}")
        if p.max_new_tokens <= 0:
            raise RequestError(f"max_new_tokens must be at least 1, got {p.max_new_tokens}")
        total = len(ids) + p.max_new_tokens
        if total > self.engine_config.max_context:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({p.max_new_tokens}) = {total} exceeds the configured "
                f"context of {self.engine_config.max_context} tokens (EngineConfig.max_context)"
            )
        if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < 0:
            raise RequestError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        return ids

    # Generation -----------------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
    ) -> Iterator[int]:
        """Yields the generated token ids one by one as they are produced (the stop token, if
        one ends the generation, is yielded last)."""
        p = GenerationParams(max_new_tokens, temperature, top_k, top_p, seed, tuple(stop_token_ids), ignore_eos)
        ids = self.check_request(prompt_ids, p)
        for _, tok in self._run([ids], [p]):
            yield tok

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
    ) -> list[list[int]]:
        """Generates for several prompts together (in groups of at most `max_batch`); row i is
        seeded with `seed + i`."""
        ps = [
            GenerationParams(max_new_tokens, temperature, top_k, top_p, seed + i, tuple(stop_token_ids), ignore_eos)
            for i in range(len(prompts))
        ]
        checked = [self.check_request(pr, p) for pr, p in zip(prompts, ps)]
        out: list[list[int]] = [[] for _ in prompts]
        mb = self.engine_config.max_batch
        for start in range(0, len(checked), mb):
            for row, tok in self._run(checked[start : start + mb], ps[start : start + mb]):
                out[start + row].append(tok)
        return out

    def page_table(self, rows: list[list[int]], B: int) -> tuple[np.ndarray, int]:
        """The [B, P] page table of `rows` (each a sequence's KV pages; rows past them zero), P
        bucketed so that other lengths reuse the executables; returns (table, P)."""
        ecfg = self.engine_config
        P = buckets.pages_bucket(max(len(r) for r in rows), ecfg.pages_per_sequence)
        table = np.zeros((B, P), np.int32)
        for b, r in enumerate(rows):
            table[b, : len(r)] = r
        return table, P

    def prefill(self, weights: Weights, cache, batch: PrefillBatch, slots):
        """One prefill chunk; returns (tokens, KV cache, slot cache). Under "offload"/"hybrid" a
        short chunk goes through the slot cache as decode does (`slot_prefill_pays`); a longer one
        through two borrowed layer buffers of the slot cache when it has 2 × num_experts slots,
        otherwise (logged once) with each layer's whole bank streamed to the device."""
        step = self.prefill_step_for(weights, batch.tokens_BT.size, slots)
        if step is not self._prefill:
            return step(weights, cache, batch, slots)
        tok, cache = step(weights, cache, batch)
        return tok, cache, slots

    def prefill_step_for(self, weights: Weights, tokens: int, slots):
        """The jitted step `prefill` runs for a chunk of `tokens` (rows × length): `_prefill`
        (weights, cache, batch), or one that also takes and returns the slot cache."""
        E = self.model_config.num_experts
        if slots is not None and weights.strategy in ("offload", "hybrid"):
            if slot_prefill_pays(self.model_config, tokens, slots.num_slots):
                return self._prefill_slots
            if slots.num_slots >= 2 * E:
                return self._prefill_buffered
            if self._prefill_note is None:
                self._prefill_note = f"prefill streams whole layers without double buffering: {slots.num_slots} slots < 2 x {E} experts"
                log.info(self._prefill_note)
        return self._prefill

    def _prefill_held(self, weights: Weights, cache, batch: PrefillBatch):
        """`prefill` with the engine's own slot cache (held by the engine between requests)."""
        tok, cache, self.slots = self.prefill(weights, cache, batch, self.slots)
        return tok, cache

    def prefill_chunks(self, prompts: list[list[int]], table: np.ndarray, sampling: Sampling, step_fn, chunk: int | None = None):
        """Runs `step_fn` over the prompts chunk by chunk (`prefill_chunk` tokens unless `chunk`);
        yields (chunk start, T, output)."""
        B = table.shape[0]
        longest = max(len(p) for p in prompts)
        start = 0
        while start < longest:
            T = buckets.chunk_bucket(longest - start, chunk or self.engine_config.prefill_chunk)
            tok = np.zeros((B, T), np.int32)
            valid = np.zeros((B, T), bool)
            for b, p in enumerate(prompts):
                seg = p[start : start + T]
                tok[b, : len(seg)] = seg
                valid[b, : len(seg)] = True
            pos = np.broadcast_to(np.arange(start, start + T, dtype=np.int32), (B, T))
            batch = PrefillBatch(jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(valid), jnp.asarray(table), sampling)
            out, self.cache = step_fn(self.weights, self.cache, batch)
            yield start, T, out
            start += T

    def _run(self, prompts: list[list[int]], ps: list[GenerationParams]) -> Iterator[tuple[int, int]]:
        ecfg, n = self.engine_config, len(prompts)
        B = buckets.batch_bucket(n, ecfg.max_batch)
        need = [len(p) + q.max_new_tokens for p, q in zip(prompts, ps)]
        if sum(self.pages.pages_for(t) for t in need) > self.pages.free_pages:
            raise RequestError(
                f"the KV cache has {self.pages.free_pages} free pages; this batch needs {sum(self.pages.pages_for(t) for t in need)}"
            )
        rows = [self.pages.allocate(t) for t in need]
        try:
            self._m["requests"] += n
            self._m["prompt_tokens"] += sum(map(len, prompts))
            table, _ = self.page_table(rows, B)
            sampling = sampling_rows(list(ps) + [None] * (B - n))
            t0 = time.perf_counter()
            first = jnp.zeros((B,), jnp.int32)
            for start, T, tok in self.prefill_chunks(prompts, table, sampling, self._prefill_held):
                ends = np.array([start < len(p) <= start + T for p in prompts] + [False] * (B - n))
                first = self._pick(jnp.asarray(ends), tok, first)
            lengths = np.array([len(p) for p in prompts] + [0] * (B - n), np.int32)
            active = np.array([True] * n + [False] * (B - n))
            state = DecodeState.start(self.cache, jnp.copy(first), lengths, self.slots)
            self.cache = self.slots = None  # owned by `state` until the loop ends
            stops = [set(q.stop_token_ids) | (set() if q.ignore_eos else set(self.model_config.eos_token_ids)) for q in ps]
            produced = [0] * n
            pending = first
            jax.block_until_ready(pending)
            self._m["prefill_seconds"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            while True:
                nxt = None
                if active.any() and max(produced[b] + 1 for b in range(n) if active[b]) < max(q.max_new_tokens for q in ps):
                    nxt, state = self.decode(self.weights, state, DecodeBatch(jnp.asarray(table), jnp.asarray(active), sampling))
                    self._m["decode_steps"] += 1
                toks = np.asarray(pending)
                for b in range(n):
                    if not active[b]:
                        continue
                    produced[b] += 1
                    self._m["generated_tokens"] += 1
                    yield b, int(toks[b])
                    if int(toks[b]) in stops[b] or produced[b] >= ps[b].max_new_tokens:
                        active[b] = False
                if nxt is None:
                    break
                pending = nxt
            self.cache, self.slots = state.cache, state.experts
            self._m["decode_seconds"] += time.perf_counter() - t0
        finally:
            if self.cache is None:  # the generator was closed mid-way: recover the caches
                self.cache, self.slots = state.cache, state.experts
            for r in rows:
                self.pages.release(r)

    # Scoring --------------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Float32 logits at every position of `token_ids`: `[len(token_ids), vocab]`."""
        ids = self.check_request(token_ids, GenerationParams(max_new_tokens=1))
        rows = [self.pages.allocate(len(ids))]
        try:
            table, _ = self.page_table(rows, 1)
            out = [
                np.asarray(lg)[0, : max(0, min(T, len(ids) - start))]
                for start, T, lg in self.prefill_chunks([ids], table, Sampling.greedy(1), self._score)
            ]
            return np.concatenate(out, axis=0)
        finally:
            self.pages.release(rows[0])

    # Telemetry ------------------------------------------------------------------------------------
    def compilations(self) -> dict[str, int]:
        """Executables compiled so far per step kind (one per bucket)."""
        t = self._traces
        return dict(
            prefill=t.get("prefill_step", 0) + t.get("prefill_step_buffered", 0) + t.get("prefill_step_slots", 0),
            decode=t.get("decode_step", 0),
            score=t.get("score_step", 0),
        )

    def rebuild_runtime_cache(self, expert_slots: int | None = None, kv_pages: int | None = None) -> dict:
        """Resizes the expert slots and/or the KV page pool between generations, without reloading
        weights: the new geometry is validated (planner, compile, memory) before anything is freed,
        and a failure afterwards restores the old one (`scheduler.elastic`). Slots start cold.
        Returns the new status. A server resizes through its scheduler (`Scheduler.rebuild_cache`)."""
        from freetoken_jax.scheduler import elastic

        return elastic.rebuild_engine(self, expert_slots, kv_pages)

    def get_metrics(self) -> dict:
        m = dict(self._m)
        m["decode_tokens_per_second"] = m["generated_tokens"] / m["decode_seconds"] if m["decode_seconds"] else 0.0
        m["compilations"] = self.compilations()
        m["kv_pages_free"] = self.pages.free_pages
        m["kv_pages_total"] = self.pages.num_pages - 1
        m["moe_strategy"] = self.engine_config.moe_strategy
        m["memory_plan"] = self.plan.describe()
        m["strategy_reason"] = self.strategy_reason
        if self.slots is not None:
            m.update(self.expert_cache_metrics())
        return m

    def expert_cache_metrics(self) -> dict:
        """Slot-cache telemetry (strategy "offload"): hit rates counted per distinct routed expert
        per layer step, experts and bytes fetched, slot occupancy."""
        c = self.slots
        hits, misses = np.asarray(c.hits_L).astype(np.int64), np.asarray(c.misses_L).astype(np.int64)
        total = hits + misses
        return dict(
            expert_slots=int(c.num_slots),
            slots_occupied=int((np.asarray(c.id_of_slot) >= 0).sum()),
            expert_hit_rate=float(hits.sum() / total.sum()) if total.sum() else 0.0,
            expert_hit_rate_per_layer=[float(h / t) if t else 0.0 for h, t in zip(hits, total)],
            experts_fetched=int(misses.sum()),
            bytes_fetched=int(misses.sum()) * self.plan.expert_bytes,
            experts_on_cpu=int(np.asarray(c.cpu_L).sum()),
            hybrid_q=self.engine_config.hybrid_q if self.engine_config.moe_strategy == "hybrid" else None,
        )
