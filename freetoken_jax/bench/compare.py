"""`python -m freetoken_jax.bench decode|prefill`: strategies side by side on one set of weights.

The weights (a preset's seeded random weights, built straight into host banks, or a checkpoint)
are loaded once with every expert in host memory; each strategy is then a different `Weights`
over the same banks:

- offload: the unified slot cache (`--vram-gb` of expert slots), misses fetched over PCIe;
- hybrid: the same, with a share of each layer's misses computed by the CPU executor (q* =
  Bp / (Bp + Bh) from bandwidths measured in the same run, unless `--q`);
- cpu: every routed expert computed by the CPU executor, no slots;
- naive: every routed expert fetched every step (B × k slots, all evicted by every layer);
- layer: every MoE layer's whole bank streamed to the device every step (accelerate-style);
- fused: every expert on the device (a second copy of the weights; only where it fits);
- transformers: the checkpoint (`--model`, Hugging Face) decoded by transformers, placed by
  accelerate's device_map under the same GPU memory cap (`bench/hf_baseline.py`).

Prefill adds `stream` (each layer's whole bank copied and dropped, no slots) and `per-token`
(the decode path: each token's routed experts looked up in the slot cache and fetched) as
baselines for the buffered prefill of offload / hybrid, and `offload-copy` (the buffered
prefill loading whole banks by device_put instead of the Pallas fetch: `prefill_load="copy"`).

Decode rows report tokens/s, ms per token, time to first token, hit rate, GB fetched per token,
q*, tokens/s as a multiple of the naive baseline's (when it ran at that batch and skew) and the
ratio to the bound: fetched bytes / Bp (all missed bytes / (Bp + Bh) for hybrid, Bh
for cpu) + bytes read on the device / device copy bandwidth. Random weights give near-constant
routing per sequence; `--routing-skew S` replaces it by seeded draws from a Zipf(S) popularity
(`runtime/routing.py`), the same under every strategy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.bench.measure import copy_bandwidth, executor_bandwidth, h2d_bandwidth
from freetoken_jax.bench.presets import PRESETS, preset_config
from freetoken_jax.runtime import buckets

VARIANTS = ("fused", "offload", "hybrid", "cpu", "naive", "layer", "transformers")
PREFILL_VARIANTS = ("offload", "offload-copy", "hybrid", "stream", "per-token", "cpu", "fused")


class Bench:
    """One host-bank engine and the figures the bounds need."""

    def __init__(self, model: str, *, dtype: str, max_batch: int, max_context: int, quiet: bool = False, prefill_chunk: int = 64,
                 layers: int | None = None):  # fmt: skip
        """`layers`: keep only a preset's first layers (a quick check of the full width)."""
        from freetoken_jax import EngineConfig, FreeTokenEngine

        self.ecfg = EngineConfig(dtype=dtype, moe_strategy="offload", max_batch=max_batch, max_context=max_context, page_size=16,
                                 prefill_chunk=prefill_chunk)  # fmt: skip
        t0 = time.perf_counter()
        if model in PRESETS:
            cfg = preset_config(model)
            if layers is not None:
                cfg = dataclasses.replace(cfg, num_layers=layers, moe_layers=cfg.moe_layers[:layers])
            self.engine = FreeTokenEngine(cfg, self.ecfg.replace(expert_slots=max_batch * cfg.top_k))
        else:
            self.engine = FreeTokenEngine.from_pretrained(model, self.ecfg.replace(expert_slots=max_batch * 64))
        self.cfg = self.engine.model_config
        self.build_s = time.perf_counter() - t0
        gpu = jax.default_backend() == "gpu"
        self.hbm = copy_bandwidth(4.0 if gpu else 0.05, 20 if gpu else 3)
        from freetoken_jax.runtime.offload import host_bank_views

        self.views = host_bank_views(self.engine.weights.params)  # one static object: one executable per variant
        self.bp = h2d_bandwidth(gib=1.0 if gpu else 0.05)
        self.bh = executor_bandwidth(self.engine, self.views)
        self._fused = None
        from freetoken_jax.runtime.steps import decode_step, prefill_step, prefill_step_slots

        # Held for the whole run: one compile per shape (and weights variant) across rows and prompts.
        self._prefill_plain = jax.jit(prefill_step, donate_argnums=(1,))
        self._prefill_slots = jax.jit(prefill_step_slots, donate_argnums=(1, 3))
        self._compiled: dict = {}  # decode steps by `_compile_key`: rows of the same shapes share one
        self._kv_shape = jax.eval_shape(lambda c: c, self.engine.cache)  # a row holds the cache itself while it runs
        self._step = jax.jit(lambda w, s, b, t: decode_step(w, dataclasses.replace(s, tokens_B=t), b), donate_argnums=(1,))
        self.log = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
        self.log(f"{self.cfg.family} shape on {jax.devices()[0].device_kind}: built in {self.build_s:.0f} s; device copy "
                 f"{self.hbm / 1e12:.3f} TB/s, host->device {self.bp / 1e9:.1f} GB/s, CPU executor {self.bh / 1e9:.1f} GB/s")  # fmt: skip

    @property
    def expert_bytes(self) -> int:
        return self.cfg.expert_params * jnp.dtype(self.ecfg.dtype).itemsize

    def slots_for(self, vram_gb: float, B: int) -> int:
        """Slots a budget buys: at least one step's experts, at most every expert and the two
        prefill buffers (as the engine's planner)."""
        cfg = self.cfg
        return min(max(B * cfg.top_k, int(vram_gb * 1e9 // self.expert_bytes)), (cfg.num_moe_layers + 2) * cfg.num_experts)

    def weights(self, variant: str, q: float, skew: float | None):
        """The `Weights` of a variant, or None when it cannot run here."""
        from freetoken_jax.runtime.handoff import resolve_mode

        w = self.engine.weights
        if variant in ("hybrid", "cpu"):
            w = dataclasses.replace(w, strategy=variant, host_banks=self.views, handoff=resolve_mode("auto"),
                                    hybrid_q=jnp.float32(q) if variant == "hybrid" else None)  # fmt: skip
        if variant == "fused":
            if self._fused is None:
                from freetoken_jax import FreeTokenEngine

                try:
                    self._fused = FreeTokenEngine(self.cfg, self.ecfg.replace(moe_strategy="fused", expert_slots=None))
                except Exception as e:  # no room for a second, device-resident copy of the weights
                    self.log(f"fused: cannot build ({type(e).__name__}: {e})")
                    self._fused = False
            if not self._fused:
                return None
            w = self._fused.weights
        return dataclasses.replace(w, routing_skew=None if skew is None else float(skew))

    def _decode_slots(self, variant: str, B: int, vram_gb: float) -> int | None:
        slots = {"naive": B * self.cfg.top_k, "layer": None, "cpu": None, "fused": None}.get(variant)
        return self.slots_for(vram_gb, B) if variant in ("offload", "hybrid") else slots

    def _compile_key(self, variant: str, B: int, vram_gb: float, prompt_len: int, steps: int, skew=None, label=None, **_) -> tuple:
        """What a row's decode executable depends on: the weights variant, the batch, the slots
        and the page-table width (the routing skew and hybrid's q are traced values: any skew,
        any q, one executable)."""
        return (label or variant, B, self._decode_slots(variant, B, vram_gb), self._table_pages(prompt_len, steps), skew is None)

    @staticmethod
    def _row_tokens(prompt_len: int, steps: int) -> int:
        return prompt_len + steps + 8  # the KV a decode row allocates

    def _table_pages(self, prompt_len: int, steps: int) -> int:
        """The page-table width of a decode row (`FreeTokenEngine.page_table`'s bucket)."""
        return buckets.pages_bucket(self.engine.pages.pages_for(self._row_tokens(prompt_len, steps)), self.ecfg.pages_per_sequence)

    def compile_decode(self, variant: str, B: int, vram_gb: float, prompt_len: int, steps: int, q: float, skew, weights=None):
        """The decode step of a `decode` row, compiled from shapes alone: it touches no engine
        state, so several compile at once (`precompile`)."""
        from freetoken_jax.memory.expert_cache import init_slot_cache
        from freetoken_jax.runtime.steps import DecodeBatch, DecodeState

        cfg = self.cfg
        weights = weights or self.weights(variant, q, skew)
        slots = self._decode_slots(variant, B, vram_gb)
        i32 = jax.ShapeDtypeStruct((B,), jnp.int32)
        experts = (
            None if slots is None else jax.eval_shape(lambda: init_slot_cache(cfg, slots, self.ecfg.max_batch, jnp.dtype(self.ecfg.dtype)))
        )
        state = DecodeState(self._kv_shape, i32, i32, experts)
        return self._step.lower(weights, state, DecodeBatch.shapes(B, self._table_pages(prompt_len, steps)), i32).compile()

    def precompile(self, rows: list[dict], workers: int) -> None:
        """Compiles the decode steps of `rows` (each a dict of `decode`'s arguments) on `workers`
        threads ahead of the runs, once per distinct `_compile_key`; `decode` then takes them."""
        import concurrent.futures

        rows = list({self._compile_key(**r): r for r in rows if r["variant"] != "fused"}.values())

        def one(r: dict) -> None:
            t0, name = time.perf_counter(), r.get("label") or r["variant"]
            try:
                args = {k: r.get(k) for k in ("variant", "B", "vram_gb", "prompt_len", "steps", "q", "skew", "weights")}
                self._compiled[self._compile_key(**r)] = self.compile_decode(**args)
                self.log(f"{name} B={r['B']}: decode step compiled ahead in {time.perf_counter() - t0:.0f} s")
            except Exception as e:  # noqa: BLE001 - the row compiles again when it runs, and reports
                self.log(f"{name} B={r['B']}: compiling ahead failed: {type(e).__name__}: {e}")

        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            list(pool.map(one, rows))

    def decode(
        self,
        variant: str,
        B: int,
        vram_gb: float,
        prompt_len: int,
        steps: int,
        q: float,
        skew: float | None,
        weights=None,
        label=None,
        prompt_by_decode: bool = False,
    ) -> dict | None:
        """One decode row; `weights` replaces the variant's own (a variant of it), `label` names it.
        With `prompt_by_decode` the prompt is fed through the decode step itself, one token per
        step, instead of a prefill (no prefill executable to compile; no time to first token)."""
        from tqdm import tqdm

        from freetoken_jax import _cpu_ext
        from freetoken_jax.memory.expert_cache import init_slot_cache
        from freetoken_jax.runtime.steps import DecodeBatch, DecodeState, Sampling

        cfg, eng = self.cfg, self.engine
        weights = weights or self.weights(variant, q, skew)
        if weights is None:
            return None
        slots = self._decode_slots(variant, B, vram_gb)
        key = self._compile_key(variant, B, vram_gb, prompt_len, steps, skew=skew, label=label)
        rng = np.random.default_rng(7 + B)
        prompts = [list(rng.integers(0, cfg.vocab_size, prompt_len)) for _ in range(B)]
        pages = [eng.pages.allocate(self._row_tokens(prompt_len, steps)) for _ in range(B)]
        try:
            table, _ = eng.page_table(pages, B)
            sampling = Sampling.greedy(B)
            # The KV cache is the same under every host-bank variant: they share one prefill executable.
            pw = self.weights("offload", q, skew) if weights.strategy in ("offload", "hybrid") else weights
            step_prefill = lambda w, c, b: self._prefill_plain(pw, c, b)  # noqa: E731
            t_start, ttft, fed = time.perf_counter(), None, prompt_len if prompt_by_decode else 0
            first = jnp.asarray([p[0] for p in prompts], jnp.int32)
            for _pass in range(0 if prompt_by_decode else 2):  # the first pass compiles
                t0 = time.perf_counter()
                for _s, _t, first in eng.prefill_chunks(prompts, table, sampling, step_prefill):  # noqa: B007
                    pass
                first.block_until_ready()
                ttft = time.perf_counter() - t0
            experts = (
                None
                if slots is None
                else jax.device_put(init_slot_cache(cfg, slots, self.ecfg.max_batch, jnp.dtype(self.ecfg.dtype)), jax.devices()[0])
            )
            state = DecodeState(eng.cache, jnp.copy(first), jnp.full((B,), prompt_len - fed, jnp.int32), experts)
            eng.cache = None
            batch = DecodeBatch(jnp.asarray(table), jnp.ones((B,), bool), sampling)
            # Each step reads a seeded random input token per row (random weights make sampled tokens
            # repeat), after the prompt's tokens when it is fed through the decode step.
            inputs = list(jnp.asarray(np.array(prompts, np.int32).T[:fed], jnp.int32))
            inputs += list(jnp.asarray(rng.integers(0, cfg.vocab_size, (steps, B)), jnp.int32))
            t1 = time.perf_counter()
            step = self._compiled.get(key) or self.compile_decode(variant, B, vram_gb, prompt_len, steps, q, skew, weights)
            self._compiled[key] = step
            prefilled = "prompt fed through the decode step" if prompt_by_decode else f"prefill {t1 - t_start:.0f} s (compile included)"
            self.log(f"{label or variant} B={B}: {prefilled}, decode step ready in {time.perf_counter() - t1:.0f} s")
            counters = lambda c: np.array([np.asarray(a).sum() for a in (c.hits_L, c.misses_L, c.cpu_L)])  # noqa: E731
            warm = fed + max(1, min(16, steps // 4))
            before, t0 = None, 0.0
            for i in tqdm(range(fed + steps), desc=f"{variant} B={B}", leave=False, disable=None):
                if i == warm:
                    state.tokens_B.block_until_ready()
                    before = None if slots is None else counters(state.experts)
                    _cpu_ext.handoff_stats(True)
                    t0 = time.perf_counter()
                t1 = time.perf_counter()
                _tok, state = step(weights, state, batch, inputs[i])
                if i == 0:  # a step that never returns shows here, not only as a missing row
                    state.tokens_B.block_until_ready()
                    self.log(f"{label or variant} B={B}: first step took {(time.perf_counter() - t1) * 1e3:.0f} ms")
            state.tokens_B.block_until_ready()
            n = fed + steps - warm
            dt = (time.perf_counter() - t0) / n
            hs = _cpu_ext.handoff_stats(True)
            eng.cache = state.cache
        finally:
            if eng.cache is None:
                from freetoken_jax.runtime.kv_cache import init_cache

                eng.cache = init_cache(cfg, self.ecfg, jnp.dtype(self.ecfg.dtype))
            for p in pages:
                eng.pages.release(p)
        L, E = cfg.num_moe_layers, cfg.num_experts
        on_cpu = 0.0
        if variant == "layer":
            fetched, hit, distinct = float(L * E), 0.0, float(min(E, B * cfg.top_k))
        elif variant in ("cpu", "fused"):
            fetched, hit, distinct = 0.0, (1.0 if variant == "fused" else 0.0), float(min(E, B * cfg.top_k))
            on_cpu = L * distinct if variant == "cpu" else 0.0
        else:
            hits, misses, cpu = counters(state.experts) - before
            fetched, on_cpu, hit = misses / n, cpu / n, hits / max(1, hits + misses + cpu)
            distinct = (hits + misses + cpu) / n / L
        plan = eng.plan
        kv = cfg.num_layers * B * table.shape[1] * self.ecfg.page_size * sum(int(np.prod(s)) for s in cfg.kv_entry_shapes()) * 2
        resident = plan.dense_bytes - cfg.vocab_size * cfg.hidden_dim * 2 + (L * distinct - on_cpu) * self.expert_bytes + kv
        link = fetched * self.expert_bytes / self.bp
        if variant == "hybrid":
            link = (fetched + on_cpu) * self.expert_bytes / (self.bp + self.bh)
        elif variant == "cpu":
            link = on_cpu * self.expert_bytes / self.bh
        bound = link + resident / self.hbm
        r = dict(
            strategy=label or variant, batch=B, vram_gb=vram_gb if slots and variant in ("offload", "hybrid") else None, slots=slots,
            routing_skew=skew, ms_per_token=dt * 1e3, tokens_per_s=B / dt, ttft_ms=None if ttft is None else ttft * 1e3, hit_rate=float(hit),
            gb_fetched_per_token=fetched * self.expert_bytes / B / 1e9, experts_on_cpu_per_step=float(on_cpu),
            q=None if weights.hybrid_q is None else float(weights.hybrid_q), bound_ms=bound * 1e3, ratio_to_bound=bound / dt,
        )  # fmt: skip
        if hs["count"]:  # FFI handoffs: per-layer timing from the C++ side (see cpu_ext/src/ffi_handoff.h)
            c = hs["count"]
            r.update(handoff_window_us=hs["window_s"] / c * 1e6, handoff_gpu_side_us=hs["gpu_s"] / c * 1e6,
                     handoff_cpu_side_us=hs["cpu_s"] / c * 1e6, handoff_sync=_cpu_ext.handoff_sync(),
                     handoffs_per_step=c / n, handoff_arrivals_unseen=hs["unseen"])  # fmt: skip
        return r

    def prefill(self, variant: str, prompt_len: int, q: float, vram_gb: float) -> dict | None:
        """Time to prefill one prompt. offload / hybrid: through two borrowed layer buffers of a
        `vram_gb` slot cache (when it has 2E slots); stream: each layer's whole bank copied and
        dropped; per-token: the decode path (routed experts looked up and fetched per token)."""
        from freetoken_jax.memory.expert_cache import init_slot_cache
        from freetoken_jax.runtime.steps import Sampling

        eng, cfg = self.engine, self.cfg
        weights = self.weights({"stream": "offload", "per-token": "offload", "offload-copy": "offload"}.get(variant, variant), q, None)
        if weights is None:
            return None
        if variant == "offload-copy":
            weights = dataclasses.replace(weights, prefill_load="copy")
        slots, chunk = None, self.ecfg.prefill_chunk
        if variant in ("offload", "offload-copy", "hybrid", "per-token"):
            n = self.slots_for(vram_gb, self.ecfg.max_batch)
            if variant == "per-token":  # the largest chunk whose routed experts fit the slots (n >= top_k: `slots_for`)
                chunk = min(chunk, 1 << (n // cfg.top_k).bit_length() - 1)
            slots = jax.device_put(init_slot_cache(cfg, n, self.ecfg.max_batch, jnp.dtype(self.ecfg.dtype)), jax.devices()[0])
        box = [slots]

        def step(w, c, b):
            if variant == "per-token":
                tok, c, box[0] = self._prefill_slots(weights, c, b, box[0])
            elif box[0] is not None:
                tok, c, box[0] = eng.prefill(weights, c, b, box[0])
            else:
                tok, c = self._prefill_plain(weights, c, b)
            return tok, c

        prompt = list(np.random.default_rng(3).integers(0, cfg.vocab_size, prompt_len))
        pages = [eng.pages.allocate(prompt_len + 1)]
        try:
            table, _ = eng.page_table(pages, 1)
            # The first pass compiles: a prompt of one full chunk and the same last chunk suffices.
            for p in (prompt[: min(prompt_len, chunk + prompt_len % chunk)], prompt):
                t0 = time.perf_counter()
                for _s, _t, first in eng.prefill_chunks([p], table, Sampling.greedy(1), step, chunk):  # noqa: B007
                    pass
                first.block_until_ready()
                ttft = time.perf_counter() - t0
        finally:
            for p in pages:
                eng.pages.release(p)
        chunks = -(-prompt_len // self.ecfg.prefill_chunk)  # the bound is the buffered path's, at the chosen chunk size
        all_experts = cfg.num_moe_layers * cfg.num_experts * self.expert_bytes
        bound = chunks * all_experts / self.bp if variant in ("offload", "offload-copy", "hybrid", "stream", "per-token") else None
        return dict(strategy=variant, prompt_len=prompt_len, chunks=chunks, chunk=chunk, vram_gb=vram_gb if slots is not None else None,
                    buffered=bool(slots is not None and variant != "per-token" and slots.num_slots >= 2 * cfg.num_experts),
                    ttft_ms=ttft * 1e3, tokens_per_s=prompt_len / ttft, first_token=int(np.asarray(first).reshape(-1)[0]),
                    pcie_bound_ms=None if bound is None else bound * 1e3, ratio_to_bound=None if bound is None else bound / ttft)  # fmt: skip


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """Rows as right-aligned text columns: `cols` = (key, heading, format); '-' where a row has none."""
    head = " ".join(f"{h:>{len(h) if len(h) > 7 else 7}}" for _, h, _ in cols)
    lines = [head]
    for r in rows:
        cells = []
        for key, h, fmt in cols:
            v = r.get(key)
            w = len(h) if len(h) > 7 else 7
            cells.append(f"{'-' if v is None else format(v, fmt):>{w}}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def add_speedups(rows: list[dict]) -> bool:
    """Sets `x_naive` on every decode row that has a `naive` row of the same batch and routing
    skew: its tokens/s over naive's (the FreeToken paper's headline figure). Returns whether any
    was set."""
    naive = {(r["batch"], r["routing_skew"]): r["tokens_per_s"] for r in rows if r["strategy"] == "naive" and r.get("tokens_per_s")}
    hit = False
    for r in rows:
        base = naive.get((r.get("batch"), r.get("routing_skew")))
        if base and r.get("tokens_per_s") is not None:
            r["x_naive"] = r["tokens_per_s"] / base
            hit = True
    return hit


def plot(rows: list[dict], path: str) -> None:
    """tokens/s against the expert VRAM budget, one line per strategy (and batch, skew)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib ({e}); install it with `pip install matplotlib`") from e
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(r["strategy"], r["batch"], r["routing_skew"]) for r in rows}, key=str)
    budgets = sorted({r["vram_gb"] for r in rows if r["vram_gb"] is not None})
    for s, b, k in keys:
        pts = sorted(
            (r["vram_gb"], r["tokens_per_s"])
            for r in rows
            if (r["strategy"], r["batch"], r["routing_skew"]) == (s, b, k) and r["vram_gb"] is not None
        )
        flat = [r["tokens_per_s"] for r in rows if (r["strategy"], r["batch"], r["routing_skew"]) == (s, b, k) and r["vram_gb"] is None]
        if not pts and flat and budgets:
            pts = [(v, flat[0]) for v in budgets]  # strategies without slots: flat across budgets
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{s} B={b} skew={k}")
    ax.set_xlabel("expert slot budget (GB)")
    ax.set_ylabel("decode tokens / s")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args) -> dict:
    steps = getattr(args, "gen_len", 0)
    bench = Bench(args.model, dtype=args.dtype, max_batch=max(getattr(args, "batch", [1])),
                  max_context=max(getattr(args, "prompt_len", [64]) if args.cmd == "prefill" else [args.prompt_len + steps + 16]) + 16,
                  prefill_chunk=getattr(args, "chunk", 64))  # fmt: skip
    q = bench.bp / (bench.bp + bench.bh)  # q*, from this run's measured bandwidths
    hybrid_qs = args.q or [q]
    out = dict(kind=args.cmd, model=args.model, device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
               dtype=args.dtype, expert_impl=getattr(args, "expert_impl", "auto"), time=time.time(), copy_bw_gb_s=bench.hbm / 1e9, h2d_gb_s=bench.bp / 1e9,
               executor_gb_s=bench.bh / 1e9, q=q, rows=[])  # fmt: skip

    def write() -> None:
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    def keep(r: dict | None) -> None:  # the JSON is rewritten after every row: a run cut short keeps its figures
        if r is not None:
            out["rows"].append(r)
            write()

    if args.cmd == "decode":
        rows = [dict(variant=s, B=B, vram_gb=vram, prompt_len=args.prompt_len, q=split, skew=skew,
                     steps=min(args.gen_len, args.layer_steps) if s == "layer" else args.gen_len)
                for skew in args.routing_skew for B in args.batch for s in args.strategy
                for vram in (args.vram_gb if s in ("offload", "hybrid", "transformers") else [None])
                for split in (hybrid_qs if s == "hybrid" else [q])]  # fmt: skip
        if getattr(args, "compile_workers", 1) > 1:
            # fused builds a second engine on first use: not from several threads
            bench.precompile([r for r in rows if r["variant"] not in ("transformers", "fused")], args.compile_workers)
        for r in rows:
            if r["variant"] == "transformers":
                from freetoken_jax.bench.hf_baseline import transformers_decode

                keep(transformers_decode(args.model, r["B"], args.prompt_len, args.gen_len, r["vram_gb"], args.dtype, bench.log))
            else:
                by_decode = getattr(args, "prompt_by_decode", False) and r["variant"] != "layer"
                keep(bench.decode(**r, prompt_by_decode=by_decode))
        if add_speedups(out["rows"]):
            write()
        cols = [("strategy", "strategy", ""), ("batch", "B", "d"), ("vram_gb", "vram GB", "g"), ("routing_skew", "skew", "g"),
                ("tokens_per_s", "tok/s", ".1f"), ("ms_per_token", "ms/tok", ".2f"), ("ttft_ms", "TTFT ms", ".0f"),
                ("hit_rate", "hit", ".3f"), ("gb_fetched_per_token", "GB/tok", ".3f"), ("q", "q", ".2f"),
                ("ratio_to_bound", "of bound", ".2f"), ("x_naive", "x naive", ".2f")]  # fmt: skip
    else:
        for n in args.prompt_len:
            for s in args.strategy:
                for split in hybrid_qs if s == "hybrid" else [q]:
                    keep(bench.prefill(s, n, split, args.vram_gb[0]))
        cols = [("strategy", "strategy", ""), ("prompt_len", "prompt", "d"), ("chunks", "chunks", "d"), ("tokens_per_s", "tok/s", ".0f"),
                ("ttft_ms", "TTFT ms", ".0f"), ("pcie_bound_ms", "bound ms", ".0f"), ("ratio_to_bound", "of bound", ".2f")]  # fmt: skip
    print(table(out["rows"], cols))
    if getattr(args, "plot", None):
        plot(out["rows"], args.plot)
    return out
