"""`python -m freetoken_jax.bench decode|prefill`: strategies side by side on one set of weights.

The weights (a preset's seeded random weights, built straight into host banks, or a checkpoint)
are loaded once with every expert in host memory; each strategy is then a different `Weights`
over the same banks:

- offload: the unified slot cache (`--slots-gb` of expert slots), misses fetched over PCIe;
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
baselines for the buffered prefill of offload / hybrid, and `offload-copy` / `offload-copy2` /
`offload-fetch` (the buffered prefill loading whole banks by device_put, one or two layers ahead,
or the missing experts by the Pallas fetch: `prefill_load="copy"` / `"copy2"` / `"fetch"`; plain
offload takes the engine's choice); `cpu-fetch` is cpu with every chunk on the CPU (plain cpu
computes long chunks on the device, as the engine does on a GPU).

Decode rows report tokens/s, ms per token, time to first token, hit rate, GB fetched per token,
q*, tokens/s as a multiple of the naive baseline's (when it ran at that batch and skew) and the
ratio to the bound: fetched bytes / Bp (all missed bytes / (Bp + Bh) for hybrid, Bh
for cpu) + bytes read on the device / device copy bandwidth. Each row's requests decode the
tokens they sample (temperature 1), as served requests do; random weights route those tokens to
few experts (the demo model's offload row at 0.001 GB hit 0.86 in one run on a CPU), so cache
figures without `--routing-skew` flatter every cache (the loop before fed seeded random tokens). `--routing-skew S`
replaces the routing by seeded draws from a Zipf(S) popularity (`runtime/routing.py`), the same
under every strategy; the recorded figures use it.
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

from freetoken_jax.bench.measure import copy_bandwidth, executor_bandwidth, h2d_bandwidth, thread_times
from freetoken_jax.bench.presets import PRESETS, preset_config
from freetoken_jax.memory.kv_cache import gathered_pages
from freetoken_jax.quant.layout import expert_bytes
from freetoken_jax.runtime.bank_copy import carried
from freetoken_jax.runtime.cpu_executor import hybrid_threads
from freetoken_jax.runtime.experts import FUSED, Cpu, Hybrid, Offload
from freetoken_jax.runtime.handoff import resolve_mode
from freetoken_jax.runtime.offload import host_bank_views, moe_experts
from freetoken_jax.runtime.routing import SyntheticRouting
from freetoken_jax.runtime.runner import ModelRunner, StepSet, decode_job, state_shapes, table_widths
from freetoken_jax.runtime.sampling import GenerationParams
from freetoken_jax.runtime.steps import shapes
from freetoken_jax.scheduler.batcher import Batcher, RequestHandle

VARIANTS = ("fused", "offload", "hybrid", "cpu", "naive", "layer", "transformers")
PREFILL_VARIANTS = (
    "offload",
    "offload-copy",
    "offload-copy2",
    "offload-fetch",
    "hybrid",
    "stream",
    "per-token",
    "cpu",
    "cpu-fetch",
    "fused",
)
SLOT_PREFILLS = ("offload", "offload-copy", "offload-copy2", "offload-fetch", "hybrid", "per-token")  # prefill through a slot cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerStreaming(Offload):
    """The `layer` / `stream` baselines: every MoE layer's whole bank copied to the device at
    every step and dropped (accelerate-style offloading); no slot cache."""

    @property
    def uses_slots(self) -> bool:
        return False


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PerToken(Offload):
    """The `per-token` prefill baseline: every chunk through the slot cache as decode does."""

    def prefill_path(self, cfg, tokens, num_slots):
        return "slots"


class Bench:
    """One set of host banks (the weights of an offload engine) and the figures the bounds need;
    each row runs its variant's expert backend over them in a `ModelRunner` of its own geometry,
    driven by a `Batcher` as serving drives it. All rows share one `StepSet`: one compile per
    shape and backend kind."""

    def __init__(self, model: str, *, dtype: str, max_batch: int, max_context: int, quiet: bool = False, prefill_chunk: int = 64,
                 layers: int | None = None, expert_impl: str = "auto", expert_format: str | None = None):  # fmt: skip
        """`layers`: keep only a preset's first layers (a quick check of the full width);
        `expert_impl`: how the GPU computes routed experts (`bench/expert_impls.py`)."""
        from freetoken_jax import EngineConfig, FreeTokenEngine
        from freetoken_jax.bench.expert_impls import named

        self.compute = named(expert_impl)

        self.ecfg = EngineConfig(dtype=dtype, moe_strategy="offload", max_batch=max_batch, max_context=max_context, page_size=16,
                                 prefill_chunk=prefill_chunk, prefix_cache=False, expert_format=expert_format)  # fmt: skip
        t0 = time.perf_counter()
        if model in PRESETS:
            cfg = preset_config(model, layers)
            self.engine = FreeTokenEngine(cfg, self.ecfg.replace(expert_slots=max_batch * cfg.top_k))
        else:
            self.engine = FreeTokenEngine.from_pretrained(model, self.ecfg.replace(expert_slots=max_batch * 64))
        self.cfg = self.engine.model_config  # its runner stays small (B x k slots): rows bring their own
        # the rows load prefill's layers as the engine chose from its memory plan (copy2 / copy / fetch on a GPU)
        self.ecfg = self.ecfg.replace(prefill_load=self.engine.engine_config.prefill_load)
        self.build_s = time.perf_counter() - t0
        gpu = jax.default_backend() == "gpu"
        self.hbm = copy_bandwidth(4.0 if gpu else 0.05, 20 if gpu else 3)
        self.views = host_bank_views(self.engine.weights.own_params)  # one static object: one executable per backend kind
        # the link's rate for the bounds: the faster of a fresh buffer's copy and the first MoE layer's
        # own banks' (on the GPU machine a fresh buffer's rate moved 46-53 GB/s between processes
        # while the banks' copies ran at the top of that range)
        self.bp_buffer = h2d_bandwidth(gib=1.0 if gpu else 0.05)
        self.bp_banks = h2d_bandwidth(first_layer_banks(self.engine.weights.own_params)) if gpu else None
        self.bp = max(self.bp_buffer, self.bp_banks or 0.0)
        self.bh = executor_bandwidth(self.engine, self.views)
        self.bh_hybrid = executor_bandwidth(self.engine, self.views, threads=hybrid_threads())  # hybrid's pool
        self._fused = None
        self.steps = StepSet(dtype)
        self.log = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
        self.log(f"{self.cfg.family} shape on {jax.devices()[0].device_kind}: built in {self.build_s:.0f} s; device copy "
                 f"{self.hbm / 1e12:.3f} TB/s, host->device {self.bp / 1e9:.1f} GB/s{self._bp_parts()}, CPU executor {self.bh / 1e9:.1f} GB/s")  # fmt: skip
        if switches():
            self.log("under " + ", ".join(f"{k}={v}" for k, v in switches().items()))
        if jax.default_backend() == "cpu":
            self.log("(the CPU backend: no PCIe and no HBM, so 'host->device' and 'device copy' are memory copies and the rows are a "
                     "functional demo, not a measure of the strategies; GPU figures: benchmarks/RESULTS.md)")  # fmt: skip

    @property
    def expert_bytes(self) -> int:
        return expert_bytes(self.cfg, jnp.dtype(self.ecfg.dtype).itemsize)

    def _bp_parts(self) -> str:
        if self.bp_banks is None:
            return ""
        return f" (the faster of a fresh buffer's {self.bp_buffer / 1e9:.1f} and a layer's banks' {self.bp_banks / 1e9:.1f})"

    def slots_for(self, slots_gb: float, B: int) -> int:
        """Slots a budget buys: at least one step's experts, at most every expert and the two
        prefill buffers (as the engine's planner)."""
        cfg = self.cfg
        return min(max(B * cfg.top_k, int(slots_gb * 1e9 // self.expert_bytes)), (cfg.num_moe_layers + 2) * cfg.num_experts)

    def variant(self, variant: str, q: float, skew: float | None) -> tuple | None:
        """(weights, expert backend) of a variant, or None when it cannot run here."""
        weights, handoff = self.engine.weights, resolve_mode("auto")
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
            weights, experts = self._fused.weights, FUSED
        elif variant == "hybrid":
            experts = Hybrid(self.views, handoff, self.ecfg.hybrid_overhead, self.ecfg.prefill_load, float(q))
        elif variant in ("cpu", "cpu-fetch"):
            experts = Cpu(self.views, handoff, "fetch" if variant == "cpu-fetch" else self.ecfg.prefill_load)
        elif variant in ("layer", "stream"):
            experts = LayerStreaming(self.ecfg.prefill_load)
        elif variant == "per-token":
            experts = PerToken(self.ecfg.prefill_load)
        else:  # offload, naive (few slots), offload-copy, offload-copy2, offload-fetch
            experts = Offload(variant.removeprefix("offload-") if variant.startswith("offload-") else self.ecfg.prefill_load,
                              host_banks=carried(self.views))  # fmt: skip
        if self.compute is not None and hasattr(experts, "compute"):
            experts = dataclasses.replace(experts, compute=self.compute)
        return weights, experts if skew is None else SyntheticRouting(experts, float(skew))

    def _decode_slots(self, variant: str, B: int, slots_gb: float) -> int | None:
        if variant in ("offload", "hybrid"):
            return self.slots_for(slots_gb, B)
        return B * self.cfg.top_k if variant == "naive" else None

    def _runner(self, weights, experts, B: int, slots: int | None, **ecfg) -> ModelRunner:
        """A runner of `B` rows, all running at once, and `slots` expert slots over the shared weights."""
        plan = self.engine.plan if self._fused is None or weights is not self._fused.weights else self._fused.plan
        return ModelRunner(self.cfg, self.ecfg.replace(max_batch=B, max_running=B, **ecfg), weights, experts, dataclasses.replace(plan, slots=slots or 0),
                           self.steps)  # fmt: skip

    def _decode_job(self, variant: str, B: int, slots_gb: float, prompt_len: int, steps: int, q: float, skew, experts=None, **_) -> tuple:
        """The (decode step, argument shapes) of a `decode` row, from shapes alone (nothing is
        allocated, so several compile at once: `precompile`)."""
        weights, experts = self.variant(variant, q, skew) if experts is None else (self.engine.weights, experts)
        slots, ecfg, dtype = self._decode_slots(variant, B, slots_gb), self.ecfg.replace(max_batch=B), jnp.dtype(self.ecfg.dtype)
        return decode_job(self.steps, weights, experts, state_shapes(self.cfg, ecfg, slots, dtype), table_widths(self.cfg, ecfg))

    def precompile(self, rows: list[dict], workers: int) -> None:
        """Compiles the decode steps of `rows` (each a dict of `decode`'s arguments) on `workers`
        threads ahead of the runs, once per distinct executable; `decode` then finds them."""
        import concurrent.futures

        def one(r: dict) -> None:
            t0, name = time.perf_counter(), r.get("label") or r["variant"]
            try:
                self.steps.precompile([self._decode_job(**r)])
                self.log(f"{name} B={r['B']}: decode step compiled ahead in {time.perf_counter() - t0:.0f} s")
            except Exception as e:  # noqa: BLE001 - the row compiles again when it runs, and reports
                self.log(f"{name} B={r['B']}: compiling ahead failed: {type(e).__name__}: {e}")

        # rows that differ only in the skew or q share an executable (both are traced)
        distinct = {(r.get("label") or r["variant"], r["B"], self._decode_slots(r["variant"], r["B"], r["slots_gb"]), r["skew"] is None): r
                    for r in rows}  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            list(pool.map(one, distinct.values()))

    def decode(
        self,
        variant: str,
        B: int,
        slots_gb: float,
        prompt_len: int,
        steps: int,
        q: float,
        skew: float | None,
        experts=None,
        label=None,
        prompt_by_decode: bool = False,
        balance: bool = True,
    ) -> dict | None:
        """One decode row: B requests of `prompt_len` random tokens, `steps` decode steps each,
        sampled at temperature 1 (random weights make greedy tokens repeat). With
        `prompt_by_decode` the prompt is fed through the decode step itself, one token per step,
        instead of a prefill (no prefill executable to compile; no time to first token). `experts`
        replaces the variant's backend (a variant of it), `label` names the row. `balance`:
        hybrid's q starts at `q` and follows the handoff's timing (`runtime/balance.py`; the row
        reports where it ended); False keeps it at `q`."""
        from tqdm import tqdm

        from freetoken_jax import _cpu_ext

        cfg = self.cfg
        wx = self.variant(variant, q, skew) if experts is None else (self.engine.weights, experts)
        if wx is None:
            return None
        slots = self._decode_slots(variant, B, slots_gb)
        t_start = time.perf_counter()
        runner = self._runner(*wx, B, slots, hybrid_balance=balance)
        batcher = Batcher(runner, prefix_cache=False, prefill_rows=B, prompt_by_decode=prompt_by_decode)
        rng = np.random.default_rng(7 + B)
        fed = prompt_len if prompt_by_decode else 0
        handles = [
            RequestHandle([int(t) for t in rng.integers(0, cfg.vocab_size, prompt_len)],
                          GenerationParams(max_new_tokens=steps + 1, temperature=1.0, seed=b, ignore_eos=True))
            for b in range(B)
        ]  # fmt: skip
        counters = lambda c: np.array([np.asarray(a).sum() for a in (c.hits_L, c.misses_L, c.cpu_L)])  # noqa: E731
        try:
            ttft = None
            if not prompt_by_decode:  # the first pass compiles the prefill; the second is the rows' own
                firsts = [RequestHandle(h.prompt, dataclasses.replace(h.params, max_new_tokens=1)) for h in handles]
                for hs in (firsts, handles):
                    t0 = time.perf_counter()
                    for h in hs:
                        batcher.submit(h)
                    while not all(h.generated for h in hs):  # a row decodes from the step after its prefill ends
                        batcher.step()
                    ttft = time.perf_counter() - t0
                runner.reset_slots()  # the timed decode starts from cold slots
            else:
                for h in handles:
                    batcher.submit(h)
            t1 = time.perf_counter()
            step, args = decode_job(self.steps, *wx, shapes(runner.state, committed=True), runner.tables)
            step.lower(*args).compile()  # found compiled when `precompile` ran
            prefilled = "prompt fed through the decode step" if prompt_by_decode else f"prefill {t1 - t_start:.0f} s (compile included)"
            self.log(f"{label or variant} B={B}: {prefilled}, decode step ready in {time.perf_counter() - t1:.0f} s")
            warm = fed + max(1, min(16, steps // 4))
            before, t0, host0 = None, 0.0, 0
            bar = tqdm(total=fed + steps, desc=f"{variant} B={B}", leave=False, disable=None)
            while not all(h.finished for h in handles):
                done = batcher.metrics["decode_steps"]
                if done == warm and before is None:
                    runner.state.tokens_B.block_until_ready()
                    before = None if slots is None else counters(runner.slots)
                    _cpu_ext.handoff_stats(True)
                    host0 = thread_times()[0]
                    t0 = time.perf_counter()
                t1 = time.perf_counter()
                batcher.step()
                if done == 0 and batcher.metrics["decode_steps"] == 1:  # a step that never returns shows here
                    runner.state.tokens_B.block_until_ready()
                    self.log(f"{label or variant} B={B}: first step took {(time.perf_counter() - t1) * 1e3:.0f} ms")
                bar.update(batcher.metrics["decode_steps"] - done)
            bar.close()
            batcher.flush()
            runner.state.tokens_B.block_until_ready()
            n = batcher.metrics["decode_steps"] - warm
            dt = (time.perf_counter() - t0) / n
            host = (thread_times()[0] - host0) / n * 1e-9
            hs = _cpu_ext.handoff_stats(True)
            after = None if slots is None else counters(runner.slots)
            gathered = gathered_pages(cfg, runner.engine_config)
        finally:
            runner.close()
        L, E = cfg.num_moe_layers, cfg.num_experts
        on_cpu = 0.0
        if variant == "layer":
            fetched, hit, distinct = float(L * E), 0.0, float(min(E, B * cfg.top_k))
        elif variant in ("cpu", "fused"):
            fetched, hit, distinct = 0.0, (1.0 if variant == "fused" else 0.0), float(min(E, B * cfg.top_k))
            on_cpu = L * distinct if variant == "cpu" else 0.0
        else:
            hits, misses, cpu = after - before
            fetched, on_cpu, hit = misses / n, cpu / n, hits / max(1, hits + misses + cpu)
            distinct = (hits + misses + cpu) / n / L
        plan = self.engine.plan
        kv = B * gathered * self.ecfg.page_size * sum(int(np.prod(s)) for s in cfg.kv_entry_shapes()) * 2
        resident = plan.dense_bytes - cfg.vocab_size * cfg.hidden_dim * 2 + (L * distinct - on_cpu) * self.expert_bytes + kv
        link = fetched * self.expert_bytes / self.bp
        if variant == "hybrid":
            link = (fetched + on_cpu) * self.expert_bytes / (self.bp + self.bh_hybrid)
        elif variant == "cpu":
            link = on_cpu * self.expert_bytes / self.bh
        bound = link + resident / self.hbm
        r = dict(
            strategy=label or variant, batch=B, slots_gb=slots_gb if slots and variant in ("offload", "hybrid") else None, slots=slots,
            routing_skew=skew, ms_per_token=dt * 1e3, tokens_per_s=B / dt, ttft_ms=None if ttft is None else ttft * 1e3, hit_rate=float(hit),
            gb_fetched_per_token=fetched * self.expert_bytes / B / 1e9, experts_on_cpu_per_step=float(on_cpu),
            q=float(runner.experts.q) if variant == "hybrid" else None, q_start=float(q) if variant == "hybrid" else None,
            bound_ms=bound * 1e3, ratio_to_bound=bound / dt,
            host_thread_ms_per_step=host * 1e3,
        )  # fmt: skip
        if hs["count"]:  # FFI handoffs: per-layer timing from the C++ side (see cpu_ext/src/ffi_handoff.h)
            c = hs["count"]
            r.update(handoff_window_us=hs["window_s"] / c * 1e6, handoff_gpu_side_us=hs["gpu_s"] / c * 1e6,
                     handoff_cpu_side_us=hs["cpu_s"] / c * 1e6, handoff_sync=_cpu_ext.handoff_sync(),
                     handoffs_per_step=c / n, handoff_arrivals_unseen=hs["unseen"])  # fmt: skip
            # the step's time outside its handoff windows, per handoff (a layer): what no transfer hides
            r["outside_windows_us_per_layer"] = (dt - hs["window_s"] / n) / (c / n) * 1e6
        return r

    def prefill(
        self, variant: str, prompt_len: int, q: float, slots_gb: float, chunk: int | None = None, skew: float | None = None
    ) -> dict | None:
        """Time to prefill one prompt. offload / hybrid: through two borrowed layer buffers of a
        `slots_gb` slot cache (when it has 2E slots); stream: each layer's whole bank copied and
        dropped; per-token: the decode path (routed experts looked up and fetched per token).
        `chunk`: the prefill chunk (default: the bench's); `skew`: synthetic routing (None: the
        model's router)."""
        from freetoken_jax import _cpu_ext

        cfg = self.cfg
        wx = self.variant(variant, q, skew)
        if wx is None:
            return None
        slots, chunk = None, chunk or self.ecfg.chunk
        if variant in SLOT_PREFILLS:
            slots = self.slots_for(slots_gb, self.ecfg.max_batch)
            if variant == "per-token":  # the largest chunk whose routed experts fit the slots (slots >= top_k: `slots_for`)
                chunk = min(chunk, 1 << (slots // cfg.top_k).bit_length() - 1)
        runner = self._runner(*wx, self.ecfg.max_batch, slots, prefill_chunk=chunk)
        batcher = Batcher(runner, prefix_cache=False)
        prompt = [int(t) for t in np.random.default_rng(3).integers(0, cfg.vocab_size, prompt_len)]
        try:
            # The first pass compiles: a prompt of one full chunk and the same last chunk suffices.
            # Under the model's router an untimed last pass asks for the first token's
            # log-probability and the runner-up's (`first_margin`): rows whose first tokens differ
            # can be told apart from a near tie. (Asking for log-probabilities sends a prompt's
            # last token through the decode step, where synthetic routing draws other experts.)
            passes = [(prompt[: min(prompt_len, chunk + prompt_len % chunk)], None), (prompt, None)] + [(prompt, 2)] * (skew is None)
            margin, copies = None, None
            for i, (p, lp) in enumerate(passes):
                if i == 1:  # the timed pass: count its bank copies on the copy stream (runtime/bank_copy.py), if any
                    _cpu_ext.bank_copy_stats(True)
                t0 = time.perf_counter()
                h = RequestHandle(p, GenerationParams(max_new_tokens=1, logprobs=lp))
                batcher.submit(h)
                while not h.finished:
                    batcher.step()
                if lp is None:
                    ttft, first = time.perf_counter() - t0, h.generated[0]
                if i == 1:
                    copies = _cpu_ext.bank_copy_stats(True)
            if skew is None:
                token = next(ev for ev in h.events() if ev.kind == "token")
                margin = first_margin(token.token, token.logprobs) if token.token == first else None
        finally:
            runner.close()
        chunks = -(-prompt_len // chunk)  # the bound is the buffered path's, at the chosen chunk size
        all_experts = cfg.num_moe_layers * cfg.num_experts * self.expert_bytes
        cpu_streams = variant == "cpu" and wx[1].for_prefill(cfg, chunk).on_device
        bound = chunks * all_experts / self.bp if variant in SLOT_PREFILLS or variant == "stream" or cpu_streams else None
        return dict(strategy=variant, prompt_len=prompt_len, chunks=chunks, chunk=chunk, slots_gb=slots_gb if slots is not None else None, routing_skew=skew,
                    buffered=bool(slots is not None and variant != "per-token" and slots >= 2 * cfg.num_experts),
                    ttft_ms=ttft * 1e3, tokens_per_s=prompt_len / ttft, first_token=first, first_margin=margin,
                    pcie_bound_ms=None if bound is None else bound * 1e3, ratio_to_bound=None if bound is None else bound / ttft,
                    copy_stream_starts=copies["starts"] or None,
                    copy_stream_host_ms=copies["host_s"] * 1e3 if copies["starts"] else None)  # fmt: skip


def first_layer_banks(params) -> list:
    """The first MoE layer's host banks (gate, up, down) in the weights tree."""
    experts = next(moe_experts(params), None)
    if experts is None:
        raise ValueError("the model has no MoE layer")
    return [experts[k].get_value() for k in ("gate", "up", "down")]


def first_margin(token: int, logprobs) -> float | None:
    """`token`'s log-probability less the most likely other token's, from its token event's
    `logprobs` (its own, [(token, log-probability)] most likely first); None without another."""
    own, top = logprobs
    return next((own - lp for t, lp in top if t != token), None)


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


def plot_title(run: dict) -> str:
    """The model, device and date of a `bench decode` JSON."""
    when = time.strftime("%Y-%m-%d", time.localtime(run.get("time", 0)))
    return f"{run.get('model', '?')} ({run.get('expert_format', 'bf16')} experts) on {run.get('device', '?')}, {when}"


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """tokens/s against the expert slot budget, one line per strategy (and batch, skew), under
    `title` (model, device, date)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib ({e}); install it with `pip install matplotlib`") from e
    from matplotlib.ticker import LogLocator, ScalarFormatter

    rows = [dict(r, slots_gb=r.get("slots_gb", r.get("vram_gb"))) for r in rows]  # JSON written before the flag was --slots-gb
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(r["strategy"], r["batch"], r["routing_skew"]) for r in rows}, key=str)
    budgets = sorted({r["slots_gb"] for r in rows if r["slots_gb"] is not None})
    for s, b, k in keys:
        pts = sorted(
            (r["slots_gb"], r["tokens_per_s"])
            for r in rows
            if (r["strategy"], r["batch"], r["routing_skew"]) == (s, b, k) and r["slots_gb"] is not None
        )
        flat = [r["tokens_per_s"] for r in rows if (r["strategy"], r["batch"], r["routing_skew"]) == (s, b, k) and r["slots_gb"] is None]
        if not pts and flat and budgets:
            pts = [(v, flat[0]) for v in budgets]  # strategies without slots: flat across budgets
        if pts:
            skew = "model's router" if k is None else f"Zipf skew {k:g}"
            ax.plot(*zip(*pts), marker="o", label=f"{s}, batch {b}, {skew}")
    ax.set_xlabel("expert slot budget (GB)")
    ax.set_ylabel("decode tokens / s")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # ticks at 1-2-5, so the top lines have one near them
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def switches() -> dict:
    """The engine's switches (FREETOKEN_*), XLA's flags and jax's settings (JAX_*) set in this
    process's environment: what a row was measured under, beside it in the JSON."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("FREETOKEN_", "JAX_")) or k == "XLA_FLAGS"}


def run(args) -> dict:
    steps = getattr(args, "gen_len", 0)
    bench = Bench(args.model, dtype=args.dtype, max_batch=max(getattr(args, "batch", [1])),
                  max_context=max(getattr(args, "prompt_len", [64]) if args.cmd == "prefill" else [args.prompt_len + steps + 16]) + 16,
                  prefill_chunk=max(getattr(args, "chunk", None) or [64]), expert_impl=getattr(args, "expert_impl", "auto"),
                  expert_format=getattr(args, "expert_format", None), layers=getattr(args, "layers", None))  # fmt: skip
    q = bench.bp / (bench.bp + bench.bh_hybrid)  # q*, from this run's measured bandwidths (hybrid's executor threads)
    hybrid_qs = args.q or [q]
    out = dict(kind=args.cmd, model=args.model, device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
               dtype=args.dtype, expert_format=bench.cfg.expert_format, expert_bytes=bench.expert_bytes, expert_impl=getattr(args, "expert_impl", "auto"), prefill_load=bench.ecfg.prefill_load, time=time.time(), copy_bw_gb_s=bench.hbm / 1e9, h2d_gb_s=bench.bp / 1e9,
               h2d_buffer_gb_s=bench.bp_buffer / 1e9, h2d_banks_gb_s=None if bench.bp_banks is None else bench.bp_banks / 1e9, executor_gb_s=bench.bh / 1e9, hybrid_executor_gb_s=bench.bh_hybrid / 1e9, q=q, switches=switches(), rows=[])  # fmt: skip

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
        rows = [dict(variant=s, B=B, slots_gb=gb, prompt_len=args.prompt_len, q=split, skew=skew,
                     steps=min(args.gen_len, args.layer_steps) if s == "layer" else args.gen_len)
                for skew in args.routing_skew for B in args.batch for s in args.strategy
                for gb in (args.slots_gb if s in ("offload", "hybrid", "transformers") else [None])
                for split in (hybrid_qs if s == "hybrid" else [q])]  # fmt: skip
        if getattr(args, "compile_workers", 1) > 1:
            # fused builds a second engine on first use: not from several threads
            bench.precompile([r for r in rows if r["variant"] not in ("transformers", "fused")], args.compile_workers)
        for r in rows:
            if r["variant"] == "transformers":
                from freetoken_jax.bench.hf_baseline import transformers_decode

                keep(transformers_decode(args.model, r["B"], args.prompt_len, args.gen_len, r["slots_gb"], args.dtype, bench.log))
            else:
                by_decode = getattr(args, "prompt_by_decode", False) and r["variant"] != "layer"
                keep(bench.decode(**r, prompt_by_decode=by_decode, balance=args.q is None))  # a q asked for stays
        if add_speedups(out["rows"]):
            write()
        cols = [("strategy", "strategy", ""), ("batch", "B", "d"), ("slots_gb", "slots GB", "g"), ("routing_skew", "skew", "g"),
                ("tokens_per_s", "tok/s", ".1f"), ("ms_per_token", "ms/tok", ".2f"), ("ttft_ms", "TTFT ms", ".0f"),
                ("hit_rate", "hit", ".3f"), ("gb_fetched_per_token", "GB/tok", ".3f"), ("q", "q", ".2f"),
                ("ratio_to_bound", "of bound", ".2f"), ("host_thread_ms_per_step", "host ms", ".2f"),
                ("handoff_window_us", "window us", ".0f"), ("outside_windows_us_per_layer", "outside us/L", ".1f"),
                ("x_naive", "x naive", ".2f")]  # fmt: skip
    else:
        for skew in args.routing_skew:
            for n in args.prompt_len:
                for chunk in args.chunk:
                    for s in args.strategy:
                        for split in hybrid_qs if s == "hybrid" else [q]:
                            keep(bench.prefill(s, n, split, args.slots_gb[0], chunk, skew))
        cols = [("strategy", "strategy", ""), ("routing_skew", "skew", "g"), ("prompt_len", "prompt", "d"), ("chunk", "chunk", "d"), ("chunks", "chunks", "d"),
                ("tokens_per_s", "tok/s", ".0f"),
                ("ttft_ms", "TTFT ms", ".0f"), ("pcie_bound_ms", "bound ms", ".0f"), ("ratio_to_bound", "of bound", ".2f"),
                ("first_token", "first", "d"), ("first_margin", "margin", ".3f")]  # fmt: skip
    print(table(out["rows"], cols))
    if getattr(args, "plot", None):
        plot(out["rows"], args.plot, plot_title(out))
    return out
