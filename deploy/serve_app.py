"""The Ray Serve application: one FastAPI ingress replica that owns a :class:`fleet.fleet.Fleet`.

``serve run deploy.serve_app:app_builder config=path.yaml model=/ckpt`` or ``serve run deploy/serve.yaml``.
The replica starts the fleet from its constructor, in a background thread (the worker groups are Ray
actors of their own), and serves the app of :mod:`deploy.api` (Serve's late-bound ingress), which
answers 503 until the fleet is up.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from typing import Any

from ray import serve

# Under Serve's logger: a replica writes it to its log file (logs/serve/replica_<app>_OpenAIIngress_<id>.log),
# where a module logger's INFO lines would be dropped.
log = logging.getLogger("ray.serve").getChild("graphfleet")

__all__ = ["OpenAIIngress", "StartingFleet", "app_builder", "build_config", "deployment", "deployment_options"]

#: Fleet.start options accepted under the ``fleet`` key of the arguments.
_FLEET_KEYS = "fleet"


def build_config(args: dict[str, Any]):
    """The :class:`deploy.config.Config` of the application arguments.

    Keys: ``config`` (YAML path, default the packaged one; or the config itself as a mapping, as the
    Helm chart renders it into ``serveConfigV2``), ``model`` (checkpoint dir, sets ``model.path``),
    ``overrides`` (list of ``"a.b=value"``), ``host``/``port``/``api_key``/``model_name``/
    ``request_timeout_s`` (the ``serve`` section).
    """
    from deploy.config import Config, apply_overrides, load_config

    overrides = list(args.get("overrides") or [])
    if args.get("model"):
        overrides.insert(0, f"model.path={args['model']}")
    source = args.get("config")
    if isinstance(source, dict):
        config = Config.from_dict(apply_overrides(source, overrides))
    else:
        config = load_config(source, overrides)
    given = {k: args[k] for k in ("host", "port", "api_key", "model_name", "request_timeout_s")
             if args.get(k) is not None}
    if not given:
        return config
    data = config.to_dict()
    data["serve"] = {**data["serve"], **given}
    return Config.from_dict(data)


class StartingFleet:
    """A :class:`fleet.fleet.Fleet` started in a background thread, so the API answers (503) while it starts.

    Until the fleet is up, :meth:`health` reports ``starting`` with each group's phase so far
    (``starting``: placement, rendezvous, load; ``capturing``; ``ready``) and, while a group's
    placement group waits for resources, its ``waiting`` details (what it asked for and what the
    cluster has free), or ``dead`` with the error if the start failed (``draining``, then
    ``stopped``, once :meth:`drain` has begun), and ``ready`` is False;
    afterwards every attribute is the fleet's. ``fleet_options`` and ``tokenizer`` are passed to
    :meth:`fleet.fleet.Fleet.start`.
    """

    def __init__(self, config, fleet_options: dict, tokenizer=None) -> None:
        self._fleet = None
        self._error: str | None = None
        self._phases: dict[str, tuple] = {}
        self._cancel = threading.Event()
        self._draining = False
        self._thread = threading.Thread(target=self._start, args=(config, fleet_options, tokenizer),
                                        name="fleet-start", daemon=True)
        self._thread.start()

    def _start(self, config, fleet_options: dict, tokenizer) -> None:
        from fleet.fleet import Fleet
        from worker.gc_heap import freeze_startup_heap

        def on_state(group_id: str, state, waiting) -> None:
            self._phases[group_id] = (state.value, waiting)

        try:
            fleet = Fleet.start(config, on_group_state=on_state, tokenizer=tokenizer, cancel=self._cancel,
                                **fleet_options)
            freeze_startup_heap("serve replica")  # the replica lives as long as its fleet; before it is ready
            self._fleet = fleet
        except Exception as e:  # noqa: BLE001 (reported by health(); Serve then restarts the replica)
            if self._cancel.is_set():
                log.info("fleet start cancelled: %s", e)
            else:
                log.exception("fleet start failed")
            self._error = f"fleet start failed: {type(e).__name__}: {e}"

    @property
    def ready(self) -> bool:
        return self._fleet is not None

    def health(self) -> dict:
        if self._fleet is not None:
            return self._fleet.health()
        now = time.monotonic()
        phases = dict(self._phases)  # one atomic copy: start threads add to it meanwhile
        groups = {gid: {"state": phase, "waiting": waiting.health(now) if waiting is not None else None}
                  for gid, (phase, waiting) in sorted(phases.items())}
        if self._draining:  # a start cancelled by a drain is no failure
            status = "draining" if self._thread.is_alive() else "stopped"
            return {"status": status, "groups": groups, "queued": 0, "in_flight": 0}
        if self._error is not None:
            return {"status": "dead", "groups": groups, "error": self._error}
        return {"status": "starting", "groups": groups, "queued": 0, "in_flight": 0}

    def drain(self, timeout_s: float):
        """:meth:`fleet.fleet.Fleet.drain`; a start still under way is cancelled first and waited for
        (at most ``timeout_s``: it ends at its next look), and the fleet drained if it came up meanwhile."""
        from fleet.fleet import DrainReport

        started = time.monotonic()
        self._draining = True
        if self._fleet is not None:
            return self._fleet.drain(timeout_s)
        self._cancel.set()
        self._thread.join(timeout_s)
        if self._fleet is not None:  # it came up meanwhile: it has no request yet
            return self._fleet.drain(max(0.0, timeout_s - (time.monotonic() - started)))
        return DrainReport(0, 0, time.monotonic() - started)

    def rank_metrics(self, timeout_s: float = 1.0) -> list[bytes]:
        """:meth:`fleet.fleet.Fleet.rank_metrics`; none while the fleet starts."""
        return self._fleet.rank_metrics(timeout_s) if self._fleet is not None else []

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Cancel a start still under way (it ends at its next look: see :meth:`fleet.fleet.Fleet.start`),
        wait for it at most ``timeout_s`` (None: until it ends), then shut the fleet down."""
        self._cancel.set()
        self._thread.join(timeout_s)
        if self._fleet is not None:
            self._fleet.shutdown()

    def __getattr__(self, name: str):
        fleet = self.__dict__.get("_fleet")
        if fleet is None:
            raise AttributeError(f"{name}: the fleet is still starting")
        return getattr(fleet, name)


#: Seconds beyond ``serve.drain_timeout_s`` that a replica's shutdown may take: aborting what is left
#: (``fleet.fleet.DRAIN_ABORT_WAIT_S``), sending the last responses, shutting every group down.
SHUTDOWN_MARGIN_S = 30.0
#: Seconds the drain waits for the last responses to be sent once the fleet has ended every request.
RESPONSE_FLUSH_S = 5.0


#: The replica's environment under ``serve.api_on_serve_loop``: the API on Serve's own event loop.
SERVE_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def deployment_options(serve_config) -> dict:
    """The Serve deployment options ``serve_config`` (the ``serve`` section) implies:
    ``graceful_shutdown_timeout_s`` = ``drain_timeout_s`` + ``SHUTDOWN_MARGIN_S`` (Serve force-kills a replica
    after it), a short ``graceful_shutdown_wait_loop_s`` (Serve sleeps one loop before it calls ``__del__``),
    ``max_ongoing_requests``, and the replica's actor options (one CPU; :data:`SERVE_LOOP_ENV` in its
    environment under ``api_on_serve_loop``)."""
    actor: dict[str, Any] = {"num_cpus": 1}
    if serve_config.api_on_serve_loop:
        actor["runtime_env"] = {"env_vars": dict(SERVE_LOOP_ENV)}
    return {"graceful_shutdown_timeout_s": serve_config.drain_timeout_s + SHUTDOWN_MARGIN_S,
            "graceful_shutdown_wait_loop_s": 0.5, "max_ongoing_requests": serve_config.max_ongoing_requests,
            "ray_actor_options": actor}


# These options are deployment_options() of the default serve section; deployment() binds a config's.
@serve.deployment(name="OpenAIIngress", num_replicas=1, max_ongoing_requests=100_000,
                  graceful_shutdown_timeout_s=60, graceful_shutdown_wait_loop_s=0.5, health_check_period_s=10,
                  health_check_timeout_s=60, ray_actor_options={"num_cpus": 1})
@serve.ingress()
class OpenAIIngress:
    """Serves the fleet of ``config`` (a Config as a dict) started with ``fleet_options`` (``Fleet.start``'s
    keyword options). The fleet starts in the background: until it is up, ``/health`` and the API answer 503.
    The replica loads the checkpoint's tokenizer once (the fleet detokenizes with it); request bodies
    are parsed, tokenized and admitted in its :class:`deploy.preprocess_pool.Preprocessor`'s processes.
    Bind it with :func:`deployment_options` (as :func:`deployment` does) so Serve's shutdown budget follows
    ``serve.drain_timeout_s`` and its cap on requests at once ``serve.max_ongoing_requests``."""

    def __init__(self, config: dict, fleet_options: dict | None = None) -> None:
        from deploy.config import Config
        from deploy.drain import Admission
        from deploy.preprocess_pool import Preprocessor
        from worker.tokenizer import load_tokenizer

        self.config = Config.from_dict(config)
        if self.config.serve.gil_switch_interval_ms is not None:
            sys.setswitchinterval(self.config.serve.gil_switch_interval_ms / 1e3)
            log.info("GIL switch interval %.3f ms", sys.getswitchinterval() * 1e3)
        self.admission = Admission()
        self._drain_task: asyncio.Future | None = None
        self.tokenizer = load_tokenizer(self.config.model.path)
        self.preprocessor = Preprocessor(self.config.model.path, self.config.serve.preprocess_workers,
                                         self.config.serve.preprocess_inline_bytes, self.tokenizer,
                                         max_body_bytes=self.config.serve.max_request_bytes)
        self.fleet = StartingFleet(self.config, dict(fleet_options or {}), self.tokenizer)

    def __serve_build_asgi_app__(self):
        from deploy.api import build_app
        from deploy.body_limit import BodyLimit
        from deploy.client_gone import ClientGone
        from deploy.drain import DrainGate

        app = build_app(self.fleet, self.tokenizer, self.config, self.preprocessor)
        app.add_middleware(DrainGate, admission=self.admission)
        app.add_middleware(BodyLimit, limit=self.config.serve.max_request_bytes)
        app.add_middleware(ClientGone)  # outermost: every layer inside reads the disconnect as ASGI says
        return app

    async def check_health(self) -> None:
        """Unhealthy (Serve restarts the replica) only when the fleet is dead or failed to start; a
        draining or drained replica is not (it is on its way out)."""
        if self._drain_task is not None:
            return
        h = self.fleet.health()
        if h.get("status") == "dead":
            raise RuntimeError(f"fleet is dead: {h.get('error') or h.get('groups')}")

    async def drain(self, timeout_s: float | None = None) -> dict:
        """Drain this replica: the one drain of ``graphfleet serve``'s SIGTERM (through a deployment
        handle), of the Helm chart's preStop (``graphfleet drain``) and of Serve's own replica shutdown
        (:meth:`__del__`).

        New API requests get 503 (code ``draining``, ``Retry-After``); requests in flight get ``timeout_s``
        (None: ``serve.drain_timeout_s``) to finish, then end with finish_reason "abort" and an error in
        their stream (a non-streamed one: 503); once their responses are sent, every rank and placement
        group is released (:meth:`fleet.fleet.Fleet.drain`). Returns ``finished``, ``aborted``,
        ``seconds`` and ``flushed`` (every response sent). A second call waits for the first.
        """
        if self._drain_task is None:
            timeout = self.config.serve.drain_timeout_s if timeout_s is None else timeout_s
            self._drain_task = asyncio.ensure_future(self._drain(timeout))
        return await asyncio.shield(self._drain_task)

    async def _drain(self, timeout_s: float) -> dict:
        started = time.monotonic()
        self.admission.close()
        log.info("draining: %d API requests open, %gs for them to finish", self.admission.open, timeout_s)
        report = await asyncio.to_thread(self.fleet.drain, timeout_s)
        flushed = await self.admission.wait_idle(RESPONSE_FLUSH_S)
        self.preprocessor.shutdown()
        result = {"finished": report.finished, "aborted": report.aborted,
                  "seconds": round(time.monotonic() - started, 2), "flushed": flushed}
        log.info("drained: %s", result)
        return result

    async def __del__(self) -> None:
        """Serve's replica shutdown calls this once it has stopped routing here and waited for the
        requests in flight (up to ``graceful_shutdown_timeout_s``): drain what is left."""
        if getattr(self, "fleet", None) is not None:
            await self.drain()


def deployment(config) -> serve.Deployment:
    """:class:`OpenAIIngress` with the Serve options ``config`` (a :class:`deploy.config.Config`) implies."""
    return OpenAIIngress.options(**deployment_options(config.serve))


def app_builder(args: dict[str, Any]) -> serve.Application:
    """The application for ``serve run deploy.serve_app:app_builder`` (args: see :func:`build_config`,
    plus ``fleet``: a dict of ``Fleet.start`` options, see :func:`fleet.config.apply_fleet_options`)."""
    config = build_config(args)
    return deployment(config).bind(config.to_dict(), dict(args.get(_FLEET_KEYS) or {}))
