"""``prefix_cache_queries_total`` and ``prefix_cache_hits_total``: tokens an engine looked up in its
prefix cache when it admitted requests, and tokens it found there (vLLM's names, without ``vllm:``).

``rate(prefix_cache_hits_total) / rate(prefix_cache_queries_total)`` is the hit rate. The values are
read from the scheduler's :class:`worker.scheduler.PrefixCacheStats` at scrape time (the engine loop
only adds to two ints).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily

from worker.scheduler import PrefixCacheStats


class PrefixCacheMetrics:
    """Exports ``stats`` into ``registry`` with constant ``labels`` (a fleet rank's group, rank, role)."""

    def __init__(self, stats: PrefixCacheStats, registry: CollectorRegistry,
                 labels: dict[str, str] | None = None) -> None:
        self.stats = stats
        self.labels = dict(labels or {})
        registry.register(self)

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        queries = CounterMetricFamily("prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "at admissions (tokens)", labels=names)
        hits = CounterMetricFamily("prefix_cache_hits", "Prompt tokens found in the prefix cache at "
                                   "admissions, not computed again (tokens)", labels=names)
        queries.add_metric(values, self.stats.queries)
        hits.add_metric(values, self.stats.hits)
        return [queries, hits]
