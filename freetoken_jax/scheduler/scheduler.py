"""Serving: the engine's `Batcher` driven from one loop thread.

Threads and queues: callers (server threads) `submit` requests — checked, then put in the
batcher's bounded waiting queue under `lock` — and read each request's events from its own
queue; the loop thread alone steps the batcher (`Batcher.step`: admit, prefill one chunk, decode
one step ahead, emit, release), so it alone touches the runner's device state. Control work
(cache resizes) is queued to the loop thread and runs once no request is running; while one
waits, admission stops (drain). An exception inside a step fails the running requests with its
message and the loop keeps serving.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from freetoken_jax.runtime.sampling import GenerationParams
from freetoken_jax.scheduler.batcher import Busy, Event, RequestHandle

if TYPE_CHECKING:
    from freetoken_jax.engine import FreeTokenEngine

log = logging.getLogger("freetoken_jax")


class Overloaded(RuntimeError):
    """The request queue is full; try again later."""


class Scheduler:
    """Serves one engine (which refuses its own `generate` meanwhile, until `shutdown`).
    `prefill_rows`: admitted prompts prefilled together in one chunk (1: one executable per
    chunk bucket to compile ahead)."""

    def __init__(self, engine: FreeTokenEngine, *, max_queue: int = 64, prefill_rows: int = 1):
        self.engine = engine
        self.lock = threading.RLock()  # the batcher takes it too, inside `submit`
        self.batcher = engine.batcher
        self.batcher.claim("scheduler", prefill_rows=prefill_rows, lock=self.lock)
        self.max_queue = max_queue
        self.wake = threading.Event()
        self.stopping = False
        self.control: queue.Queue = queue.Queue()  # (fn, reply queue) run on the loop thread when idle
        self.warm_workers, self.warm_scoring = 0, False  # set by `warm_up`
        self.rejected = 0
        limit = self.running_limit()
        if limit < self.batcher.B:
            log.info("scheduler: at most %d of %d requests run at once: the routed experts of more rows would not fit %d expert "
                     "slots (EngineConfig.max_running, serve --max-running, overrides)", limit, self.batcher.B,
                     engine.runner.slots.num_slots)  # fmt: skip
        self.thread = threading.Thread(target=self._loop, name="freetoken-scheduler", daemon=True)
        self.thread.start()

    @property
    def failed(self) -> str | None:
        """Why the engine can no longer serve correctly (a resize that could not be undone)."""
        return self.engine.failed

    @property
    def radix(self):
        return self.batcher.radix

    def warm_up(self, workers: int = 4, scoring: bool = False) -> dict:
        """Compiles, before any request arrives, the steps serving will run: the decode step and
        the prefill step of every chunk bucket (on `workers` threads, with the arguments placed
        as the loop places them, so the loop finds them compiled), and with `scoring` the prefill
        steps that score prompts (else the first such request of a chunk size compiles its step
        while the loop waits). Call it before submitting; returns {"steps": n, "seconds": s}."""
        out = self.engine.runner.warm_up(workers, self.batcher.prefill_rows, scoring)
        self.warm_workers, self.warm_scoring = workers, scoring  # a resize warms the new geometry up too
        return out

    def running_limit(self) -> int:
        return self.batcher.running_limit()

    # Client side ----------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: GenerationParams, grammar=None, after: RequestHandle | None = None) -> RequestHandle:
        """Validates and queues a request (raises `RequestError` or `Overloaded`); `grammar`: a
        `grammar.Constraint` its output follows; `after`: another choice of the same prompt whose
        KV pages it reuses (`RequestHandle.after`)."""
        if self.failed:
            raise Overloaded(f"the engine is in a failed state: {self.failed}")
        h = RequestHandle(self.batcher.check(prompt, params), params, grammar, after)
        with self.lock:
            if self.stopping or not self.batcher.admitting:
                raise Overloaded("the server is shutting down" if self.stopping else "the engine is being resized; retry shortly")
            if len(self.batcher.waiting) >= self.max_queue:
                self.rejected += 1
                raise Overloaded(f"{len(self.batcher.waiting)} requests are already waiting; try again later")
            self.batcher.submit(h)
        self.wake.set()
        return h

    def get_metrics(self) -> dict:
        b = self.batcher
        m = dict(b.metrics)
        m["requests_rejected"] = self.rejected
        with self.lock:
            m["running"] = b.running()
            m["waiting"] = len(b.waiting)
        m["running_limit"] = self.running_limit()
        m["kv_pages_free"] = self.engine.pages.free_pages
        m["prefix_cached_pages"] = b.radix.cached_pages if b.radix else 0
        return m

    def idle(self) -> bool:
        return self.batcher.idle()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Serves what was submitted, stops the loop and gives the engine back to its owner."""
        with self.lock:
            self.stopping = True
        self.wake.set()
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self.batcher.release()

    # Loop -----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            if self.stopping and self.batcher.idle():
                return
            busy = False
            try:
                busy = self._control()
                busy |= self.batcher.step()
            except Exception as e:  # noqa: BLE001 - fail the affected requests, keep serving
                self.batcher.fail_all(f"internal error: {type(e).__name__}: {e}")
            if not busy:
                self.wake.wait(0.05)
                self.wake.clear()

    def _control(self) -> bool:
        """Runs a queued control function (cache rebuilds) once no request is running."""
        if self.control.empty() or self.batcher.running():
            return False
        self.batcher.flush()
        fn, reply = self.control.get()
        try:
            reply.put((True, fn()))
        except Exception as e:  # noqa: BLE001 - the caller gets the exception
            reply.put((False, e))
        finally:
            with self.lock:
                self.batcher.admitting = self.control.empty()
        return True

    def rebuild_cache(
        self, expert_slots: int | None = None, kv_pages: int | None = None, *, drain: bool = False, timeout: float = 600.0
    ) -> dict:
        """Resizes expert slots and/or KV pages (`ModelRunner.resize`). The new geometry is
        validated and its decode step compiled first, while requests are still admitted and run
        (a refusal touches nothing). Then, without `drain`, answers `Busy` if any request is
        running or waiting; with it, stops admitting, lets running requests finish, and swaps
        (waiting requests run afterwards). The answer says how long admission was stopped
        (`refused_s`)."""
        if not drain and (self.batcher.waiting or self.batcher.running()):
            raise Busy("requests are running; retry when idle or pass drain=True")
        prepared = self.engine.runner.prepare_resize(expert_slots, kv_pages)
        with self.lock:
            busy = bool(self.batcher.waiting) or self.batcher.running() > 0
            if busy and not drain:
                raise Busy("requests are running; retry when idle or pass drain=True")
            self.batcher.admitting = False
        t0 = time.perf_counter()
        reply: queue.Queue = queue.Queue()
        self.control.put((lambda: self._rebuild_warm(expert_slots, kv_pages, prepared), reply))
        self.wake.set()
        ok, value = reply.get(timeout=timeout)
        self.wake.set()
        if not ok:
            raise value
        value["refused_s"] = round(time.perf_counter() - t0, 3)
        return value

    def status(self) -> dict:
        return self.batcher.status()

    def _rebuild_warm(self, expert_slots, kv_pages, prepared) -> dict:
        """The resize, then, on a server that was warmed up, the new geometry's steps compiled
        ahead as well (a failure there is logged: the resize itself has succeeded)."""
        out = self.batcher.resize(expert_slots, kv_pages, prepared)
        if self.warm_workers:
            try:
                out["warm_up"] = self.warm_up(self.warm_workers, self.warm_scoring)
            except Exception as e:  # noqa: BLE001 - steps then compile when first needed
                log.warning("warm-up after the resize failed (%s: %s); steps compile when first needed", type(e).__name__, e)
                out["warm_up"] = f"failed: {type(e).__name__}: {e}"
        return out


__all__ = ["Busy", "Event", "Overloaded", "RequestHandle", "Scheduler"]
