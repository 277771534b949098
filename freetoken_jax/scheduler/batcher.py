"""The generation loop: continuous batching over one `ModelRunner`, with no thread of its own.

Requests (`RequestHandle`) are `submit`ted into a waiting queue; each `step()` (1) takes
cancellations, (2) admits waiting requests into free decode rows up to `running_limit`
(reusing the longest cached prefix from the radix tree, taking KV pages for the rest, evicting
unused cached prefixes when short), (3) dispatches one decode step for every decoding row and
then reads the tokens of the step before it (the device stays one step ahead of the host),
(4) runs one prefill chunk for up to `prefill_rows` admitted rows, oldest first, and (5) finishes
rows that stopped, returning their pages (full pages of their sequence go to the radix tree).
Tokens and the end of each request are put on the request's own queue as `Event`s.

Two drivers: `Scheduler` calls `step()` from its loop thread for serving; `FreeTokenEngine`'s
`generate` / `generate_batch` call it in the caller's thread until their requests are done. The
decode step always runs all `max_batch` rows (inactive ones masked) over the full page table,
so it compiles once; prefill compiles once per (rows, chunk) bucket.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.memory.kv_cache import RUN_AHEAD, window_lookback
from freetoken_jax.memory.kv_pages import OutOfPages
from freetoken_jax.runtime import buckets
from freetoken_jax.runtime.runner import ModelRunner, RebuildFailed
from freetoken_jax.runtime.sampling import GenerationParams, RequestError, sampling_row, sampling_rows
from freetoken_jax.runtime.steps import DecodeBatch, PrefillBatch
from freetoken_jax.scheduler.grammar import fill_masks
from freetoken_jax.scheduler.radix import RadixCache

# Decode steps the device may run ahead of the host while no running request can stop on a
# sampled token (each ends by its length): reading tokens one step behind left the H200 idle
# between hybrid steps of ~20 ms (Qwen3-30B-A3B shape, 16 GB of slots, skew 1: 22-29 ms per
# step against 19.8 ms when the host does not wait; benchmarks/RESULTS.md).
LENGTH_ONLY_AHEAD = 3


class Busy(RuntimeError):
    """Requests are running; retry, or ask to drain first."""


@dataclasses.dataclass
class Event:
    kind: str  # "token", "done", "error"
    token: int | None = None
    logprobs: tuple | None = None  # token: (its log-probability, [(token, log-probability)] most likely first) if asked
    reason: str | None = None  # done: "stop", "length", "cancelled"
    usage: dict | None = None
    message: str | None = None


class RequestHandle:
    """A submitted request: iterate `events()`; `cancel()` frees its pages at the next step."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, prompt: list[int], params: GenerationParams, grammar=None, after: RequestHandle | None = None):
        self.id = next(self._ids)
        self.prompt, self.params = prompt, params
        self.grammar = grammar  # a `grammar.Constraint` its tokens must follow, or None
        # another choice of the same prompt: this one is admitted once that one's prompt is in the
        # prefix cache (or it has finished), and reuses its KV pages
        self.after = after
        self.published = False  # its prompt's full pages are in the prefix cache
        self.queue: queue.Queue[Event] = queue.Queue()
        self.cancelled = threading.Event()
        self.generated: list[int] = []
        # with `params.prompt_logprobs`: (token, its log-probability, [(token, log-probability)]
        # most likely first) of each prompt token after the first, all there before its first event
        self.prompt_logprobs: list[tuple] = []
        self.prefix_hit_tokens = 0
        self.finished = False  # set by the batcher when its last event is queued
        self.sampling = None  # its row of the sampling arrays, made when admitted
        self.notify = None  # called (on the loop thread) after each event is queued, if set

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, ev: Event) -> None:
        self.queue.put(ev)
        if self.notify is not None:
            try:
                self.notify()
            except RuntimeError:  # the front end's event loop has closed: the queue still holds the event
                pass

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
    ring: list[int]  # its ring in the sliding layers' pool (`kv_cache.ring_pages`; empty without)
    nodes: list  # locked radix nodes of the cached prefix
    start: int  # tokens already in the cache (cached prefix + prefilled chunks)
    stops: frozenset
    decoding: bool = False
    full: bool = False  # sampled by the full sampler: its first token too (its last prompt token is fed to a decode step)

    @property
    def prefill_end(self) -> int:
        """Where prefilling stops: the prompt's end, or its last token for `full` rows."""
        return len(self.handle.prompt) - self.full


def _fresh_metrics() -> dict:
    return dict(requests=0, requests_submitted=0, requests_finished=0, requests_cancelled=0, prefix_hit_tokens=0, prompt_tokens=0, prefilled_tokens=0, generated_tokens=0,
                decode_steps=0, prefill_seconds=0.0, decode_seconds=0.0, rebuilds=0)  # fmt: skip


class Batcher:
    """Rows, page table and prefix cache of one runner; see the module docstring. `lock` guards
    the waiting queue when another thread submits (the scheduler's)."""

    def __init__(self, runner: ModelRunner, *, prefix_cache: bool = True, prefill_rows: int = 1, lock=None, prompt_by_decode=False):
        """`prompt_by_decode`: feed prompts through the decode step, one token per step, instead
        of prefilling them (`bench --prompt-by-decode`: no prefill executable to compile)."""
        self.runner = runner
        self.prefix_cache, self.prompt_by_decode = prefix_cache and not prompt_by_decode, prompt_by_decode
        self.prefill_rows = self._own_prefill_rows = max(1, min(prefill_rows, runner.rows))
        self.lock = lock or contextlib.nullcontext()
        self.driver: str | None = None  # who steps it, when not the engine's own callers (`claim`)
        self.waiting: collections.deque[RequestHandle] = collections.deque()
        self.admitting = True  # False while a resize drains the running rows
        self._geometry()
        self.metrics = _fresh_metrics()
        # decode steps dispatched and not yet read: (their tokens, [(row, handle)] to emit)
        self._inflight: collections.deque[tuple] = collections.deque()

    def _geometry(self) -> None:
        ecfg = self.runner.engine_config
        self.B, self.page_size = ecfg.max_batch, ecfg.page_size
        self.rows: list[_Row | None] = [None] * self.B
        P, self.R = self.runner.tables
        self.table = np.zeros((self.B, P), np.int32)
        self.ring = np.zeros((self.B, self.R), np.int32) if self.R else None  # rows' rings, as `table`
        lookback = window_lookback(self.runner.model_config, self.page_size) if self.R else 0
        self.radix = RadixCache(ecfg.page_size, lookback) if self.prefix_cache else None
        self._batch_key, self._batch = None, None  # the last decode batch put on the device
        self._ones = None  # `_all_tokens`

    def reset_metrics(self) -> None:
        self.metrics = _fresh_metrics()

    def claim(self, driver: str, *, prefill_rows: int, lock) -> None:
        """Hands the loop to `driver` (a scheduler thread) with its prefill batching and the lock
        its submitting threads take; the engine's own `generate` refuses work until `release`."""
        if self.driver is not None:
            raise RuntimeError(f"a {self.driver} already drives this engine")
        if not self.idle():
            raise Busy("the engine is generating; claim it when idle")
        self.driver, self.prefill_rows, self.lock = driver, max(1, min(prefill_rows, self.B)), lock

    def release(self) -> None:
        self.driver, self.prefill_rows, self.lock = None, self._own_prefill_rows, contextlib.nullcontext()

    # Requests ----------------------------------------------------------------------------------------
    def check(self, prompt: Sequence[int], p: GenerationParams) -> list[int]:
        """The prompt as ints once the request is known to be servable (raises `RequestError`)."""
        r = self.runner
        if r.failed:
            raise RequestError(f"the engine is in a failed state: {r.failed}")
        ids = p.check(prompt, r.model_config.vocab_size, r.engine_config.max_context)
        if p.prompt_logprobs is not None and self.prompt_by_decode:
            raise RequestError("prompt log-probabilities come from the prefill; this batcher feeds prompts through the decode step")
        need, pool = r.pages.pages_for(len(ids) + p.max_new_tokens), r.pages.num_pages - 1
        if need > pool:
            raise RequestError(f"this request needs {need} KV pages; the pool has {pool} in all")
        return ids

    def submit(self, h: RequestHandle) -> None:
        """Queues a checked request (`check`)."""
        with self.lock:
            self.waiting.append(h)
            self.metrics["requests_submitted"] += 1

    def idle(self) -> bool:
        """No request waiting or running and no decode step in flight."""
        with self.lock:
            waiting = bool(self.waiting)
        return not waiting and not self._inflight and all(r is None for r in self.rows)

    def running(self) -> int:
        return sum(r is not None for r in self.rows)

    def running_limit(self) -> int:
        """Requests that may run at once: `max_running` when set; under offload / hybrid, the
        rows whose routed experts for one step fit the slot cache (each row routes to top_k
        experts in each MoE layer; with more rows a step evicts what the next one needs again);
        otherwise `max_batch`."""
        given = self.runner.engine_config.max_running
        if given is not None:
            return min(given, self.B)
        slots = self.runner.slots
        if slots is None:
            return self.B
        cfg = self.runner.model_config
        return max(1, min(self.B, slots.num_slots // (cfg.top_k * cfg.num_moe_layers)))

    # The loop --------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One iteration (module docstring); returns whether there was work. The decode step is
        dispatched before the prefill chunk: rows whose prompt the chunk ends decode from the
        next iteration on."""
        self._cancellations()
        if self.admitting:
            self._admit()
        busy = self._decode()
        return self._prefill() or busy

    def fail_all(self, message: str) -> None:
        """Ends every running request with an error (the loop keeps serving the rest)."""
        self._inflight.clear()
        for i, r in enumerate(self.rows):
            if r is not None:
                self._finish(r.handle, Event("error", message=message))
                self._release(i, cache_prefix=False)

    def drop_prefixes(self) -> None:
        """Empties the prefix cache (its KV was computed by what is about to change)."""
        if self.radix is not None:
            self._free(*self.radix.evict(self.radix.cached_pages))

    def _free(self, pages: list[int], ring_pages: list[int] = ()) -> None:
        """Returns pages to the shared pool and ring-pool pages to theirs."""
        self.runner.pages.release(pages)
        if ring_pages:
            self.runner.ring_pool.release(ring_pages)

    def flush(self) -> None:
        """Reads a decode step still in flight once no row decodes (its tokens are dropped)."""
        while self._inflight and not any(r is not None and r.decoding for r in self.rows):
            self._decode()

    def _cancellations(self) -> None:
        with self.lock:
            gone = [h for h in self.waiting if h.cancelled.is_set()]
            for h in gone:
                self.waiting.remove(h)
        for h in gone:
            self._done(h, "cancelled")
        for i, r in enumerate(self.rows):
            if r is not None and r.handle.cancelled.is_set():
                self._done(r.handle, "cancelled")
                self._release(i, cache_prefix=True)

    def _admit(self) -> None:
        pages, limit = self.runner.pages, self.running_limit()
        while self.running() < limit:
            with self.lock:
                # oldest first, but a later choice of a prompt waits for the first one's prefill
                h = next((w for w in self.waiting if w.after is None or w.after.published or w.after.finished or self.radix is None), None)
                if h is None:
                    return
            try:  # what the request brings into the shared step: its failure is its own
                eos = self.runner.model_config.eos_token_ids
                h.sampling = sampling_row(h.params, len(h.prompt), eos)
                stops = h.params.stop_set(eos)
            except Exception as e:  # noqa: BLE001
                with self.lock:
                    self.waiting.remove(h)
                self._finish(h, Event("error", message=f"bad request parameters: {type(e).__name__}: {e}"))
                continue
            scored = h.params.prompt_logprobs is not None  # computes every prompt position: nothing read from the cache
            nodes = self.radix.match(h.prompt, max_pages=(len(h.prompt) - 1) // self.page_size) if self.radix and not scored else []
            cached = [n.page for n in nodes]
            total = pages.pages_for(len(h.prompt) + h.params.max_new_tokens)
            need = total - len(cached)
            if need > pages.free_pages and self.radix is not None:
                self._free(*self.radix.evict(need - pages.free_pages))
            try:
                own = pages.allocate(need * self.page_size)
                try:
                    ring = self._take_ring(min(self.R, total))
                except OutOfPages:
                    pages.release(own)
                    raise
            except OutOfPages:
                if self.radix is not None:
                    self.radix.unlock(nodes)
                return  # wait for running requests to finish
            with self.lock:
                self.waiting.remove(h)
            row = self.rows.index(None)
            hit = len(cached) * self.page_size
            h.prefix_hit_tokens = hit
            self.metrics["requests"] += 1
            self.metrics["prefix_hit_tokens"] += hit
            self.metrics["prompt_tokens"] += len(h.prompt)
            full = h.params.processed or h.grammar is not None
            self.rows[row] = r = _Row(h, cached + own, ring, nodes, hit, stops, full=full)
            r.decoding = self.prompt_by_decode or hit >= r.prefill_end
            self.table[row] = 0
            self.table[row, : len(cached) + len(own)] = cached + own
            if self.R:
                self.ring[row] = 0
                self.ring[row, : len(ring)] = ring
                # the window of the cached prefix, from the tree's pages into the ring
                back = range(max(0, len(nodes) - self.radix.lookback), len(nodes)) if nodes else range(0)
                self.runner.copy_ring_pages([nodes[j].wpage for j in back], [ring[j % self.R] for j in back])

    def _prefill(self) -> bool:
        """One chunk of up to `prefill_rows` rows still in their prompts, oldest first."""
        todo = sorted((r.handle.id, i) for i, r in enumerate(self.rows) if r is not None and not r.decoding)[: self.prefill_rows]
        if not todo:
            return False
        t0 = time.perf_counter()
        idx = [i for _, i in todo]
        rows = [self.rows[i] for i in idx]
        Bp = buckets.batch_bucket(len(rows), self.prefill_rows)
        T = buckets.chunk_bucket(max(r.prefill_end - r.start for r in rows), self.runner.engine_config.chunk)
        segs = [r.handle.prompt[r.start : min(r.start + T, r.prefill_end)] for r in rows]

        def padded(a):  # the chunk's rows of a table, then padding rows of page 0
            return np.concatenate([a[idx], np.zeros((Bp - len(idx), a.shape[1]), np.int32)])

        table, ring = padded(self.table), None if self.ring is None else padded(self.ring)
        sampling = sampling_rows([r.handle.sampling for r in rows] + [None] * (Bp - len(rows)))
        scored = [r.handle.params.prompt_logprobs is not None for r in rows]
        targets = [r.handle.prompt[r.start + 1 : r.start + 1 + len(seg)] if sc else None for r, seg, sc in zip(rows, segs, scored)]
        batch = PrefillBatch.chunk(segs, [r.start for r in rows], table, T, sampling, ring, targets if any(scored) else None)
        first = self.runner.prefill(batch)
        if any(scored):
            self._prompt_records(rows, targets)
        ends = np.full(Bp, self.B, np.int32)  # rows whose prompt this chunk ends (padding: B, dropped)
        lengths = np.zeros(Bp, np.int32)
        for b, (i, r, seg) in enumerate(zip(idx, rows, segs)):
            r.start += len(seg)
            self.metrics["prefilled_tokens"] += len(seg)
            if r.start >= r.prefill_end:
                self._publish(r)
            if r.full and r.start >= r.prefill_end:
                r.decoding = True  # its last prompt token goes through the decode step, which samples what follows
            elif r.start >= len(r.handle.prompt):
                ends[b], lengths[b] = i, len(r.handle.prompt)
        if (ends < self.B).any():
            self.runner.set_rows(ends, first, lengths)
            toks = np.asarray(first)
            for b in np.flatnonzero(ends < self.B):
                self.rows[ends[b]].decoding = True
                self._emit(int(ends[b]), int(toks[b]))
        self.metrics["prefill_seconds"] += time.perf_counter() - t0
        return True

    def _prompt_records(self, rows: list[_Row], targets: list) -> None:
        """Adds a scored chunk's log-probabilities to its rows' `prompt_logprobs` (a read of the
        step's result: the host waits for this chunk)."""
        lp = self.runner.prompt_logprobs
        chosen, ids, top = (np.asarray(a) for a in (lp.chosen_B, lp.top_ids_BN, lp.top_BN))
        for b, (r, tgt) in enumerate(zip(rows, targets)):
            if tgt is None:
                continue
            n = r.handle.params.prompt_logprobs
            r.handle.prompt_logprobs += [
                (int(t), float(chosen[b, j]), [(int(ids[b, j, k]), float(top[b, j, k])) for k in range(n)]) for j, t in enumerate(tgt)
            ]

    def _publish(self, r: _Row) -> None:
        """Puts a prefilled prompt's full pages in the prefix cache while its request runs (the
        row keeps them locked), so that other choices of the same prompt reuse them."""
        h = r.handle
        if self.radix is None or h.published:
            return
        k = r.start // self.page_size  # pages wholly written
        path = self.radix.match(h.prompt, max_pages=k, whole=True)  # locked while ring pages are taken
        if k > len(r.nodes) and [n.page for n in path] == r.pages[: len(path)]:  # not cached meanwhile by another request
            wpages = [None] * k
            if self.R:  # copies of the window's pages: the ring goes on to be written
                back = [j for j in range(max(0, k - self.radix.lookback), k) if j >= len(path) or path[j].wpage is None]
                copies = self._take_ring(len(back), fail_ok=True)
                if len(copies) < len(back):  # a window in part cannot be continued
                    self._free([], copies)
                    back, copies = [], []
                self.runner.copy_ring_pages([r.ring[j % self.R] for j in back], copies)
                for j, c in zip(back, copies):
                    wpages[j] = c
            _, wleft = self.radix.insert(h.prompt[: k * self.page_size], r.pages[:k], wpages)
            self._free([], wleft)
            self.radix.unlock(r.nodes)
            r.nodes = self.radix.match(h.prompt, max_pages=k, whole=True)
        self.radix.unlock(path)
        h.published = True

    def _decode(self) -> bool:
        """Dispatches the next decode step, then emits the tokens of the steps before it, keeping
        the device ahead of the host's emitting, finishing and admitting: one step while some
        running request can stop on a token it samples, `LENGTH_ONLY_AHEAD` steps while every
        one ends by its length alone (nothing then waits on the tokens). A row whose request ends
        on an earlier step's token has run a step too many; its token is dropped (its KV write
        lands past the cached prefix in pages the stream order protects).

        A step with rows that ask for more than temperature, top-k and top-p goes in two halves
        (`ModelRunner.decode_logits`, `sample`). While a running request follows a grammar, the
        model half is dispatched, the previous step's tokens are emitted (advancing the grammars)
        and the masks computed while it runs, then the sampling half is dispatched with them."""
        t0 = time.perf_counter()
        pending = collections.Counter(id(h) for _, _, entries in self._inflight for _, h in entries)
        feeding = np.array([r is not None and r.decoding and r.start < len(r.handle.prompt) for r in self.rows])
        active = feeding | np.array([
            r is not None and r.decoding and len(r.handle.generated) + pending[id(r.handle)] < r.handle.params.max_new_tokens
            for r in self.rows
        ])  # fmt: skip
        if feeding.any():  # this step's input is the row's next prompt token, not its last sample
            idx = np.flatnonzero(feeding)
            rows = [self.rows[i] for i in idx]
            self.runner.set_rows(idx, jnp.asarray([r.handle.prompt[r.start] for r in rows], jnp.int32), [r.start for r in rows])
            first = [(i, r) for i, r in zip(idx, rows) if r.full and r.start == len(r.handle.prompt) - 1]
            if first:  # this step samples their first token: counts start from the prompt
                self.runner.set_counts([int(i) for i, _ in first], [r.handle.prompt for _, r in first])
            for r in rows:
                r.start += 1
        busy = bool(active.any())
        rows = [self.rows[i] for i in np.flatnonzero(active)]
        masked = any(r.handle.grammar is not None for r in rows)
        if masked:  # the masks need every earlier token: read them while the model half runs
            batch = self._decode_batch(active)
            logits = self.runner.decode_logits(batch)
            self._read(0, active)
            self._dispatched(self.runner.sample(logits, batch, self._masks(active), self._logprobs(rows)), active)
        else:
            if busy:
                batch = self._decode_batch(active)
                if any(r.full for r in rows):  # penalties, bias, log-probabilities: the full sampler
                    nxt = self.runner.sample(self.runner.decode_logits(batch), batch, self._all_tokens(), self._logprobs(rows))
                else:
                    nxt = self.runner.decode(batch, filters=any(r.handle.params.filters for r in rows))
                self._dispatched(nxt, active)
            stoppable = any(r is not None and r.stops for r in self.rows)
            keep = (1 if stoppable else LENGTH_ONLY_AHEAD) if busy else 0
            busy = self._read(keep, active) or busy
        if busy:
            self.metrics["decode_seconds"] += time.perf_counter() - t0
        return busy

    @staticmethod
    def _logprobs(rows) -> bool:
        return any(r.handle.params.logprobs is not None for r in rows)

    def _all_tokens(self) -> jax.Array:
        """A bitmask that allows every token in every row (on the device, made once)."""
        if self._ones is None:
            V = self.runner.model_config.vocab_size
            self._ones = jnp.full((self.B, (V + 31) // 32), -1, jnp.int32)
        return self._ones

    def _dispatched(self, tokens, active: np.ndarray) -> None:
        """Records a dispatched step: its tokens (and log-probabilities) and the rows that emit them."""
        self.metrics["decode_steps"] += 1
        # a step that fed a prompt token other than the last samples nothing of the request's
        emits = active & np.array([r is not None and r.start >= len(r.handle.prompt) for r in self.rows])
        self._inflight.append((tokens, self.runner.logprobs, [(int(i), self.rows[i].handle) for i in np.flatnonzero(emits)]))

    def _read(self, keep: int, active: np.ndarray) -> bool:
        """Emits the tokens of dispatched steps until `keep` remain in flight (one step's per call
        once nothing is dispatched); returns whether any was read."""
        read = False
        while len(self._inflight) > keep:
            toks, lp, entries = self._inflight.popleft()
            read = True
            if entries:
                toks = np.asarray(toks)
                if any(h.params.logprobs is not None for _, h in entries):
                    lp = jax.tree.map(np.asarray, lp)
            for i, h in entries:
                r = self.rows[i]
                if r is not None and r.handle is h:  # not finished, cancelled or failed meanwhile
                    self._emit(i, int(toks[i]), lp if h.params.logprobs is not None else None)
            if not active.any():
                break
        return read

    def _masks(self, active: np.ndarray) -> jax.Array:
        """The grammar bitmask of every row for the step being sampled (all ones where a row has
        no grammar, or samples nothing of its request)."""
        V = self.runner.model_config.vocab_size
        mask = np.full((self.B, (V + 31) // 32), -1, np.int32)
        rows = [(r.handle.grammar, int(i)) for i, r in ((i, self.rows[i]) for i in np.flatnonzero(active))
                if r is not None and r.handle.grammar is not None and r.start >= len(r.handle.prompt)]  # fmt: skip
        if rows:
            fill_masks(mask, rows)
        return jnp.asarray(mask)

    def _decode_batch(self, active: np.ndarray) -> DecodeBatch:
        """The decode step's page table, active rows and sampling arrays on the device, made again
        only when the rows or the active set change: a step of the same rows puts nothing new on
        the device (on a busy host, e.g. beside the CPU executor, every transfer is dispatch time)."""
        key = (tuple(r.handle.id if r else 0 for r in self.rows), active.tobytes())
        if self._batch_key != key:
            self._batch_key = key
            self._batch = DecodeBatch(
                jnp.asarray(self.table),
                jnp.asarray(active),
                sampling_rows([r.handle.sampling if r else None for r in self.rows]),
                None if self.ring is None else jnp.asarray(self.ring),
            )
        return self._batch

    def _emit(self, i: int, token: int, lp=None) -> None:
        r = self.rows[i]
        h = r.handle
        h.generated.append(token)
        self.metrics["generated_tokens"] += 1
        if lp is not None:
            n = h.params.logprobs
            lp = (float(lp.chosen_B[i]), [(int(t), float(v)) for t, v in zip(lp.top_ids_BN[i, :n], lp.top_BN[i, :n])])
        h.put(Event("token", token=token, logprobs=lp))
        reason = "stop" if token in r.stops else "length" if len(h.generated) >= h.params.max_new_tokens else None
        if h.grammar is not None and reason != "stop" and not h.grammar.accept(token):
            self._finish(h, Event("error", message=f"the output left its grammar at token {token}: {h.grammar.error()}"))
            self._release(i, cache_prefix=True)
            return
        if h.grammar is not None and reason is None and h.grammar.finished():
            reason = "stop"  # nothing may follow (a grammar that ends without an end-of-sequence token)
        if reason:
            self._done(h, reason)
            self._release(i, cache_prefix=True)

    def _done(self, h: RequestHandle, reason: str) -> None:
        usage = dict(prompt_tokens=len(h.prompt), completion_tokens=len(h.generated), prefix_hit_tokens=h.prefix_hit_tokens)
        self.metrics["requests_cancelled" if reason == "cancelled" else "requests_finished"] += 1
        self._finish(h, Event("done", reason=reason, usage=usage))

    @staticmethod
    def _finish(h: RequestHandle, ev: Event) -> None:
        h.finished = True
        h.put(ev)

    def _release(self, i: int, cache_prefix: bool) -> None:
        r = self.rows[i]
        self.rows[i] = None
        self.table[i] = 0
        if self.R:
            self.ring[i] = 0
        pages, ring = r.pages, r.ring
        if self.radix is not None:
            self.radix.unlock(r.nodes)
            if cache_prefix:
                # KV exists for the prompt and every generated token but the last.
                written = (r.handle.prompt + r.handle.generated[:-1])[: r.start + max(0, len(r.handle.generated) - 1)]
                wpages = self._ring_window(r, len(written))
                pages, wleft = self.radix.insert(written, r.pages, wpages)
                adopted = {w for w in wpages if w is not None} - set(wleft)
                ring = [p for p in r.ring if p not in adopted]
            else:
                pages = r.pages[len(r.nodes) :]
        held = {n.page for n in r.nodes}
        self._free([p for p in pages if p not in held], ring)

    def _take_ring(self, n: int, *, fail_ok: bool = False) -> list[int]:
        """`n` pages of the ring pool, the prefix cache's window pages evicted for them when
        short; `fail_ok`: as many as there are, else `OutOfPages` when short."""
        pool = self.runner.ring_pool
        if not n:
            return []
        if n > pool.free_pages and self.radix is not None:
            pool.release(self.radix.evict_wpages(n - pool.free_pages))
        n = min(n, pool.free_pages) if fail_ok else n
        return pool.allocate(n * self.page_size) if n else []

    def _ring_window(self, r: _Row, written: int) -> list[int | None]:
        """Per full page of a row's `written` tokens, the ring page still holding it for the
        prefix cache to adopt (the window's last pages), else None. Decode steps dispatched
        past the end may have written up to `RUN_AHEAD` positions more."""
        k = written // self.page_size
        out: list[int | None] = [None] * k
        if not self.R or not written:
            return out
        newest = (written - 1 + RUN_AHEAD) // self.page_size  # the last page those steps may have reached
        for j in range(max(0, k - self.radix.lookback, newest - self.R + 1), k):
            out[j] = r.ring[j % self.R]
        return out

    # Resize ----------------------------------------------------------------------------------------
    def status(self) -> dict:
        return dict(self.runner.status(), prefix_cached_pages=self.radix.cached_pages if self.radix else 0,
                    rebuilds=self.metrics["rebuilds"])  # fmt: skip

    def resize(self, expert_slots: int | None = None, kv_pages: int | None = None, prepared: tuple | None = None) -> dict:
        """Resizes the runner's slots and/or KV pages while no request runs (`ModelRunner.resize`;
        `prepared`: its `prepare_resize` for the same sizes); cached prefixes survive a growing
        pool. Returns the new status."""
        if self._inflight or self.running():
            raise Busy("requests are running; retry when idle")
        radix = self.radix
        try:
            kept = self.runner.resize(expert_slots, kv_pages, keep_held_pages=radix is not None, prepared=prepared)
        except RebuildFailed:  # the pool was rebuilt empty: cached prefixes are gone with it
            self._geometry()
            raise
        self._geometry()
        if kept:
            self.radix = radix
        self.metrics["rebuilds"] += 1
        return self.status()


__all__ = ["Batcher", "Busy", "Event", "RequestHandle"]
