"""FreeTokenEngine: builds a model's weights and device state and generates tokens.

Construction chooses the strategy (`auto`: `runtime/choice.py`), plans device memory, loads or
makes the weights (experts straight into host banks under the host-bank strategies) and hands
them to a `ModelRunner` (`runtime/runner.py`), the one owner of the device state. `generate`,
`generate_batch` drive the same `Batcher` (`scheduler/batcher.py`) that the serving
`Scheduler` drives from its thread: validation, admission with the prefix cache, chunked
prefill, decode one step ahead of the host, stop tokens. `logits` scores a prompt.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import jax.numpy as jnp
import numpy as np

from freetoken_jax.config import ConfigError, EngineConfig, MoEModelConfig, Strategy
from freetoken_jax.memory.budget import (
    GB,
    choose_prefill_chunk,
    choose_prefill_load,
    device_memory_bytes,
    host_memory_available,
    pinned_host_limit,
    plan_memory,
    size,
)
from freetoken_jax.memory.kv_cache import cache_bytes
from freetoken_jax.models import abstract_graphdef, build_abstract, is_expert_path, jnp_dtype, random_params
from freetoken_jax.models.stacked import weights_layout
from freetoken_jax.quant.banks import quantize_params, quantizing
from freetoken_jax.runtime.choice import probe_key, remember_probe, resolve_auto
from freetoken_jax.runtime.experts import ExpertBackend, make_backend
from freetoken_jax.runtime.offload import host_bank_placer, host_memory_kind, to_host_banks
from freetoken_jax.runtime.runner import ModelRunner
from freetoken_jax.runtime.sampling import GenerationParams, RequestError
from freetoken_jax.runtime.steps import Weights
from freetoken_jax.scheduler.batcher import Batcher, Busy, Event, RequestHandle

log = logging.getLogger("freetoken_jax")


def _pairs(logit_bias) -> tuple:
    """A logit bias given as {token: bias} or (token, bias) pairs, as `GenerationParams` keeps it."""
    items = logit_bias.items() if isinstance(logit_bias, dict) else logit_bias or ()
    return tuple((int(t), float(b)) for t, b in items)


def _tokenizer_or_refuse(tokenizer, path: str, required: bool):
    """`tokenizer`, or a `CheckpointError` when a checkpoint without one must have one."""
    if tokenizer is None and required:
        from freetoken_jax.checkpoint.safetensors_io import CheckpointError

        raise CheckpointError(f"{path} has no tokenizer (tokenizer.json, or a GGUF vocabulary); text prompts need one")
    return tokenizer


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
        model_path: str | None = None,
        routing_skew: float | None = None,
    ):
        """`params`: a parameter state to use; `load(place)`: a loader to call once the memory plan
        is accepted; neither: seeded random weights (`EngineConfig.seed`). `model_path`: the
        checkpoint directory it came from. `routing_skew` (benchmarks): every token's experts are
        drawn from a Zipf(skew) popularity instead of the router's (`runtime/routing.py`), from
        the start (the `auto` probe included)."""
        ecfg = engine_config or EngineConfig()
        cfg = model_config.with_expert_format(ecfg.expert_format)
        quantize = cfg.expert_format != model_config.expert_format  # on load, a layer at a time
        self.model_config, self.tokenizer, self.name = cfg, tokenizer, name
        self._grammars = None
        self.model_path = model_path
        itemsize = jnp.dtype(jnp_dtype(ecfg.dtype)).itemsize
        dense = sum(
            math.prod(v.get_value().shape) * v.get_value().dtype.itemsize
            for p, v in build_abstract(cfg, ecfg.dtype).flat_state()
            if not is_expert_path(p)
        )
        self.strategy_reason = f"moe_strategy={ecfg.moe_strategy.value!r} was asked for"
        probe: tuple[float, ...] = ()  # hybrid's q to measure when "auto" picks hybrid from a profile: checked by a decode probe
        if ecfg.moe_strategy is Strategy.AUTO:
            self._probe_key = probe_key(cfg, ecfg)
            ecfg, self.strategy_reason, probe = resolve_auto(cfg, ecfg, dense, cache_bytes(cfg, ecfg, itemsize), itemsize)
            log.info("moe_strategy auto -> %s: %s", ecfg.moe_strategy.value, self.strategy_reason)
        plan = plan_memory(cfg, ecfg, dense, cache_bytes(cfg, ecfg, itemsize), itemsize, device_memory_bytes())
        if ecfg.prefill_chunk is None:
            chunk, why = choose_prefill_chunk(cfg, ecfg, plan)
            chosen = ecfg.replace(prefill_chunk=chunk)
            try:  # rings (sliding layers) are sized from the chunk: planned again
                plan = plan_memory(cfg, chosen, dense, cache_bytes(cfg, chosen, itemsize), itemsize, device_memory_bytes())
            except ConfigError:
                chosen, why = ecfg.replace(prefill_chunk=ecfg.chunk), "the default: the rings of a larger chunk would not fit"
            ecfg = chosen
            log.info("prefill chunk %d: %s", ecfg.prefill_chunk, why)
        prefill_load, why = choose_prefill_load(cfg, ecfg, plan, host_memory_kind() is not None)
        if prefill_load != ecfg.prefill_load:
            ecfg = ecfg.replace(prefill_load=prefill_load)
            log.info("prefill load %s: %s", prefill_load, why)
        log.info("memory plan: %s", plan.describe())
        host = ecfg.moe_strategy.experts_on_host
        place = None
        if host:
            avail = host_memory_available()
            if avail is not None and plan.all_experts_bytes > avail:
                raise ConfigError(f"the expert banks need {size(plan.all_experts_bytes)} of host RAM but only {size(avail)} is available")
            cap = pinned_host_limit()
            if cap is not None and plan.all_experts_bytes > cap:
                raise ConfigError(
                    f"the expert banks need {size(plan.all_experts_bytes)} of pinned host memory, over XLA's cap of "
                    f"{cap / GB:.0f} GiB: set XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB higher (it must be set before jax starts; "
                    "keep it below the RAM, since the pool may pin all of it)"
                )
            place = host_bank_placer()
        graphdef, _ = abstract_graphdef(cfg, ecfg.dtype)
        owned = params is None  # the engine's own arrays: stacking may delete them as it goes
        if params is None and load is not None:
            params = load(quantizing(place, cfg.expert_format) if quantize else place)
        elif params is None:
            params = random_params(cfg, ecfg.dtype, ecfg.seed, place)
        else:
            if quantize:
                params = quantize_params(params, cfg.expert_format)
            if host:
                params = to_host_banks(params)
        experts = make_backend(ecfg, params)
        if routing_skew is not None:
            from freetoken_jax.runtime.routing import SyntheticRouting

            experts = SyntheticRouting(experts, float(routing_skew))
        weights = Weights.of(params, graphdef, stacked=weights_layout() == "stacked", experts=not host, consume=owned)
        del params  # stacked: the per-layer arrays go (a caller's own arrays are left to the caller)
        self.runner = ModelRunner(cfg, ecfg, weights, experts, plan)
        self.batcher = Batcher(self.runner, prefix_cache=ecfg.prefix_cache, prefill_rows=ecfg.max_batch)
        if probe:
            self._check_hybrid_choice(ecfg.auto_probe_steps, probe)

    # What the runner owns, for reading -------------------------------------------------------------
    @property
    def engine_config(self) -> EngineConfig:
        return self.runner.engine_config

    @property
    def plan(self):
        return self.runner.plan

    @property
    def weights(self) -> Weights:
        return self.runner.weights

    @property
    def experts(self) -> ExpertBackend:
        return self.runner.experts

    @property
    def pages(self):
        return self.runner.pages

    @property
    def failed(self) -> str | None:
        return self.runner.failed

    def use(self, experts: ExpertBackend, *, over_slots: bool = False, balance: bool = True) -> None:
        """Computes routed experts with `experts` from now on (same slot geometry: hybrid at
        another q, offload over hybrid's slots, a benchmark's synthetic routing; `over_slots`,
        `balance`: see `ModelRunner.use`); cached prefixes are dropped, their KV having been
        computed the old way."""
        if self.batcher.driver is not None or not self.batcher.idle():
            raise Busy("the engine is generating; change its expert backend when idle")
        self.runner.use(experts, over_slots=over_slots, balance=balance)
        self.batcher.drop_prefixes()

    def _decode_rate(self, steps: int, probe: int = 0) -> float:
        """Decode tokens/s of the current backend over `steps` steps (batch 1, sampled, after one
        step that may compile). Each `probe` decodes its own prompt and samples: a probe that
        repeated the one before would find that one's experts in the slots."""
        V, ctx = self.model_config.vocab_size, self.engine_config.max_context
        rng = np.random.default_rng([self.engine_config.seed, probe])
        prompt = [int(t) for t in rng.integers(0, V, max(1, min(8, ctx - 3)))]
        steps = max(1, min(steps, ctx - len(prompt) - 2))
        tokens = self.generate(prompt, max_new_tokens=steps + 2, temperature=1.0, seed=1 + probe, ignore_eos=True)
        next(tokens), next(tokens)  # prefill, then the first decode step (compiles)
        t0 = time.perf_counter()
        n = sum(1 for _ in tokens)
        return n / max(time.perf_counter() - t0, 1e-9)

    def _check_hybrid_choice(self, steps: int, qs: tuple[float, ...]) -> None:
        """Measures hybrid at each q of `qs` (`choice.resolve_auto`'s: the recommended q first;
        one executable: q is traced) and keeps the fastest q; then offload over the same slots
        and cpu (every expert on the CPU; the slots untouched while it is measured), and runs the
        fastest of the three. Choosing cpu frees the slot cache. Every measurement decodes its own tokens
        (`_decode_rate`'s probe, `ExpertBackend.for_probe`): on an H100, the same 16 steps of a
        synthetic routing repeated at four values of q, the first ran 171 tok/s and the three
        after it 196-213, where the steady rate was 177 (benchmarks/RESULTS.md)."""
        hybrid, n = self.runner.experts, len(qs)
        log.info("moe_strategy auto: a decode probe of %d steps each under hybrid at %d value%s of q, offload and cpu "
                 "(the first of each strategy compiles its step)", steps, n, "" if n == 1 else "s")  # fmt: skip

        def rate(what: str, i: int) -> float:  # one measurement, said as it ends (the probe takes minutes on a large model)
            r = self._decode_rate(steps, i)
            log.info("moe_strategy auto: probe %d of %d: %s %.1f tok/s", i + 1, n + 2, what, r)
            return r

        rates: dict[float, float] = {}
        for i, q in enumerate(qs):
            self.use(hybrid.with_q(q).for_probe(i), balance=False)  # each probe at its own q
            rates[q] = rate(f"hybrid at q {q:g}", i)
        q = max(rates, key=rates.get)  # ties keep the first measured: the recommendation
        hybrid = hybrid.with_q(q)
        measured = {"hybrid": rates[q]}
        self.use(hybrid.as_offload().for_probe(n))
        measured["offload"] = rate("offload", n)
        self.use(hybrid.as_cpu().for_probe(n + 1), over_slots=True)
        measured["cpu"] = rate("cpu", n + 1)
        best = max(measured, key=lambda k: (measured[k], k == "hybrid", k == "offload"))  # ties: hybrid, then offload
        if len(rates) > 1:
            tried = ", ".join(f"{k:g}: {v:.1f}" for k, v in sorted(rates.items()))
            self.strategy_reason += f"; q probe (tok/s at q {tried}): q = {q:g}"
        figures = ", ".join(f"{k} {v:.1f} tok/s" for k, v in measured.items())
        self.strategy_reason += f"; decode probe: {figures}: {best}"
        if best == "cpu":
            self.batcher.drop_prefixes()  # the probe's prompt pages, before the resize frees the pool
            self.runner.switch_to_slotless(hybrid.as_cpu())
        else:
            self.use(hybrid if best == "hybrid" else hybrid.as_offload(), over_slots=True)
        log.info("moe_strategy auto: %s", self.strategy_reason)
        remember_probe(self._probe_key, dict(strategy=best, q=q, reason=figures + f" at q = {q:g}"))
        self.batcher.reset_metrics()  # the probe's requests are not the user's

    # Construction ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, engine_config: EngineConfig | None = None, *, verify: bool = False, require_tokenizer: bool = False
    ) -> FreeTokenEngine:
        """Loads an FTW directory, a Hugging Face safetensors directory of a supported family, a
        GGUF file (or any part of a split set; `docs/LOADING.md`), an engine-native directory, or
        `"demo"` (the built-in demo model, in the package). `verify` checks every FTW tensor's
        checksum while loading; `require_tokenizer` refuses a checkpoint without one
        (`tokenizer.json`) before any weight is read."""
        from freetoken_jax.checkpoint.convert import load_ftw
        from freetoken_jax.checkpoint.ftw import FTWReader, is_ftw
        from freetoken_jax.checkpoint.hf import HFSource, load_params
        from freetoken_jax.models.generic import config_from_json
        from freetoken_jax.tokenizer import load_tokenizer

        path = os.fspath(path)
        if path == "demo":
            from freetoken_jax.demo import demo_path

            path = demo_path()
        ecfg = engine_config or EngineConfig()
        name = os.path.basename(os.path.normpath(path))
        if path.endswith(".gguf"):
            return cls._from_gguf(path, ecfg, require_tokenizer)
        if not os.path.isdir(path):
            from freetoken_jax.checkpoint.safetensors_io import CheckpointError

            raise CheckpointError(f"no checkpoint directory at {path!r} (pass a directory with config.json, a .gguf file, or 'demo')")
        tokenizer = _tokenizer_or_refuse(load_tokenizer(path), path, require_tokenizer)
        if is_ftw(path):
            with FTWReader(path) as r:
                cfg = config_from_json(r.index.get("model_config") or {})
            load = lambda place: load_ftw(path, ecfg.dtype, place, verify=verify)[1]  # noqa: E731
            return cls(cfg, ecfg, load=load, tokenizer=tokenizer, name=name, model_path=path)
        src = HFSource(path, ecfg.expert_format)
        src.check(list(build_abstract(src.cfg, ecfg.dtype).flat_state()))  # every shape, before anything is allocated
        load = functools.partial(load_params, src, ecfg.dtype)
        return cls(src.cfg, ecfg, load=load, tokenizer=tokenizer, name=name, model_path=path)

    @classmethod
    def _from_gguf(cls, path: str, ecfg: EngineConfig, require_tokenizer: bool = False) -> FreeTokenEngine:
        """A GGUF file or split set: config and tokenizer from its metadata; routed experts as
        stored where their type is a native format, re-quantized only to an `expert_format` that
        the caller names."""
        from freetoken_jax.checkpoint.gguf_file import GGUFCheckpoint, GGUFParams, read_config
        from freetoken_jax.checkpoint.hf import load_params
        from freetoken_jax.tokenizer import gguf_tokenizer

        ck = GGUFCheckpoint(path)
        _, cfg, requantize = read_config(ck, ecfg.expert_format)
        tokenizer = _tokenizer_or_refuse(gguf_tokenizer(ck), path, require_tokenizer)  # before any weight is read
        if requantize:
            print(f"{path}: re-quantizing the routed experts to {ecfg.expert_format} while loading", file=sys.stderr)
        params = GGUFParams(ck, cfg, requantize)
        params.check(list(build_abstract(cfg, ecfg.dtype).flat_state()))  # every shape, before anything is allocated
        load = functools.partial(load_params, params, ecfg.dtype)
        name = re.sub(r"(-\d{5}-of-\d{5})?\.gguf$", "", os.path.basename(path))
        return cls(cfg, ecfg, load=load, tokenizer=tokenizer, name=name, model_path=path)

    def export_orbax(self, path: str) -> str:
        """Writes the parameters as an Orbax checkpoint (for JAX users who fine-tune), with the
        tokenizer's files beside them; `python -m freetoken_jax.convert` turns it back into FTW
        (tokenizer included)."""
        import shutil

        from freetoken_jax.checkpoint.convert import export_orbax
        from freetoken_jax.tokenizer import HFTokenizer

        export_orbax(self.model_config, self.weights.host_params, path)
        if self.model_path and os.path.isdir(self.model_path):  # its tokenizer and template files as they are
            for f in os.listdir(self.model_path):
                if f.startswith(("tokenizer", "special_tokens_map", "chat_template")) and os.path.isfile(os.path.join(self.model_path, f)):
                    shutil.copy2(os.path.join(self.model_path, f), os.path.join(path, f))
        elif isinstance(self.tokenizer, HFTokenizer):  # a GGUF file's vocabulary
            self.tokenizer.save(path)
        return path

    # Generation -----------------------------------------------------------------------------------
    def check_request(self, prompt: str | Sequence[int], p: GenerationParams) -> list[int]:
        """The prompt (text, or token ids) as ints if the request can be served (else
        `RequestError`, nothing touched)."""
        return self.batcher.check(self._ids(prompt), p)

    def _ids(self, prompt: str | Sequence[int]) -> Sequence[int]:
        if not isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: give the prompt as token ids")
        return self.tokenizer.encode(prompt)

    def _submit(self, prompts: Sequence[Sequence[int]], ps: Sequence[GenerationParams], grammars=None) -> list[RequestHandle]:
        if self.batcher.driver is not None:
            raise RequestError(f"a {self.batcher.driver} serves this engine; submit requests through it")
        checked = [self.check_request(pr, p) for pr, p in zip(prompts, ps)]  # all checked before any is queued
        handles = [RequestHandle(ids, p, g) for ids, p, g in zip(checked, ps, grammars or [None] * len(ps))]
        for h in handles:
            self.batcher.submit(h)
        return handles

    @property
    def grammars(self):
        """The grammar compiler of this model's tokenizer (`scheduler.grammar.Grammars`), made on first use."""
        if self._grammars is None:
            from freetoken_jax.scheduler.grammar import Grammars

            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: grammars need one")
            cfg = self.model_config
            self._grammars = Grammars(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        return self._grammars

    def _grammar(self, json_schema=None, regex=None, lark=None, choice=None):
        """A fresh `Constraint` for at most one of a JSON schema, a regex, a Lark grammar or a
        choice of strings."""
        given = [(k, v) for k, v in (("json_schema", json_schema), ("regex", regex), ("lark", lark), ("choice", choice)) if v is not None]
        if len(given) > 1:
            raise RequestError("give at most one of json_schema, regex, lark and choice")
        if not given:
            return None
        from freetoken_jax.scheduler.grammar import GrammarError

        kind, spec = given[0]
        g = self.grammars
        try:
            return g.constraint(getattr(g, kind)(spec))
        except GrammarError as e:
            raise RequestError(str(e)) from e

    def _drive(self, handles: list[RequestHandle]) -> Iterator[tuple[int, Event]]:
        """Steps the batcher in this thread, yielding (index, event) of `handles` as they come; an
        error event raises `RequestError`. A request still open when the caller stops listening
        (or an error raised) is cancelled and its pages released."""
        try:
            while True:
                for i, h in enumerate(handles):
                    while not h.queue.empty():
                        ev = h.queue.get_nowait()
                        if ev.kind == "error":
                            raise RequestError(ev.message)
                        yield i, ev
                if all(h.finished and h.queue.empty() for h in handles):
                    self.batcher.flush()
                    return
                self.batcher.step()
        finally:
            if not all(h.finished for h in handles):
                for h in handles:
                    h.cancel()
                while not self.batcher.idle():
                    self.batcher.step()

    def generate(self, prompt_ids: str | Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, *, json_schema=None, regex: str | None = None,
                 lark: str | None = None, choice: Sequence[str] | None = None, logit_bias=None, **controls) -> Iterator[int]:  # fmt: skip
        """Yields the generated token ids one by one as they are produced (the stop token, if
        one ends the generation, is yielded last); the prompt is text (encoded with the model's
        tokenizer) or token ids. Cached prefixes of earlier requests are reused. `controls`:
        the other fields of `GenerationParams` (min_p, penalties, min_tokens); `json_schema`,
        `regex`, `lark` or `choice` (strings, one of which the output is): a grammar the output
        follows."""
        p = GenerationParams(max_new_tokens, temperature, top_k, top_p, seed, tuple(stop_token_ids), ignore_eos,
                             logit_bias=_pairs(logit_bias), **controls)  # fmt: skip
        grammar = self._grammar(json_schema, regex, lark, choice)
        for _, ev in self._drive(self._submit([prompt_ids], [p], [grammar])):
            if ev.kind == "token":
                yield ev.token

    def stream_text(self, prompt: str | Sequence[int], max_new_tokens: int = 64, *, special: bool = False, **kw) -> Iterator[str]:
        """Yields the generated text as it completes: whole characters only (a character split
        across tokens comes once all its bytes are out), the end-of-sequence token left out.
        `special`: special tokens are text too (harmony's markers), the end-of-sequence tokens
        still left out. The other arguments are `generate`'s."""
        from freetoken_jax.server.text import TextStream

        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: use generate() with token ids")
        text = TextStream(self.tokenizer, [], special, frozenset(self.model_config.eos_token_ids) if special else frozenset())
        for t in self.generate(prompt, max_new_tokens, **kw):
            if delta := text.push(t)[0]:
                yield delta
        if delta := text.flush():
            yield delta

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, seed: int = 0, stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, *, json_schema=None,
                       regex: str | None = None, lark: str | None = None, choice: Sequence[str] | None = None, logit_bias=None,
                       **controls) -> list[list[int]]:  # fmt: skip
        """Generates for several prompts together (continuous batching, at most `max_batch` rows
        at once); row i is seeded with `seed + i`. The other arguments are `generate`'s."""
        ps = [
            GenerationParams(max_new_tokens, temperature, top_k, top_p, seed + i, tuple(stop_token_ids), ignore_eos,
                             logit_bias=_pairs(logit_bias), **controls)
            for i in range(len(prompts))
        ]  # fmt: skip
        grammars = [self._grammar(json_schema, regex, lark, choice) for _ in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        for i, ev in self._drive(self._submit(prompts, ps, grammars)):
            if ev.kind == "token":
                out[i].append(ev.token)
        return out

    # Scoring --------------------------------------------------------------------------------------
    def score(self, prompts: Sequence[str | Sequence[int]], on_done: Callable[[int], None] | None = None) -> list[np.ndarray]:
        """Each prompt's log-probabilities: entry i of prompt p's float32 array is token i + 1's
        after the tokens before it (`len(p) - 1` entries; the first token has none). The prompts
        are prefilled together (at most `max_batch` at once), their chunks scoring every position
        (`GenerationParams.prompt_logprobs`), so that no [length, vocab] array is held — the terms
        of a perplexity. Cached prefixes are not read (each prompt is computed whole). `on_done(i)`
        is called as prompt i's scores are complete."""
        ps = [GenerationParams(max_new_tokens=1, prompt_logprobs=0) for _ in prompts]
        handles = self._submit(prompts, ps)
        for i, ev in self._drive(handles):
            if ev.kind == "done" and on_done is not None:
                on_done(i)
        return [np.asarray([r[1] for r in h.prompt_logprobs], np.float32) for h in handles]

    def logits(self, token_ids: str | Sequence[int]) -> np.ndarray:
        """Float32 logits at every position of `token_ids`: `[len(token_ids), vocab]`."""
        ids = self.check_request(token_ids, GenerationParams(max_new_tokens=1))
        if not self.batcher.idle() or self.batcher.driver is not None:
            raise RequestError("the engine is generating; score when it is idle")
        return self.runner.score_prompt(ids)

    # Telemetry ------------------------------------------------------------------------------------
    def compilations(self) -> dict[str, int]:
        """Executables compiled so far per step kind (one per bucket)."""
        return self.runner.steps.compilations()

    def rebuild_runtime_cache(self, expert_slots: int | None = None, kv_pages: int | None = None) -> dict:
        """Resizes the expert slots and/or the KV page pool between generations, without reloading
        weights: the new geometry is validated (planner, compile, memory) before anything is freed,
        and a failure afterwards restores the old one (`ModelRunner.resize`). Slots start cold.
        Returns the new status. A server resizes through its scheduler (`Scheduler.rebuild_cache`)."""
        if self.batcher.driver is not None or not self.batcher.idle():
            raise Busy("a generation is running, or a scheduler owns this engine's caches (resize through it: Scheduler.rebuild_cache)")
        out = self.batcher.resize(expert_slots, kv_pages)
        del out["prefix_cached_pages"]
        return out

    def get_metrics(self) -> dict:
        m = dict(self.batcher.metrics)
        m["decode_tokens_per_second"] = m["generated_tokens"] / m["decode_seconds"] if m["decode_seconds"] else 0.0
        m["compilations"] = self.compilations()
        m["kv_pages_free"] = self.pages.free_pages
        m["kv_pages_total"] = self.pages.num_pages - 1
        ring = self.runner.ring_pool  # sliding layers' rings (`kv_cache.ring_pages`)
        m["ring_pages_free"], m["ring_pages_total"] = (ring.free_pages, ring.num_pages - 1) if ring else (0, 0)
        m["moe_strategy"] = self.engine_config.moe_strategy.value
        m["memory_plan"] = self.plan.describe()
        m["strategy_reason"] = self.strategy_reason
        m["expert_format"] = self.model_config.expert_format
        m["expert_bytes"] = self.plan.expert_bytes  # one routed expert as stored (its three projections)
        if self.runner.slots is not None:
            m.update(self.slot_cache_metrics())
        return m

    def slot_cache_metrics(self) -> dict:
        """Slot-cache telemetry (offload / hybrid): hit rates counted per distinct routed expert
        per layer step, experts and bytes fetched, slot occupancy."""
        c = self.runner.slots
        hits, misses = np.asarray(c.hits_L).astype(np.int64), np.asarray(c.misses_L).astype(np.int64)
        total = hits + misses
        ecfg = self.engine_config
        return dict(
            expert_slots=int(c.num_slots),
            slots_occupied=int((np.asarray(c.id_of_slot) >= 0).sum()),
            expert_hit_rate=float(hits.sum() / total.sum()) if total.sum() else 0.0,
            expert_hit_rate_per_layer=[float(h / t) if t else 0.0 for h, t in zip(hits, total)],
            experts_fetched=int(misses.sum()),
            bytes_fetched=int(misses.sum()) * self.plan.expert_bytes,
            experts_on_cpu=int(np.asarray(c.cpu_L).sum()),
            hybrid_q=ecfg.hybrid_q if ecfg.moe_strategy is Strategy.HYBRID else None,
        )
