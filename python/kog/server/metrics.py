"""Prometheus metrics: latency histograms and token counters updated per request, engine gauges
(requests, KV blocks) and prefix-cache counters read from AsyncEngine.stats() at scrape time.

Each app has its own registry, so several apps (tests) never share counters.
"""

from __future__ import annotations

import time
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kog.engine.async_engine import AsyncEngine

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5)


class ServerMetrics:
    """The app's metrics.

    Args:
        engine: read for the gauges at each scrape.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kog_time_to_first_token_seconds", "Arrival to first token of a request",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kog_inter_token_latency_seconds", "Time between two tokens of a sequence",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kog_e2e_request_latency_seconds", "Arrival to last token of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kog_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("kog_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("kog_requests", "Requests ended, by finish reason", ["finish_reason"], registry=r)
        r.register(_EngineCollector(engine))

    def render(self) -> bytes:
        """Every metric in the Prometheus text format."""
        return generate_latest(self.registry)

    def timer(self, num_prompt_tokens: int) -> RequestTimer:
        """Counts an accepted prompt and returns the timer of its request."""
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTimer(self)


class RequestTimer:
    """Times one engine request: feed it every update's token count as it arrives."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: float | None = None
        self.done = False

    def on_tokens(self, n_tokens: int) -> None:
        """Records n_tokens new tokens (from one step, possibly over several choices)."""
        if n_tokens <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.metrics.generation_tokens.inc(n_tokens)

    def finish(self, finish_reason: str | None) -> None:
        """Records the end of the request once (later calls are ignored)."""
        if self.done:
            return
        self.done = True
        self.metrics.e2e.observe(time.monotonic() - self.start)
        self.metrics.requests.labels(finish_reason or "abort").inc()


class _EngineCollector:
    """Reads AsyncEngine.stats() (a snapshot the loop thread takes after every step)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # computed at collect time; nothing to check for name clashes up front

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        kv = s["kv"]
        for name, doc, value in [
            ("kog_num_requests_running", "Requests with KV in the cache, decoding or prefilling", s["running"]),
            ("kog_num_requests_waiting", "Requests queued for admission", s["waiting"]),
            ("kog_kv_cache_usage_perc", "Fraction of KV blocks held by sequences (0..1)", s["kv_usage"]),
            ("kog_kv_blocks_used", "KV blocks held by sequences", kv["blocks_used"]),
            ("kog_kv_blocks_cached", "Free KV blocks still holding prefix-cache content", kv["blocks_cached"]),
            ("kog_kv_blocks_total", "KV blocks in the device pool", kv["num_blocks"]),
            ("kog_engine_accepting", "1 while new requests are accepted, 0 when draining or failed",
             int(s["accepting"] and not s["dead"])),
        ]:
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in [
            ("kog_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", kv["prefix_query_tokens"]),
            ("kog_prefix_cache_hits", "Prompt tokens found in the prefix cache", kv["prefix_hit_tokens"]),
            ("kog_prefix_cache_lookups", "Prefix-cache lookups (one per admitted sequence)", kv["prefix_queries"]),
            ("kog_prefill_tokens_computed", "Tokens computed by prefill (cache hits excluded, recomputation included)",
             s["prefill_tokens_computed"]),
        ]:
            yield CounterMetricFamily(name, doc, value=value)
