"""One rank of a model: its weight shard, KV cache, attention backend, graph runners, sampler.

Life cycle (a tensor-parallel group runs each stage on every rank before the next):
``Worker(config, tp)`` loads the shard -> ``available_pages()`` -> ``allocate(num_pages,
max_model_len)`` with the group's minimum -> ``capture()`` -> ``execute(msg)`` per step ->
``shutdown()`` (graphs released before anything they point at). ``Worker.local`` runs all
stages for a single process.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from graphs.backends import GraphBackend, compile_fallback, create_backend
from graphs.buckets import default_decode_ladder
from graphs.budget import ReplanSummary, capture_within_budget
from graphs.decode import DecodeGraphRunner
from graphs.eager import EagerRunner
from graphs.metrics import GraphMetrics
from graphs.prefill import PrefillGraphRunner, default_prefill_ladder, logits_output
from graphs.profile import BatchProfile
from worker.attention.factory import create_attention_backend, flashinfer_options
from worker.config import EngineConfig
from worker.executor import LaunchedStep, PendingLaunch
from worker.graph_ladders import graph_runners, ladders_of, padding_per_step, padding_share_of
from worker.kv_cache import KVCacheShape, PagedKVCache
from worker.model.kernels import select_kernels
from worker.model.loader import checkpoint_max_len, load_model, resolve_device, resolve_dtype
from worker.model.parallel import SINGLE, TensorParallel
from worker.model_runner import ModelRunner
from worker.model_steps import CompiledDecodeStep, CompiledPrefillStep, ModelDecodeStep, ModelPrefillStep
from worker.readback import TokenReadback, prompt_lists, sample_lists
from worker.step_message import StepMessage, StepResult
from worker.step_wait_metrics import StepWaitMetrics

log = logging.getLogger(__name__)


class Worker:
    """One tensor-parallel rank (or the whole model when ``tp.size == 1``)."""

    def __init__(self, config: EngineConfig, tp: TensorParallel = SINGLE, registry: CollectorRegistry | None = None,
                 metric_labels: dict[str, str] | None = None) -> None:
        if not config.model.path:
            raise ValueError("model.path is not set: pass a checkpoint directory (--model DIR)")
        self.config, self.tp = config, tp
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        kernels = select_kernels(self.device, prefer_fused=config.attention.backend != "torch")
        self.model, self.arch = load_model(Path(config.model.path), self.dtype, self.device, tp, kernels)
        # The graph budget may be a fraction of the memory free after weights: read it now,
        # before the KV cache takes the rest (order: weights, graph budget, KV cache, capture).
        self.free_after_weights = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        self.graph_budget = config.graphs.resolved_memory_budget(self.free_after_weights) \
            if self.device.type == "cuda" or not isinstance(config.graphs.memory_budget, float) else None
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metric_labels = dict(metric_labels or {})  # the constant labels of this rank's metrics
        self.graph_metrics = GraphMetrics(self.registry, metric_labels)
        self.wait_metrics = StepWaitMetrics(self.registry, metric_labels)
        sched = config.scheduler
        p = config.graphs.prefill
        self.prefill_ceiling = max(p.token_buckets) if p.token_buckets else p.resolved_max_tokens(
            sched.chunked_prefill_size)
        self.kv_cache: PagedKVCache | None = None
        self.runner: ModelRunner | None = None
        self._last_sampled: torch.Tensor | None = None  # device tokens of the last step (async scheduling's inputs)
        self._readback = TokenReadback()  # a GPU step's tokens to the host
        self._launches = 0  # steps launched so far (a LaunchedStep's number)
        self._compiled_steps: dict[str, CompiledPrefillStep | CompiledDecodeStep] = {}  # phase -> its step
        self.budget_report = None  # graphs.budget.BudgetReport of a planned capture
        self._planned_at = BatchProfile()  # the live profile when the ladders were last planned

    @classmethod
    def local(cls, config: EngineConfig, registry: CollectorRegistry | None = None) -> Worker:
        """A single-process worker taken through every stage."""
        worker = cls(config, registry=registry)
        pages = worker.available_pages()
        worker.allocate(pages, worker.max_model_len(pages))
        worker.capture()
        return worker

    # ----- sizing -----

    def max_model_len(self, num_pages: int) -> int:
        """The longest sequence the checkpoint, the config and ``num_pages`` of KV cache allow."""
        return min(checkpoint_max_len(self.arch, self.config.model.max_model_len),
                   (num_pages - 1) * self.config.cache.page_size)

    def available_pages(self) -> int:
        """KV pages this rank can hold: ``cache.num_pages``, or sized from free GPU memory."""
        cache = self.config.cache
        if cache.num_pages is not None:
            return cache.num_pages
        if self.device.type != "cuda":
            return cache.cpu_num_pages
        shape = KVCacheShape(self.arch.num_layers, 1, cache.page_size,
                             self.model.attention_shape.num_kv_heads, self.arch.head_dim)
        free, total = torch.cuda.mem_get_info(self.device)
        # The fraction is this worker's share of the device (as vLLM's gpu_memory_utilization), so
        # workers sharing a GPU each take their own share; what it already holds (weights) counts
        # against it, and what the device has left caps it.
        headroom = self._activation_bytes() + (self.graph_budget or 0)
        share = total * cache.gpu_memory_fraction - torch.cuda.memory_reserved(self.device) - headroom
        room = free - headroom
        pages = int(min(share, room) // shape.bytes_per_page(self.dtype))
        if pages < 2:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: this worker's share (cache.gpu_memory_fraction="
                f"{cache.gpu_memory_fraction}) leaves {share / 2**30:.1f} GiB and the device {room / 2**30:.1f} GiB "
                f"after {headroom / 2**30:.1f} GiB of activations and graphs; lower "
                "scheduler.max_num_batched_tokens or raise cache.gpu_memory_fraction")
        return pages

    def _activation_bytes(self) -> int:
        """Activation, logits and graph-buffer peak of the largest step, estimated from the shapes."""
        a, s = self.arch, self.config.scheduler
        per_token = (4 * a.hidden_size + 2 * a.intermediate_size + a.q_size + 2 * a.kv_size) * self.dtype.itemsize
        tokens = max(s.max_num_batched_tokens, self.prefill_ceiling)
        logits = s.max_running_requests * a.vocab_size * 4 * 3
        return int(2 * tokens * per_token + logits + 512 * 2**20)

    def allocate(self, num_pages: int, max_model_len: int) -> None:
        """Allocate the KV cache and the attention backend's buffers (same sizes on every rank)."""
        cache, sched = self.config.cache, self.config.scheduler
        shape = self.model.attention_shape
        self.num_pages, self.max_len = num_pages, max_model_len
        self.kv_cache = PagedKVCache(KVCacheShape(self.arch.num_layers, num_pages, cache.page_size,
                                                  shape.num_kv_heads, self.arch.head_dim), self.dtype, self.device)
        max_rows = sched.max_running_requests
        max_tokens = max(sched.max_num_batched_tokens, max_rows, self.prefill_ceiling)
        self.attention = create_attention_backend(self.config.attention.backend, shape, self.kv_cache, max_rows,
                                                  max_tokens, -(-max_model_len // cache.page_size),
                                                  **flashinfer_options(self.config.attention))

    # ----- graphs -----

    def capture(self) -> None:
        """Build each phase's runner the config asks for and capture its graphs (prefill first).

        With ``graphs.memory_budget`` or ``graphs.profile`` set, the ladders are planned and
        captured within the budget (:mod:`graphs.budget`); otherwise every ladder shape is.
        """
        g = self.config.graphs
        profile = BatchProfile.load(g.profile) if g.profile else None
        decode = self._build_decode_runner(planner_candidates=profile is not None)
        prefill = self._build_prefill_runner(planner_candidates=profile is not None, decode=decode)
        graphs = graph_runners(prefill, decode)
        self.graph_metrics.record_budget(self.graph_budget)
        if self.graph_budget is None and profile is None:
            for runner in graphs:
                runner.capture_all(progress=self.tp.rank == 0, timeout_s=g.capture_timeout_s)
        elif graphs:
            defaults = {"decode": self._decode_ladder(False), "prefill": self._prefill_ladder(False)}
            by_phase = {r.phase: r for r in graphs}
            self.budget_report = capture_within_budget(by_phase.get("decode"), by_phase.get("prefill"),
                                                       self.graph_budget, profile, defaults)
            for runner in graphs:
                self.graph_metrics.record_capture(runner.phase, len(runner.backend.shapes), 0.0,
                                                  runner.backend.resident_bytes)
        self.runner = ModelRunner(self.model, self.attention, decode, prefill, self._logprob_graphs())
        self._planned_at = BatchProfile()

    def replan(self, profile: BatchProfile | None = None) -> ReplanSummary:
        """Capture new ladders (planned from ``profile``, default: what this rank has run) into a
        fresh pool while the current graphs stay resident, switch to them, then release the old.

        Runs between steps with no step in flight (the caller's step loop pauses for the capture).
        With a budget, the new ladders are planned within the room the old graphs leave; when even
        the prefill ceiling (or a single decode shape) does not fit there, it refuses with
        ``ValueError`` and changes nothing.
        """
        start = time.perf_counter()
        old = self.runner
        current = old.decode_runner.resident_bytes + old.prefill_runner.resident_bytes
        room = None if self.graph_budget is None else self.graph_budget - current
        if room is not None and room <= 0:
            raise ValueError(f"re-plan refused: the current graphs use {current} of the {self.graph_budget}-byte "
                             "budget, leaving no room to capture the new ladders beside them")
        profile = profile if profile is not None else old.profile
        before = ladders_of(old.prefill_runner, old.decode_runner)
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        decode = self._build_decode_runner(planner_candidates=True, pool=pool)
        prefill = self._build_prefill_runner(planner_candidates=True, pool=pool, decode=decode)
        graphs = graph_runners(prefill, decode)
        by_phase = {r.phase: r for r in graphs}
        defaults = {"decode": self._decode_ladder(False), "prefill": self._prefill_ladder(False)}
        report = capture_within_budget(by_phase.get("decode"), by_phase.get("prefill"), room, profile,
                                       defaults if room is None else None)
        if any(not runner.backend.shapes for runner in graphs):
            for runner in graphs:
                runner.release()
            raise ValueError(f"re-plan refused: {room} bytes of budget left beside the current graphs cannot "
                             f"hold the new ladders ({'; '.join(report.notes) or 'nothing fits'}); nothing changed")
        new = ModelRunner(self.model, self.attention, decode, prefill, self._logprob_graphs())
        new.profile = old.profile
        self.runner = new
        self._planned_at = new.profile.copy()
        old.release_graphs()
        self.graph_metrics.record_replan()
        for runner in graphs:
            self.graph_metrics.record_capture(runner.phase, len(runner.backend.shapes), 0.0,
                                              runner.backend.resident_bytes)
        return ReplanSummary(before, dict(report.ladders), report.resident_bytes, report.budget_bytes,
                             time.perf_counter() - start, padding_per_step(profile, before, prefill),
                             padding_per_step(profile, report.ladders, prefill), report.line())

    def padding_since_plan(self) -> dict[str, tuple[float, int]]:
        """Per phase with graphs, ``(padding share, steps)`` of the batches run since the ladders were
        last planned (capture or re-plan): see :func:`graphs.planner.padding_share`."""
        runner = self.runner
        since = runner.profile.since(self._planned_at)
        return padding_share_of(since, ladders_of(runner.prefill_runner, runner.decode_runner), runner.prefill_runner)

    def profile(self) -> BatchProfile:
        """The live batch shapes this rank has run (for ``graphs.profile`` of a later start)."""
        return self.runner.profile

    def _decode_ladder(self, planner_candidates: bool) -> list[int]:
        g = self.config.graphs
        max_bs = min(g.decode.max_batch_size, self.config.scheduler.max_running_requests)
        if g.decode.batch_sizes and not planner_candidates:
            return list(g.decode.batch_sizes)
        return list(range(1, max_bs + 1)) if planner_candidates else default_decode_ladder(max_bs)

    def _prefill_ladder(self, planner_candidates: bool) -> list[int]:
        p = self.config.graphs.prefill
        if p.token_buckets and not planner_candidates:
            return list(p.token_buckets)
        if planner_candidates:  # 16 tokens apart below 1024, 64 below 4096, 256 above
            ceiling = self.prefill_ceiling
            steps = [*range(16, min(1024, ceiling), 16), *range(1024, min(4096, ceiling), 64),
                     *range(4096, ceiling, 256)]
            return sorted(set(steps) | {ceiling})
        return default_prefill_ladder(self.prefill_ceiling)

    def _graph_backend_name(self, phase: str) -> tuple[str | None, str]:
        """(backend ``phase`` captures with, "") or (None, the reason its passes run eagerly)."""
        g = self.config.graphs
        name = "debug" if g.debug else getattr(g, phase).backend
        if not g.enabled or g.capture not in ("both", phase):
            log.info("%s CUDA graphs off by config (graphs.enabled=%s, graphs.capture=%s)", phase, g.enabled, g.capture)
            return None, "disabled"
        if name == "eager":
            log.info("%s runs eagerly (graphs.%s.backend=eager)", phase, phase)
            return None, "disabled"
        if self.device.type != "cuda" and name not in ("debug", "tc_piecewise", "tc_full"):
            log.info("no CUDA device: CUDA graphs are off and %s runs eagerly on %s "
                     "(graphs.%s.backend=%s needs CUDA; graphs.debug=true runs the runner path on CPU)",
                     phase, self.device, phase, name)
            return None, "no_cuda"
        if name in ("tc_piecewise", "tc_full") and self.device.type != "cuda":
            log.info("no CUDA device: graphs.%s.backend=%s runs its torch.compile pieces without "
                     "CUDA graphs on %s", phase, name, self.device)
        return name, ""

    def _logprob_graphs(self) -> bool:
        """Whether the sampler's log-probabilities replay from graphs (CUDA graphs on, not debug)."""
        return self.config.graphs.enabled and not self.config.graphs.debug

    def _barrier(self):
        if self.tp.size == 1:
            return None
        return lambda: torch.distributed.barrier(group=self.tp.group)

    def _graph_backend(self, name: str, pool: tuple | None) -> GraphBackend:
        return create_backend(name, self.device, barrier=self._barrier(), pool=pool,
                              warm_up_in_pool=self.config.graphs.warm_up_in_pool)

    def _build_prefill_runner(self, planner_candidates: bool, pool: tuple | None = None,
                              decode: DecodeGraphRunner | EagerRunner | None = None,
                              ) -> PrefillGraphRunner | EagerRunner:
        """The prefill graph runner (not yet captured) over its candidate ladder, or the eager runner
        saying why prefill has no graphs; where its logits go: :func:`graphs.prefill.logits_output`
        (``decode``'s static logits when that is a graph runner)."""
        name, reason = self._graph_backend_name("prefill")
        if name is None:
            return EagerRunner("prefill", reason, self.graph_metrics)
        p, sched = self.config.graphs.prefill, self.config.scheduler
        slots = p.resolved_num_request_slots(sched.chunked_prefill_size, sched.max_running_requests,
                                             sched.mixed_steps)
        ladder = self._prefill_ladder(planner_candidates)
        if name == "full":
            log.warning("graphs.prefill.backend=full is experimental: attention is recorded inside the graph "
                        "with fixed request slots; breakable is the production default")
        step = self._compiled_step("prefill") if name == "tc_piecewise" else \
            ModelPrefillStep(self.model, self.attention, breakable=name != "full", mlp_chunk_tokens=p.mlp_chunk_tokens)
        shared = decode.buffers.logits if isinstance(decode, DecodeGraphRunner) else None
        in_graph, logits_out = logits_output(shared, slots, self.arch.vocab_size)
        return PrefillGraphRunner(step, self._graph_backend(name, pool), ladder, slots, p.max_padding_ratio,
                                  self.graph_metrics, self.dtype, logits=in_graph, logits_out=logits_out)

    def _compiled_step(self, phase: str) -> CompiledPrefillStep | CompiledDecodeStep:
        """The phase's torch.compile step (tc_piecewise prefill, tc_full decode), built once: re-plans
        reuse its compile (dynamo caches per code object, process-wide, and recompiling the same code
        counts against its recompile limit)."""
        if phase not in self._compiled_steps:
            log.info("graphs.%s.backend=%s: torch.compile(fullgraph=True) of the %s forward, split at "
                     "attention; the first capture compiles", phase, getattr(self.config.graphs, phase).backend,
                     phase)
            cls = CompiledPrefillStep if phase == "prefill" else CompiledDecodeStep
            self._compiled_steps[phase] = cls(self.model, self.attention)
        return self._compiled_steps[phase]

    def _build_decode_runner(self, planner_candidates: bool, pool: tuple | None = None,
                             ) -> DecodeGraphRunner | EagerRunner:
        """The decode graph runner (not yet captured) over its candidate ladder, or the eager runner
        saying why decode has no graphs."""
        name, reason = self._graph_backend_name("decode")
        if name is None:
            return EagerRunner("decode", reason, self.graph_metrics)
        if name == "tc_full" and getattr(self._compiled_steps.get("decode"), "compile_error", None):
            name = compile_fallback(self.device)  # it failed before: not again
        backend = self._graph_backend(name, pool)
        if name == "tc_full":
            step = self._compiled_step("decode")
            step.on_compile_failure = lambda reason: self._decode_compile_failed(backend)
        else:
            step = ModelDecodeStep(self.model, self.attention, breakable=name == "breakable")
        return DecodeGraphRunner(step, backend, self._decode_ladder(planner_candidates),
                                 self.config.graphs.decode.padding, self.graph_metrics)

    def _decode_compile_failed(self, backend: GraphBackend) -> None:
        """The tc_full decode compile failed: the backend records the uncompiled forward from now on,
        so its passes count as what they are."""
        backend.name = compile_fallback(backend.device)
        self.graph_metrics.record_compile_failure("decode", backend.name)

    # ----- steps -----

    def launch(self, msg: StepMessage, read_back: bool = True) -> LaunchedStep:
        """Queue one step's device work (inputs, forward, sampling) and, with ``read_back``, the copy of
        its tokens to the host; returns without waiting for the device (see :meth:`finish`).

        Inputs the engine has not read back yet (``msg.from_previous``) are taken on the device from
        the tokens of the step this worker launched last, so a step can be launched while the one
        before it still runs (async scheduling). A follower rank launches without ``read_back``.
        """
        start = time.perf_counter()
        self._launches += 1
        sampled = self._last_sampled.shape[0] if self._last_sampled is not None else 0
        for pos, row in msg.from_previous:
            if row >= sampled:
                raise ValueError(f"step input {pos} wants row {row} of the previous step's tokens, which "
                                 f"sampled {sampled}")
        out, logits = self.runner.execute(msg, self._last_sampled if msg.from_previous else None)
        if out is None:
            self._last_sampled = None
            return LaunchedStep(None, None, None, time.perf_counter() - start, self._launches)
        self._last_sampled = out.token_ids
        logits_copy = logits.to(torch.float32, copy=True) if msg.return_logits and logits is not None else None
        # Queued now, on this stream: the next step's replays rewrite the static outputs in ``out``.
        host = self._readback.copy(out, (msg.is_prefill, len(msg.input_ids)), start) \
            if read_back and self.device.type == "cuda" else None
        return LaunchedStep(out, host, logits_copy, time.perf_counter() - start, self._launches)

    def finish(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens (and log-probabilities): the step's one synchronisation
        (on a GPU: :meth:`worker.readback.TokenReadback.wait`; the newest launch naps, then spins)."""
        if step.out is None:
            return StepResult(rank_s=step.launch_s)
        begin = time.perf_counter()
        if step.host is None:  # CPU: the step has run already
            out = step.out
            tokens, logprobs, tops = sample_lists(out)
            prompt = prompt_lists(out.prompt)
            wait_s = wait_cpu_s = 0.0
        else:
            tokens, logprobs, tops, prompt, wait_s, wait_cpu_s = self._readback.wait(
                step.host, newest=step.number == self._launches)
            self.wait_metrics.record(wait_s, wait_cpu_s)
        result = StepResult(tokens, logprobs, tops, prompt, wait_s=wait_s, wait_cpu_s=wait_cpu_s)
        if step.logits is not None:
            result.logits = step.logits.cpu()
        result.rank_s = step.launch_s + time.perf_counter() - begin
        return result

    def execute(self, msg: StepMessage) -> StepResult:
        """Run one step and read its tokens back (:meth:`launch`, then :meth:`finish`)."""
        return self.finish(self.launch(msg))

    def submit(self, msg: StepMessage) -> PendingLaunch:
        """Launch the step now; its result is read when asked for (see :class:`PendingLaunch`)."""
        return PendingLaunch(self, msg)

    def shutdown(self) -> None:
        """Release graphs before the buffers and communicators they point at."""
        if self.runner is not None:
            self.runner.release_graphs()
        self.runner = None
