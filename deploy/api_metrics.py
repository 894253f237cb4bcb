"""Request-level Prometheus metrics of the HTTP API.

Names follow the serving issue's list; vLLM exports the same names with a ``vllm:`` prefix.

Each app has its own registry (label ``model_name``), served at ``/metrics``.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class ApiMetrics:
    """``prompt_tokens``, ``generation_tokens``, ``request_success{finish_reason}``,
    ``time_to_first_token_seconds`` (streamed requests), ``e2e_request_latency_seconds``,
    ``num_requests_running`` / ``num_requests_waiting`` and ``graphfleet_api_rejected{reason}``."""

    def __init__(self, model_name: str) -> None:
        self.registry = reg = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens processed", label, registry=reg)
        self.generation_tokens = Counter("generation_tokens", "Generated tokens", label, registry=reg)
        self.success = Counter("request_success", "Finished requests by finish reason",
                               [*label, "finish_reason"], registry=reg)
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token (streamed requests)",
                              label, buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("e2e_request_latency_seconds", "Request latency from submission to finish",
                             label, buckets=_LATENCY_BUCKETS, registry=reg)
        self.running = Gauge("num_requests_running", "Requests on a worker group", label, registry=reg)
        self.waiting = Gauge("num_requests_waiting", "Requests queued for a worker group", label, registry=reg)
        self._rejected = Counter("graphfleet_api_rejected", "Requests refused before queueing",
                                 [*label, "reason"], registry=reg)

    @property
    def rejected(self):
        return _Bound(self._rejected, self.model_name)

    def first_token(self, t0: float) -> None:
        self.ttft.labels(self.model_name).observe(time.monotonic() - t0)

    def finished(self, t0: float, prompt_tokens: int, generated: int, finish_reason: str | None) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(generated)
        self.success.labels(m, finish_reason or "unknown").inc()
        self.e2e.labels(m).observe(time.monotonic() - t0)

    def observe_fleet(self, health: dict) -> None:
        """Refresh the gauges from :meth:`cluster.fleet.Fleet.health`."""
        queued = health.get("queued") or 0
        self.waiting.labels(self.model_name).set(queued)
        self.running.labels(self.model_name).set(max(0, (health.get("in_flight") or 0) - queued))


class _Bound:
    """``metric.labels(reason=...)`` with the model name filled in."""

    def __init__(self, metric, model_name: str) -> None:
        self._metric, self._model = metric, model_name

    def labels(self, **kw):
        return self._metric.labels(model_name=self._model, **kw)
