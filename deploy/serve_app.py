"""The Ray Serve application: one FastAPI ingress replica that owns a :class:`cluster.fleet.Fleet`.

``serve run deploy.serve_app:app_builder config=path.yaml model=/ckpt`` or ``serve run deploy/serve.yaml``.
The replica starts the fleet from its constructor, in a background thread (the worker groups are Ray
actors of their own), and serves the app of :mod:`deploy.api` (Serve's late-bound ingress), which
answers 503 until the fleet is up.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

from ray import serve

log = logging.getLogger(__name__)

__all__ = ["OpenAIIngress", "StartingFleet", "app_builder", "build_config"]

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
    """A :class:`cluster.fleet.Fleet` started in a background thread, so the API answers (503) while it starts.

    Until the fleet is up, :meth:`health` reports ``starting`` with each group's phase so far
    (``starting``: placement, rendezvous, load; ``capturing``; ``ready``) and, while a group's
    placement group waits for resources, its ``waiting`` details (what it asked for and what the
    cluster has free), or ``dead`` with the error if the start failed, and ``ready`` is False;
    afterwards every attribute is the fleet's. ``fleet_options`` and ``tokenizer`` are passed to
    :meth:`cluster.fleet.Fleet.start`.
    """

    def __init__(self, config, fleet_options: dict, tokenizer=None) -> None:
        self._fleet = None
        self._error: str | None = None
        self._phases: dict[str, tuple] = {}
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._start, args=(config, fleet_options, tokenizer),
                                        name="fleet-start", daemon=True)
        self._thread.start()

    def _start(self, config, fleet_options: dict, tokenizer) -> None:
        from cluster.fleet import Fleet

        def on_state(group_id: str, state, waiting) -> None:
            self._phases[group_id] = (state.value, waiting)

        try:
            self._fleet = Fleet.start(config, on_group_state=on_state, tokenizer=tokenizer, cancel=self._cancel,
                                      **fleet_options)
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
        if self._error is not None:
            return {"status": "dead", "groups": groups, "error": self._error}
        return {"status": "starting", "groups": groups, "queued": 0, "in_flight": 0}

    def rank_metrics(self, timeout_s: float = 1.0) -> list[bytes]:
        """:meth:`cluster.fleet.Fleet.rank_metrics`; none while the fleet starts."""
        return self._fleet.rank_metrics(timeout_s) if self._fleet is not None else []

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Cancel a start still under way (it ends at its next look: see :meth:`cluster.fleet.Fleet.start`),
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


@serve.deployment(name="OpenAIIngress", num_replicas=1, max_ongoing_requests=256,
                  graceful_shutdown_timeout_s=60, health_check_period_s=10, health_check_timeout_s=60,
                  ray_actor_options={"num_cpus": 1})
@serve.ingress()
class OpenAIIngress:
    """Serves the fleet of ``config`` (a Config as a dict) started with ``fleet_options`` (``Fleet.start``'s
    keyword options). The fleet starts in the background: until it is up, ``/health`` and the API answer 503.
    The replica loads the checkpoint's tokenizer once: the API, the fleet and its engines share it."""

    def __init__(self, config: dict, fleet_options: dict | None = None) -> None:
        from deploy.config import Config
        from worker.tokenizer import load_tokenizer

        self.config = Config.from_dict(config)
        if self.config.serve.gil_switch_interval_ms is not None:
            sys.setswitchinterval(self.config.serve.gil_switch_interval_ms / 1e3)
            log.info("GIL switch interval %.3f ms", sys.getswitchinterval() * 1e3)
        self.tokenizer = load_tokenizer(self.config.model.path)
        self.fleet = StartingFleet(self.config, dict(fleet_options or {}), self.tokenizer)

    def __serve_build_asgi_app__(self):
        from deploy.api import build_app

        return build_app(self.fleet, self.tokenizer, self.config)

    async def check_health(self) -> None:
        """Unhealthy (Serve restarts the replica) only when the fleet is dead or failed to start."""
        h = self.fleet.health()
        if h.get("status") == "dead":
            raise RuntimeError(f"fleet is dead: {h.get('error') or h.get('groups')}")

    def __del__(self) -> None:
        fleet = getattr(self, "fleet", None)
        if fleet is not None:
            fleet.shutdown()


def app_builder(args: dict[str, Any]) -> serve.Application:
    """The application for ``serve run deploy.serve_app:app_builder`` (args: see :func:`build_config`,
    plus ``fleet``: a dict of ``Fleet.start`` options, see :func:`cluster.fleet_config.apply_fleet_options`)."""
    config = build_config(args)
    return OpenAIIngress.bind(config.to_dict(), dict(args.get(_FLEET_KEYS) or {}))
