"""The server's /metrics: the worker's counters in Prometheus' text format, through
prometheus_client.

Each app has its own registry (a process may hold many apps: the tests do), and one
collector that reads the figures when scraped: the worker's totals and queue are plain
numbers its thread writes, safe to read from the event loop. The prompt cache itself is not
(prompt_cache.PromptCache is not thread-safe): its size comes from the two numbers the
worker's thread writes into its totals after each job, cancelled ones included.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .worker import Worker

PREFIX = "specmlx_"
CONTENT_TYPE = CONTENT_TYPE_LATEST  # what /metrics answers with


class ServerMetrics:
    """The Prometheus figures of one server.

    worker: the server's worker, whose totals, queue and prompt cache are reported."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def exposition(self) -> bytes:
        """The figures in Prometheus' text format (served as CONTENT_TYPE)."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        """The figures now (prometheus_client calls this on each scrape), in the order and
        under the names /metrics has always had."""
        t, worker = self.worker.totals, self.worker
        rows = [
            ("requests_total", "counter", "generations run", t.requests),
            ("requests_cancelled_total", "counter", "generations cancelled by the client", t.cancelled),
            ("requests_failed_total", "counter", "generations that failed", t.failed),
            ("requests_rejected_total", "counter", "requests refused with 503", t.rejected),
            ("prompt_tokens_total", "counter", "prompt tokens", t.prompt_tokens),
            ("prompt_cache_tokens_total", "counter", "prompt tokens served from the cache", t.cached_tokens),
            ("prompt_cache_hits_total", "counter", "requests that reused cached tokens", t.cache_hits),
            ("prompt_cache_bytes", "gauge", "bytes of KV caches kept", t.cache_bytes),
            ("prompt_cache_entries", "gauge", "sequences kept", t.cache_entries),
            ("prompt_cache_moved_tokens_total", "counter", "prompt tokens taken from cached runs moved to new positions (--cache-reuse)", t.moved_tokens),
            ("batch_rows", "gauge", "requests decoding together now", t.batch_rows),
            ("batch_rounds_total", "counter", "batched target passes (one a round, whatever the rows)", t.batch_rounds),
            ("batch_tree_rounds_total", "counter", "batched target passes that verified a token tree a row", t.batch_tree_rounds),
            ("tree_passes_total", "counter", "target passes that verified a token tree, per request", t.tree_rounds),
            ("generated_tokens_total", "counter", "tokens generated", t.generated),
            ("drafted_tokens_total", "counter", "tokens drafted", t.drafted),
            ("accepted_tokens_total", "counter", "drafts accepted", t.accepted),
            ("target_passes_total", "counter", "target passes, per request (a batched pass counts once a row)", t.rounds),
            ("acceptance_rate", "gauge", "accepted / drafted", _ratio(t.accepted, t.drafted)),
            ("tokens_per_pass", "gauge", "generated / target passes: per request, batched or not", _ratio(t.generated, t.rounds)),
            ("decode_tokens_per_second", "gauge", "generated / decode seconds", _ratio(t.generated, t.decode_s)),
            ("decode_seconds_total", "counter", "seconds spent decoding", t.decode_s),
            ("prefill_seconds_total", "counter", "seconds spent prefilling", t.prefill_s),
            ("queue_depth", "gauge", "requests waiting", worker.queued),
            ("busy", "gauge", "1 while a generation runs", int(worker.busy)),
        ]  # fmt: skip
        for name, kind, help_, value in rows:
            # a counter's family is named without "_total" (prometheus_client strips it
            # here and writes it back on each sample and on HELP and TYPE): names, labels
            # and order are as before prometheus_client; values now print as floats (3.0)
            # and the content type is its CONTENT_TYPE_LATEST
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(PREFIX + name, help_, value=value)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
