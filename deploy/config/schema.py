"""deploy's own section, ``serve``, and :class:`Config`, the whole YAML file.

The other sections belong to the layers that use them: ``graphs`` to :mod:`graphs.config`;
``model``, ``attention``, ``cache``, ``scheduler`` to :mod:`worker.config`; ``cluster`` to
:mod:`cluster.config`. Types are checked by :mod:`configkit`; ranges and cross-field rules live in
each section's ``__post_init__``, which raises :class:`configkit.ConfigError` keyed by the field
name (the builder prefixes the section path).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.config import GroupConfig
from configkit import Section, check


@dataclass(frozen=True)
class ServeConfig(Section):
    """The HTTP API server.

    host: listen address.
    port: listen port (1..65535).
    api_key: required bearer token; None = no authentication.
    model_name: model name reported by the API; None = the checkpoint directory name.
    request_timeout_s: default deadline of a request from submission; None = no deadline.
    gil_switch_interval_ms: the Serve replica's ``sys.setswitchinterval`` in ms; None = Python's 5 ms
        (the fleet loop thread may wait this long for the GIL behind the replica's HTTP loop).
    stream_batching_interval_ms: the longest a streamed choice's tokens wait to go out together (the
        first token and the finish never wait), as Ray Serve LLM's ``stream_batching_interval_ms``;
        0 = every step's tokens as they come (vLLM's and SGLang's default). Each chunk costs the
        replica a JSON body and a message through Serve's proxy.
    stream_chunks_per_s: the replica's chunk budget, which makes the interval follow the load: with S
        choices streaming, each waits ``min(stream_batching_interval_ms, S / stream_chunks_per_s)``,
        so a lone stream gets every token as it comes and a busy replica coalesces
        (:class:`deploy.stream_pacing.StreamPacer`); > 0, or null for the fixed interval.
    drain_timeout_s: on shutdown (SIGTERM to ``graphfleet serve``, the Helm chart's preStop, Serve's
        replica shutdown) new requests get 503 and those in flight may run this long before they end
        with finish_reason "abort" (>= 0). Serve's ``graceful_shutdown_timeout_s`` and the pods'
        termination grace period follow it (:func:`deploy.serve_app.deployment_options`, the chart).
    max_request_bytes: a request body over this many bytes gets 413 before any of it is read or parsed
        (>= 1024; default 16 MiB). The replica keeps one shared-memory segment of this size per
        preprocessing worker in ``/dev/shm`` for large bodies (:mod:`deploy.shared_bodies`).
    preprocess_workers: processes that turn request bodies into admitted prompts (parse the JSON, render
        the chat template, tokenize) so none of it holds the replica's GIL (1..64;
        :class:`deploy.preprocess_pool.Preprocessor`).
    preprocess_inline_bytes: bodies of at most this many bytes are prepared on the replica's event
        loop instead of in the pool (0, the default: every body goes to the pool; at most 262144).
        A pool call is a round trip through two processes and the replica's executor threads:
        preprocessing averaged 5.6 ms of the TTFT at 16 req/s on the H200
        (serve-colocated-20261203T182328). On the 2-core CPU machine (bench/preprocess.py,
        preprocess-20261203T185640) one body of 512 token ids took 0.19 ms inline against 0.73 ms
        through two workers, but a burst of 64 waited 23 ms on average inline against 18 ms in the
        pool, which prepares two at a time; the H200 host is not measured yet, so it stays off.
    direct_ingress: ``graphfleet serve`` on a Ray it starts itself: the API replica serves HTTP on
        ``host:port`` itself (Ray Serve's direct ingress), so no request body and no streamed chunk
        crosses Serve's proxy, which moves to a free loopback port. On the 2-core CPU machine it
        cut ``/health`` from 12 ms p50 / 89-108 ms max to 1 / 27-30 ms under 16 streams and a 10 MB
        body, and that body's 400 from 147-209 to 74 ms. A joined cluster (``--ray-address``)
        decides this in its own environment (``RAY_SERVE_ENABLE_DIRECT_INGRESS``), and the Helm
        chart's Service targets the proxy: both serve through the proxy whatever this says.
    api_on_serve_loop: the API's handlers run on Ray Serve's own event loop in the replica
        (``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`` in its environment, as Ray Serve LLM's
        replicas run) instead of on a second loop in a thread of their own, which every request and
        stream chunk crosses to. On the 2-core CPU machine the replica's CPU for bursts of 64 streams
        fell 11-19% (832a716); off until measured on the GPU host. Nothing of ours blocks the loop
        (bodies are prepared in processes, the fleet steps in threads of its own), so either is safe.
    max_ongoing_requests: Ray Serve's ``max_ongoing_requests`` of the API replica: the requests it
        takes at once, streams included, before Serve refuses the next one and its proxy retries it
        in a loop (health checks wait in that loop too). It must exceed
        ``scheduler.max_waiting_requests``, so that an overload meets the fleet's own admission (429
        with ``Retry-After``, at once) long before Serve's; Ray Serve LLM sets it to 1e9 for the same
        reason. The Helm chart renders it into the deployment.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    request_timeout_s: float | None = None
    gil_switch_interval_ms: float | None = None
    stream_batching_interval_ms: float = 50.0
    stream_chunks_per_s: float | None = 2000.0
    drain_timeout_s: float = 30.0
    max_request_bytes: int = 16 * 1024 * 1024
    preprocess_workers: int = 2
    preprocess_inline_bytes: int = 0
    direct_ingress: bool = True
    api_on_serve_loop: bool = False
    max_ongoing_requests: int = 100_000

    def __post_init__(self) -> None:
        check(bool(self.host), "host", "must not be empty")
        check(1 <= self.port <= 65535, "port", f"must be in 1..65535, got {self.port}")
        check(self.api_key != "", "api_key", "must not be empty (use null to disable authentication)")
        t = self.request_timeout_s
        check(t is None or t > 0, "request_timeout_s", f"must be > 0 or null, got {t!r}")
        g = self.gil_switch_interval_ms
        check(g is None or 0 < g <= 1000, "gil_switch_interval_ms", f"must be in (0, 1000] or null, got {g!r}")
        b = self.stream_batching_interval_ms
        check(0 <= b <= 1000, "stream_batching_interval_ms", f"must be in [0, 1000], got {b!r}")
        c = self.stream_chunks_per_s
        check(c is None or c > 0, "stream_chunks_per_s", f"must be > 0 or null, got {c!r}")
        d = self.drain_timeout_s
        check(0 <= d <= 86400, "drain_timeout_s", f"must be in [0, 86400], got {d!r}")
        m = self.max_request_bytes
        check(m >= 1024, "max_request_bytes", f"must be >= 1024, got {m!r}")
        w = self.preprocess_workers
        check(1 <= w <= 64, "preprocess_workers", f"must be in 1..64, got {w!r}")
        i = self.preprocess_inline_bytes
        check(0 <= i <= 262144, "preprocess_inline_bytes", f"must be in 0..262144, got {i!r}")
        o = self.max_ongoing_requests
        check(o >= 1, "max_ongoing_requests", f"must be >= 1, got {o!r}")


@dataclass(frozen=True)
class Config(GroupConfig):
    """The whole graphfleet configuration; build with :func:`deploy.config.load_config` or :meth:`from_dict`.

    model, attention, cache, scheduler, graphs, cluster: as :class:`cluster.config.GroupConfig`
    (so a Config is-a GroupConfig is-an :class:`worker.config.EngineConfig`).
    serve: the HTTP API server.
    """

    serve: ServeConfig = field(default_factory=ServeConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        ongoing, waiting = self.serve.max_ongoing_requests, self.scheduler.max_waiting_requests
        check(ongoing > waiting, "serve.max_ongoing_requests",
              f"{ongoing} must exceed scheduler.max_waiting_requests ({waiting}): beyond it Ray Serve, not the "
              "fleet, refuses requests, and its proxy retries them in a loop instead of answering 429")
