"""Request-level Prometheus metrics of the HTTP API.

Names follow the serving issue's list; vLLM exports the same names with a ``vllm:`` prefix.
Each app has its own registry (label ``model_name``), served at ``/metrics`` together with every
rank's ``cuda_graph_*`` metrics (see :mod:`deploy.metrics_merge`).

Token timing comes from the fleet, not from the HTTP side: the fleet's loop stamps each token
as it delivers it (:attr:`fleet.fleet.RequestHandle.token_times`), for streamed and non-streamed
requests alike. ``time_to_first_token_seconds`` is the first stamp minus the request's arrival at
the API (before its body is parsed and its prompt tokenized; the phase histograms split it);
``inter_token_latency_seconds`` gets one observation per later token (the gap to the one
before; tokens of several engine steps reported together share a stamp and give 0).
Streams observe them as the events are sent; non-streamed requests when their response is built.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from worker.gc_heap import watch_gc

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ApiMetrics:
    """``prompt_tokens``, ``generation_tokens``, ``request_success{finish_reason}``,
    ``time_to_first_token_seconds`` and its phases (``graphfleet_request_preprocess_time_seconds``,
    ``request_queue_time_seconds``, ``request_prefill_time_seconds``,
    ``graphfleet_request_first_token_overhead_seconds``: they add up to it, request by request),
    ``inter_token_latency_seconds``, ``e2e_request_latency_seconds``,
    ``num_requests_running`` / ``num_requests_waiting``, ``kv_cache_usage_ratio{group,role}`` and
    ``graphfleet_api_rejected{reason}``, ``graphfleet_gil_switch_interval_seconds`` and
    ``graphfleet_gc_frozen_objects`` / ``graphfleet_gc_pause_seconds`` with ``process="replica"``
    (worker.gc_heap.watch_gc: build it once per process), and the replica process's own
    ``graphfleet_replica_process_cpu_seconds_total``, resident memory and open files (Linux)."""

    def __init__(self, model_name: str) -> None:
        self.registry = reg = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens processed", label, registry=reg)
        self.generation_tokens = Counter("generation_tokens", "Generated tokens", label, registry=reg)
        self.success = Counter("request_success", "Finished requests by finish reason",
                               [*label, "finish_reason"], registry=reg)
        self.ttft = Histogram("time_to_first_token_seconds", "Time from arrival to the first token's delivery",
                              label, buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("inter_token_latency_seconds", "Time between consecutive token deliveries "
                             "of one request", label, buckets=_ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("e2e_request_latency_seconds", "Request latency from arrival to finish",
                             label, buckets=_LATENCY_BUCKETS, registry=reg)
        # The TTFT by phase: preprocess + (engine) queue + (engine) prefill + overhead = TTFT.
        self.preprocess = Histogram("graphfleet_request_preprocess_time_seconds", "Time from arrival to the "
                                    "request's submission to the fleet (parsing, tokenization, checks)",
                                    label, buckets=_LATENCY_BUCKETS, registry=reg)
        self.queue = Histogram("request_queue_time_seconds", "Time a request waited in its engine's queue "
                               "before its first step", label, buckets=_LATENCY_BUCKETS, registry=reg)
        self.prefill = Histogram("request_prefill_time_seconds", "Time from a request's first engine step to "
                                 "its first token on the engine", label, buckets=_LATENCY_BUCKETS, registry=reg)
        self.first_token_overhead = Histogram(
            "graphfleet_request_first_token_overhead_seconds", "What the TTFT spends outside preprocessing and "
            "the engine: the fleet's routing, the hops to and from the group's leader, delivery", label,
            buckets=_LATENCY_BUCKETS, registry=reg)
        self.running = Gauge("num_requests_running", "Requests on a worker group", label, registry=reg)
        self.waiting = Gauge("num_requests_waiting", "Requests queued for a worker group", label, registry=reg)
        self.kv_usage = Gauge("kv_cache_usage_ratio", "Fraction of a group's usable KV pages held by requests "
                              "(1 - free/usable; 1 = full)", [*label, "group", "role"], registry=reg)
        self._rejected = Counter("graphfleet_api_rejected", "Requests refused before queueing",
                                 [*label, "reason"], registry=reg)
        self.gil_switch = Gauge("graphfleet_gil_switch_interval_seconds", "The serving process's "
                                "sys.getswitchinterval() (serve.gil_switch_interval_ms)", registry=reg)
        self.gil_switch.set_function(sys.getswitchinterval)
        watch_gc(reg, {"process": "replica"})
        ProcessCollector(namespace="graphfleet_replica", registry=reg)  # reads /proc/self at each scrape
        self.stream_interval = Gauge("graphfleet_stream_batching_interval_seconds", "How long a streamed "
                                     "choice's tokens wait to go out together now (it follows the open "
                                     "streams: serve.stream_chunks_per_s)", registry=reg)

    @property
    def rejected(self):
        return _Bound(self._rejected, self.model_name)

    def token_times(self, t0: float, times: Sequence[float], start: int, stop: int) -> int:
        """Observe the token delivery times ``times[start:stop]`` of a request that arrived at ``t0``
        (the first as TTFT, each later token's gap as an inter-token latency: tokens delivered together
        give 0); returns ``stop``, the next start."""
        m = self.model_name
        for k in range(start, stop):
            if k == 0:
                self.ttft.labels(m).observe(times[0] - t0)
            else:
                self.itl.labels(m).observe(times[k] - times[k - 1])
        return max(start, stop)

    def first_token_phases(self, ttft: float, preprocess: float, engine: tuple[float, float] | None) -> None:
        """Observe a request's TTFT by phase: ``preprocess`` (arrival to submission), the ``engine``'s
        queue and prefill seconds (None: its first token came from no engine, e.g. an error) and the rest."""
        m = self.model_name
        self.preprocess.labels(m).observe(preprocess)
        if engine is None:
            return
        queue, prefill = engine
        self.queue.labels(m).observe(queue)
        self.prefill.labels(m).observe(prefill)
        self.first_token_overhead.labels(m).observe(max(0.0, ttft - preprocess - queue - prefill))

    def finished(self, t0: float, prompt_tokens: int, generated: int, finish_reason: str | None) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(generated)
        self.success.labels(m, finish_reason or "unknown").inc()
        self.e2e.labels(m).observe(time.monotonic() - t0)

    def observe_fleet(self, health: dict) -> None:
        """Refresh the gauges from :meth:`fleet.fleet.Fleet.health`."""
        queued = health.get("queued") or 0
        self.waiting.labels(self.model_name).set(queued)
        self.running.labels(self.model_name).set(max(0, (health.get("in_flight") or 0) - queued))
        for gid, g in health.get("groups", {}).items():
            usable = g.get("num_pages") or 0
            if usable > 0:  # a starting group has no pages yet
                used = 1.0 - (g.get("free_pages") or 0) / usable
                self.kv_usage.labels(self.model_name, gid, g.get("role") or "").set(used)


class _Bound:
    """``metric.labels(reason=...)`` with the model name filled in."""

    def __init__(self, metric, model_name: str) -> None:
        self._metric, self._model = metric, model_name

    def labels(self, **kw):
        return self._metric.labels(model_name=self._model, **kw)
