"""Continuous batching over one engine.

Threads and queues: callers (server threads) `submit` requests into a bounded queue and read
each request's events from its own queue; one loop thread owns the engine and its device state.
Every loop iteration (1) takes cancellations, (2) admits queued requests into free decode rows
up to `running_limit` (reusing the longest cached prefix from the radix tree, taking KV pages for the rest, evicting
unused cached prefixes when short), (3) runs one prefill chunk of the oldest admitted request,
(4) dispatches one decode step for every decoding row and then reads the tokens of the step
before it (the device stays one step ahead of the host), and (5) finishes rows that stopped,
returning their pages (full pages of their sequence go to the radix tree). The decode step always runs
`max_batch` rows (inactive ones masked), so it compiles once; prefill compiles once per chunk
bucket.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.engine import FreeTokenEngine, GenerationParams, RequestError, sampling_rows
from freetoken_jax.memory.kv_pages import OutOfPages
from freetoken_jax.runtime import buckets
from freetoken_jax.runtime.steps import DecodeBatch, DecodeState, PrefillBatch, shapes
from freetoken_jax.scheduler.radix import RadixCache

log = logging.getLogger("freetoken_jax")


class Overloaded(RuntimeError):
    """The request queue is full; try again later."""


@dataclasses.dataclass
class Event:
    kind: str  # "token", "done", "error"
    token: int | None = None
    reason: str | None = None  # done: "stop", "length", "cancelled"
    usage: dict | None = None
    message: str | None = None


class RequestHandle:
    """A submitted request: iterate `events()`; `cancel()` frees its pages at the next step."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, prompt: list[int], params: GenerationParams):
        self.id = next(self._ids)
        self.prompt, self.params = prompt, params
        self.queue: queue.Queue[Event] = queue.Queue()
        self.cancelled = threading.Event()
        self.generated: list[int] = []
        self.prefix_hit_tokens = 0

    def cancel(self) -> None:
        self.cancelled.set()

    def events(self, timeout: float | None = None):
        while True:
            ev = self.queue.get(timeout=timeout)
            yield ev
            if ev.kind in ("done", "error"):
                return

    def result(self, timeout: float | None = None) -> tuple[list[int], str]:
        toks, reason = [], None
        for ev in self.events(timeout):
            if ev.kind == "token":
                toks.append(ev.token)
            elif ev.kind == "done":
                reason = ev.reason
            else:
                raise RequestError(ev.message)
        return toks, reason


@dataclasses.dataclass
class _Row:
    handle: RequestHandle
    pages: list[int]  # every page of the sequence, cached prefix first
    nodes: list  # locked radix nodes of the cached prefix
    start: int  # tokens already in the cache (cached prefix + prefilled chunks)
    decoding: bool = False
    stops: frozenset = frozenset()


class Scheduler:
    def __init__(self, engine: FreeTokenEngine, *, max_queue: int = 64, prefix_cache: bool = True):
        self.engine = engine
        ecfg = engine.engine_config
        self.B, self.P, self.page_size = ecfg.max_batch, ecfg.pages_per_sequence, ecfg.page_size
        self.radix = RadixCache(ecfg.page_size) if prefix_cache else None
        self.waiting: collections.deque[RequestHandle] = collections.deque()
        self.max_queue = max_queue
        self.rows: list[_Row | None] = [None] * self.B
        self.table = np.zeros((self.B, self.P), np.int32)
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = False
        self.failed: str | None = None  # set when the engine can no longer serve correctly
        self.control: queue.Queue = queue.Queue()  # (fn, reply queue) run on the loop thread when idle
        self.draining = False
        self.warm_workers = 0  # set by `warm_up`
        self.metrics = dict(requests_submitted=0, requests_finished=0, requests_cancelled=0, requests_rejected=0, prefix_hit_tokens=0,
                            prompt_tokens=0, generated_tokens=0, decode_steps=0)  # fmt: skip
        self._inflight: tuple | None = None  # (tokens of the decode step in flight, its [(row, handle)])
        self.state = DecodeState.start(engine.cache, np.zeros(self.B), np.zeros(self.B), engine.slots)
        engine.cache = engine.slots = None  # owned by the scheduler from now on
        self._set_row = jax.jit(
            lambda st, row, tok, pos: dataclasses.replace(
                st, tokens_B=st.tokens_B.at[row].set(tok), positions_B=st.positions_B.at[row].set(pos)
            ),
            donate_argnums=(0,),
        )
        limit = self.running_limit()
        if limit < self.B:
            log.info("scheduler: at most %d of %d requests run at once: the routed experts of more rows would not fit %d expert "
                     "slots (EngineConfig.max_running, serve --max-running, overrides)", limit, self.B, self.state.experts.num_slots)  # fmt: skip
        self.thread = threading.Thread(target=self._loop, name="freetoken-scheduler", daemon=True)
        self.thread.start()

    def warm_up(self, workers: int = 4) -> dict:
        """Compiles, before any request arrives, the steps serving will run: the decode step and
        the prefill step of every chunk bucket (on `workers` threads, with the arguments placed
        as the loop places them, so the loop finds them compiled). Call it before submitting;
        returns {"steps": n, "seconds": s}."""
        import concurrent.futures

        eng, t0 = self.engine, time.perf_counter()
        state = shapes(self.state, committed=True)  # as `DecodeState.start` and every step leave it
        jobs = [(eng.decode, (eng.weights, state, DecodeBatch.shapes(self.B, self.P)))]
        chunk = eng.engine_config.prefill_chunk
        for T in sorted({buckets.chunk_bucket(n, chunk) for n in range(1, chunk + 1)}):
            batch = PrefillBatch.shapes(1, T, self.P)
            step = eng.prefill_step_for(eng.weights, T, self.state.experts)
            args = (eng.weights, state.cache, batch) + (() if step is eng._prefill else (state.experts,))
            jobs.append((step, args))
        log.info("warm-up: compiling %d steps on %d threads", len(jobs), workers)
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            list(pool.map(lambda job: job[0].lower(*job[1]).compile(), jobs))
        self.warm_workers = workers  # a resize warms the new geometry up too
        out = dict(steps=len(jobs), seconds=time.perf_counter() - t0)
        log.info("warm-up: %d steps compiled in %.1f s", out["steps"], out["seconds"])
        return out

    def running_limit(self) -> int:
        """Requests that may run at once: `max_running` when set; under offload / hybrid, the
        rows whose routed experts for one step fit the slot cache (each row routes to top_k
        experts in each MoE layer; with more rows a step evicts what the next one needs again);
        otherwise `max_batch`."""
        given = self.engine.engine_config.max_running
        if given is not None:
            return min(given, self.B)
        experts = self.state.experts
        if experts is None:
            return self.B
        cfg = self.engine.model_config
        return max(1, min(self.B, experts.num_slots // (cfg.top_k * cfg.num_moe_layers)))

    # Client side ----------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: GenerationParams) -> RequestHandle:
        """Validates and queues a request (raises `RequestError` or `Overloaded`)."""
        ids = self.engine.check_request(prompt, params)
        need = self.engine.pages.pages_for(len(ids) + params.max_new_tokens)
        if need > self.engine.pages.num_pages - 1:
            raise RequestError(f"this request needs {need} KV pages; the pool has {self.engine.pages.num_pages - 1} in all")
        h = RequestHandle(ids, params)
        with self.lock:
            if self.failed:
                raise Overloaded(f"the engine is in a failed state: {self.failed}")
            if self.stopping or self.draining:
                raise Overloaded("the server is shutting down" if self.stopping else "the engine is being resized; retry shortly")
            if len(self.waiting) >= self.max_queue:
                self.metrics["requests_rejected"] += 1
                raise Overloaded(f"{len(self.waiting)} requests are already waiting; try again later")
            self.waiting.append(h)
            self.metrics["requests_submitted"] += 1
        self.wake.set()
        return h

    def get_metrics(self) -> dict:
        with self.lock:
            m = dict(self.metrics)
            m["running"] = sum(r is not None for r in self.rows)
            m["running_limit"] = self.running_limit()
            m["waiting"] = len(self.waiting)
        m["kv_pages_free"] = self.engine.pages.free_pages
        m["prefix_cached_pages"] = self.radix.cached_pages if self.radix else 0
        return m

    def idle(self) -> bool:
        with self.lock:
            return not self.waiting and all(r is None for r in self.rows)

    def shutdown(self, timeout: float = 30.0) -> None:
        with self.lock:
            self.stopping = True
        self.wake.set()
        self.thread.join(timeout)

    # Loop -----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.lock:
                if self.stopping and not self.waiting and all(r is None for r in self.rows):
                    return
            busy = False
            try:
                self._cancellations()
                self._control()
                if not self.draining:
                    self._admit()
                busy |= self._prefill_one()
                busy |= self._decode()
            except Exception as e:  # noqa: BLE001 - fail the affected requests, keep serving
                self._fail_all(f"internal error: {type(e).__name__}: {e}")
            if not busy:
                self.wake.wait(0.05)
                self.wake.clear()

    def _control(self) -> None:
        """Runs queued control functions (cache rebuilds) once no request is running."""
        if self.control.empty() or any(r is not None for r in self.rows):
            return
        fn, reply = self.control.get()
        try:
            reply.put((True, fn()))
        except Exception as e:  # noqa: BLE001 - the caller gets the exception
            reply.put((False, e))
        finally:
            with self.lock:
                self.draining = not self.control.empty()

    def rebuild_cache(
        self, expert_slots: int | None = None, kv_pages: int | None = None, *, drain: bool = False, timeout: float = 600.0
    ) -> dict:
        """Resizes expert slots and/or KV pages (see `elastic`). Without `drain`, answers `Busy` if
        any request is running or waiting; with it, stops admitting, lets running requests finish,
        then rebuilds (waiting requests run afterwards)."""
        from freetoken_jax.scheduler import elastic

        with self.lock:
            busy = bool(self.waiting) or any(r is not None for r in self.rows)
            if busy and not drain:
                raise elastic.Busy("requests are running; retry when idle or pass drain=True")
            self.draining = True
        reply: queue.Queue = queue.Queue()
        self.control.put((lambda: self._rebuild_warm(expert_slots, kv_pages), reply))
        self.wake.set()
        ok, value = reply.get(timeout=timeout)
        self.wake.set()
        if not ok:
            raise value
        return value

    def _rebuild_warm(self, expert_slots, kv_pages) -> dict:
        """`elastic.rebuild`, then, on a server that was warmed up, the new geometry's steps
        compiled ahead as well (a failure there is logged: the resize itself has succeeded)."""
        from freetoken_jax.scheduler import elastic

        out = elastic.rebuild(self, expert_slots, kv_pages)
        if self.warm_workers:
            try:
                out["warm_up"] = self.warm_up(self.warm_workers)
            except Exception as e:  # noqa: BLE001 - steps then compile when first needed
                log.warning("warm-up after the resize failed (%s: %s); steps compile when first needed", type(e).__name__, e)
                out["warm_up"] = f"failed: {type(e).__name__}: {e}"
        return out

    def _fail_all(self, message: str) -> None:
        for i, r in enumerate(self.rows):
            if r is not None:
                r.handle.queue.put(Event("error", message=message))
                self._release(i, cache_prefix=False)

    def _cancellations(self) -> None:
        with self.lock:
            gone = [h for h in self.waiting if h.cancelled.is_set()]
            for h in gone:
                self.waiting.remove(h)
        for h in gone:
            self._finish_event(h, "cancelled")
        for i, r in enumerate(self.rows):
            if r is not None and r.handle.cancelled.is_set():
                self._finish_event(r.handle, "cancelled")
                self._release(i, cache_prefix=True)

    def _admit(self) -> None:
        pages, limit = self.engine.pages, self.running_limit()
        while sum(r is not None for r in self.rows) < limit:
            with self.lock:
                if not self.waiting:
                    return
                h = self.waiting[0]
            nodes = []
            if self.radix is not None:
                nodes = self.radix.match(h.prompt, max_pages=(len(h.prompt) - 1) // self.page_size)
            cached = [n.page for n in nodes]
            need = pages.pages_for(len(h.prompt) + h.params.max_new_tokens) - len(cached)
            if need > pages.free_pages and self.radix is not None:
                for p in self.radix.evict(need - pages.free_pages):
                    pages.release([p])
            try:
                own = pages.allocate((need) * self.page_size)
            except OutOfPages:
                if self.radix is not None:
                    self.radix.unlock(nodes)
                return  # wait for running requests to finish
            with self.lock:
                self.waiting.popleft()
            row = self.rows.index(None)
            hit = len(cached) * self.page_size
            h.prefix_hit_tokens = hit
            self.metrics["prefix_hit_tokens"] += hit
            self.metrics["prompt_tokens"] += len(h.prompt)
            stops = frozenset(h.params.stop_token_ids) | (
                frozenset() if h.params.ignore_eos else frozenset(self.engine.model_config.eos_token_ids)
            )
            self.rows[row] = _Row(h, cached + own, nodes, hit, stops=stops)
            self.table[row] = 0
            self.table[row, : len(cached) + len(own)] = cached + own

    def _prefill_one(self) -> bool:
        todo = [(i, r) for i, r in enumerate(self.rows) if r is not None and not r.decoding]
        if not todo:
            return False
        i, r = min(todo, key=lambda ir: ir[1].handle.id)
        eng, prompt = self.engine, r.handle.prompt
        T = buckets.chunk_bucket(len(prompt) - r.start, eng.engine_config.prefill_chunk)
        seg = prompt[r.start : r.start + T]
        tok = np.zeros((1, T), np.int32)
        tok[0, : len(seg)] = seg
        valid = np.zeros((1, T), bool)
        valid[0, : len(seg)] = True
        pos = np.arange(r.start, r.start + T, dtype=np.int32)[None]
        batch = PrefillBatch(
            jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(valid), jnp.asarray(self.table[i : i + 1]), sampling_rows([r.handle.params])
        )
        first, cache, experts = eng.prefill(eng.weights, self.state.cache, batch, self.state.experts)
        self.state = dataclasses.replace(self.state, cache=cache, experts=experts)
        r.start += len(seg)
        if r.start >= len(prompt):
            self.state = self._set_row(self.state, i, first[0], len(prompt))
            r.decoding = True
            self._emit(i, int(np.asarray(first)[0]))
        return True

    def _decode(self) -> bool:
        """Dispatches the next decode step, then emits the tokens of the step before it: the
        device runs one step ahead of the host's emitting, finishing and admitting. A row whose
        request ends on the earlier step's token runs one step too many; its token is dropped
        (its KV write lands past the cached prefix in pages the stream order protects)."""
        earlier, self._inflight = self._inflight, None
        ahead = {id(h) for _, h in earlier[1]} if earlier else set()
        active = np.array([
            r is not None and r.decoding and len(r.handle.generated) + (id(r.handle) in ahead) < r.handle.params.max_new_tokens
            for r in self.rows
        ])  # fmt: skip
        if active.any():
            eng = self.engine
            batch = DecodeBatch(
                jnp.asarray(self.table), jnp.asarray(active), sampling_rows([r.handle.params if r else None for r in self.rows])
            )
            nxt, self.state = eng.decode(eng.weights, self.state, batch)
            self.metrics["decode_steps"] += 1
            self._inflight = (nxt, [(int(i), self.rows[i].handle) for i in np.flatnonzero(active)])
        if earlier is not None:
            toks = np.asarray(earlier[0])
            for i, h in earlier[1]:
                r = self.rows[i]
                if r is not None and r.handle is h:  # not finished, cancelled or failed meanwhile
                    self._emit(i, int(toks[i]))
        return bool(active.any()) or earlier is not None

    def _emit(self, i: int, token: int) -> None:
        r = self.rows[i]
        h = r.handle
        h.generated.append(token)
        self.metrics["generated_tokens"] += 1
        h.queue.put(Event("token", token=token))
        reason = None
        if token in r.stops:
            reason = "stop"
        elif len(h.generated) >= h.params.max_new_tokens:
            reason = "length"
        if reason:
            self._finish_event(h, reason)
            self._release(i, cache_prefix=True)

    def _finish_event(self, h: RequestHandle, reason: str) -> None:
        usage = dict(prompt_tokens=len(h.prompt), completion_tokens=len(h.generated), prefix_hit_tokens=h.prefix_hit_tokens)
        self.metrics["requests_cancelled" if reason == "cancelled" else "requests_finished"] += 1
        h.queue.put(Event("done", reason=reason, usage=usage))

    def _release(self, i: int, cache_prefix: bool) -> None:
        r = self.rows[i]
        self.rows[i] = None
        self.table[i] = 0
        pages = r.pages
        if self.radix is not None:
            self.radix.unlock(r.nodes)
            if cache_prefix:
                # KV exists for the prompt and every generated token but the last.
                written = (r.handle.prompt + r.handle.generated[:-1])[: r.start + max(0, len(r.handle.generated) - 1)]
                pages = self.radix.insert(written, r.pages)
            else:
                pages = r.pages[len(r.nodes) :]
        self.engine.pages.release([p for p in pages if p not in {n.page for n in r.nodes}])


def wait_idle(s: Scheduler, timeout: float = 30.0) -> bool:
    t = time.time() + timeout
    while time.time() < t:
        if s.idle():
            return True
        time.sleep(0.01)
    return False


__all__ = ["Event", "Overloaded", "RequestHandle", "Scheduler", "wait_idle"]
