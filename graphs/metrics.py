"""Prometheus metrics of the graph runtime (registry injectable, so tests and ranks stay apart)."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

MODE_SUFFIX = {"full": "cuda_graph", "breakable": "breakable", "tc_piecewise": "tc_piecewise", "tc_full": "tc_full"}


def pass_mode(phase: str, backend: str | None) -> str:
    """``decode_cuda_graph``, ``decode_breakable``, ``prefill_tc_piecewise`` or ``<phase>_none``.

    Phases: ``decode``, ``prefill``, and ``mixed`` (a step of decode rows and prefill chunks, run by
    the prefill runner: ``mixed_breakable``, ``mixed_cuda_graph``, ``mixed_none``, ...)."""
    return f"{phase}_{MODE_SUFFIX.get(backend or '', 'none')}"


class GraphMetrics:
    """``cuda_graph_*`` counters and gauges; ``labels`` are constant labels (group, rank, role)."""

    def __init__(self, registry: CollectorRegistry | None = None, labels: dict[str, str] | None = None) -> None:
        self.registry = registry if registry is not None else REGISTRY
        self.labels = dict(labels or {})
        extra = list(self.labels)
        reg = self.registry
        self.passes = Counter("cuda_graph_passes", "Forward passes by phase and execution mode",
                              ["phase", "mode", *extra], registry=reg)
        self.fallbacks = Counter("cuda_graph_fallbacks", "Eager passes by the reason they did not replay",
                                 ["phase", "reason", *extra], registry=reg)
        self.capture_seconds = Gauge("cuda_graph_capture_seconds", "Seconds spent capturing graphs",
                                     ["phase", *extra], registry=reg)
        self.memory_bytes = Gauge("cuda_graph_memory_bytes", "Graph pool bytes measured during capture",
                                  ["phase", *extra], registry=reg)
        self.shapes = Gauge("cuda_graph_shapes", "Captured shapes", ["phase", *extra], registry=reg)
        self.budget_bytes = Gauge("cuda_graph_budget_bytes", "Graph memory budget (0: unbounded)", extra,
                                  registry=reg)
        self.padding_ratio = Histogram("cuda_graph_padding_ratio", "Padded over real size per replay",
                                       ["phase", *extra], buckets=(1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0),
                                       registry=reg)
        self.replans = Counter("cuda_graph_replans", "Live re-plans of the graph ladders", extra, registry=reg)
        self.compile_failures = Counter("cuda_graph_compile_failures",
                                        "torch.compile failures of a compiled graph backend (the phase fell back)",
                                        ["phase", "fallback", *extra], registry=reg)
        if self.labels:  # export 0 before the first re-plan (an unlabelled counter always has its sample)
            self.replans.labels(**self.labels)
        # The children a step records into, resolved on first use (a child exports its sample from
        # then on, so none is made before its first record): a step's records are a dict lookup each.
        self._passes: dict[tuple[str, str | None], Any] = {}
        self._fallbacks: dict[tuple[str, str], Any] = {}
        self._padding: dict[str, Any] = {}

    def record_pass(self, phase: str, backend: str | None, reason: str | None) -> None:
        """One forward pass; ``backend`` None (or a non-graph backend) counts as ``<phase>_none``."""
        passes = self._passes.get((phase, backend))
        if passes is None:
            passes = self._passes[(phase, backend)] = self.passes.labels(
                phase=phase, mode=pass_mode(phase, backend), **self.labels)
        passes.inc()
        if reason is not None:
            fallbacks = self._fallbacks.get((phase, reason))
            if fallbacks is None:
                fallbacks = self._fallbacks[(phase, reason)] = self.fallbacks.labels(
                    phase=phase, reason=reason, **self.labels)
            fallbacks.inc()

    def record_padding(self, phase: str, padded: int, real: int) -> None:
        ratio = self._padding.get(phase)
        if ratio is None:
            ratio = self._padding[phase] = self.padding_ratio.labels(phase=phase, **self.labels)
        ratio.observe(padded / real)

    def record_budget(self, budget_bytes: int | None) -> None:
        (self.budget_bytes.labels(**self.labels) if self.labels else self.budget_bytes).set(budget_bytes or 0)

    def record_compile_failure(self, phase: str, fallback: str) -> None:
        """A compiled backend of ``phase`` could not compile; the phase runs ``fallback`` instead."""
        self.compile_failures.labels(phase=phase, fallback=fallback, **self.labels).inc()

    def record_replan(self) -> None:
        (self.replans.labels(**self.labels) if self.labels else self.replans).inc()

    def record_capture(self, phase: str, shapes: int, seconds: float, resident_bytes: int) -> None:
        self.shapes.labels(phase=phase, **self.labels).set(shapes)
        self.capture_seconds.labels(phase=phase, **self.labels).set(seconds)
        self.memory_bytes.labels(phase=phase, **self.labels).set(resident_bytes)
