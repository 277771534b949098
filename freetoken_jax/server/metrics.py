"""Prometheus metrics of the HTTP server (`GET /metrics`): per-request counters and latency
histograms recorded by the handlers, and, read at each scrape, every number the engine and the
scheduler report (`get_metrics()`: queue depth, running rows, expert hit rate, bytes fetched,
the CPU share, KV pages and slots, resizes, ...) as a gauge `freetoken_<name>`."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


class _EngineCollector:
    def __init__(self, service):
        self.service = service

    def collect(self):
        s = self.service
        values = {**s.engine.get_metrics(), **s.scheduler.get_metrics()}
        for name, v in sorted(values.items()):
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            yield GaugeMetricFamily("freetoken_" + re.sub(r"[^a-zA-Z0-9_]", "_", name), f"engine metric {name}", value=float(v))


class ServerMetrics:
    def __init__(self, service):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("freetoken_http_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("freetoken_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("freetoken_generation_tokens", "tokens generated for finished requests", registry=r)
        self.ttft = Histogram("freetoken_time_to_first_token_seconds", "request arrival to first token", buckets=_LATENCY, registry=r)
        self.itl = Histogram("freetoken_inter_token_latency_seconds", "mean time between a request's tokens", buckets=_LATENCY, registry=r)
        self.e2e = Histogram("freetoken_request_duration_seconds", "request arrival to its last byte", buckets=_LATENCY, registry=r)
        r.register(_EngineCollector(service))

    def finished(self, arrived: float, out, now: float) -> None:
        """Records one generation (an `Output` that has its last event)."""
        u = out.usage or {}
        self.prompt_tokens.inc(u.get("prompt_tokens", 0))
        n = u.get("completion_tokens", 0)
        self.generation_tokens.inc(n)
        if out.first_token_at is not None:
            self.ttft.observe(out.first_token_at - arrived)
            if n > 1:
                self.itl.observe((now - out.first_token_at) / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
