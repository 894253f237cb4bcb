"""The single-process engine: scheduler + model runner + detokenisation, driven step by step.

``Engine(config)`` loads the checkpoint named by ``config.model.path``, sizes the paged KV
cache and serves requests with continuous batching. It is synchronous: ``step`` runs one
prefill or decode batch; ``generate`` and ``stream`` drive ``step`` until their requests finish
(other requests in the engine advance too).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from deploy.config import Config
from graphs.backends import create_backend
from graphs.buckets import default_decode_ladder
from graphs.decode import DecodeGraphRunner
from graphs.metrics import GraphMetrics
from graphs.prefill import PrefillGraphRunner, default_prefill_ladder
from worker.attention.factory import create_attention_backend
from worker.detokenizer import OutputText
from worker.graph_steps import ModelDecodeStep, ModelPrefillStep
from worker.kv_cache import KVCacheShape, PageAllocator, PagedKVCache
from worker.model.kernels import select_kernels
from worker.model.loader import load_model, resolve_dtype
from worker.model_runner import ModelRunner
from worker.request import Request, RequestRejected, Status
from worker.sampling.params import SamplingParams
from worker.scheduler import Scheduler, SchedulerLimits
from worker.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    """What one engine step did (kept for metrics)."""

    phase: str
    batch_size: int
    num_tokens: int
    duration_s: float


@dataclass(frozen=True)
class RequestEvent:
    """Progress of one request in one step: new tokens, the text they completed, and finish."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[float] | None = None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None
    num_preemptions: int


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device=cuda but CUDA is not available; use model.device=auto or cpu")
    return torch.device(name)


class Engine:
    """Continuous-batching inference over one model on one device."""

    def __init__(self, config: Config, registry: CollectorRegistry | None = None) -> None:
        if not config.model.path:
            raise ValueError("model.path is not set: pass a checkpoint directory (--model DIR)")
        self.config = config
        self.device = resolve_device(config.model.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        dtype = resolve_dtype(config.model.dtype, self.device)
        model_dir = Path(config.model.path)
        self.tokenizer = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        kernels = select_kernels(self.device, prefer_fused=config.attention.backend != "torch")
        limit = config.model.max_model_len
        self.model, self.arch = load_model(model_dir, dtype, self.device, kernels=kernels, max_positions=None)
        max_len = self.arch.max_position_embeddings
        if self.arch.sliding_window and self.arch.sliding_window < max_len:
            log.warning("sliding_window=%d: capping max_model_len to it (sliding attention is not "
                        "implemented; within the window it equals full attention)", self.arch.sliding_window)
            max_len = self.arch.sliding_window
        if limit is not None:
            if limit > max_len:
                raise ValueError(f"model.max_model_len={limit} exceeds the checkpoint's limit {max_len}")
            max_len = limit
        page_size = config.cache.page_size
        num_pages = self._num_pages(dtype)
        max_len = min(max_len, (num_pages - 1) * page_size)
        self.max_model_len = max_len
        self.kv_cache = PagedKVCache(
            KVCacheShape(self.arch.num_layers, num_pages, page_size,
                         self.model.attention_shape.num_kv_heads, self.arch.head_dim),
            dtype, self.device)
        sched = config.scheduler
        max_rows = sched.max_running_requests
        self.prefill_ceiling = (max(config.graphs.prefill.token_buckets) if config.graphs.prefill.token_buckets
                                else config.graphs.prefill.resolved_max_tokens(sched.chunked_prefill_size))
        max_tokens = max(sched.max_num_batched_tokens, max_rows, self.prefill_ceiling)
        self.attention = create_attention_backend(
            config.attention.backend, self.model.attention_shape, self.kv_cache, max_rows, max_tokens,
            -(-max_len // page_size))
        self.registry = registry if registry is not None else CollectorRegistry()
        self.graph_metrics = GraphMetrics(self.registry)
        # Prefill first: its largest shape reserves the most pool memory, which decode then reuses.
        prefill_graphs, prefill_reason = self._build_prefill_graphs()
        decode_graphs, eager_reason = self._build_decode_graphs()
        self.runner = ModelRunner(self.model, self.attention, decode_graphs, self.graph_metrics, eager_reason,
                                  prefill_graphs, prefill_reason)
        self.allocator = PageAllocator(num_pages)
        self.scheduler = Scheduler(
            SchedulerLimits(sched.max_running_requests, sched.max_num_batched_tokens,
                            sched.chunked_prefill_size, page_size), self.allocator)
        self.requests: dict[str, Request] = {}
        self._texts: dict[str, OutputText] = {}
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._rng = random.Random(config.model.seed)
        self.step_stats: deque[StepStats] = deque(maxlen=10_000)
        log.info("engine ready: %s attention, %d KV pages of %d tokens, max_model_len %d",
                 self.attention.name, num_pages, page_size, max_len)

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
        if self.device.type != "cuda" and name != "debug":
            log.info("no CUDA device: CUDA graphs are off and %s runs eagerly on %s "
                     "(graphs.%s.backend=%s needs CUDA; graphs.debug=true runs the runner path on CPU)",
                     phase, self.device, phase, name)
            return None, "no_cuda"
        if name == "tc_piecewise":
            raise ValueError("graphs.prefill.backend=tc_piecewise (the torch.compile comparator) is not built yet; "
                             "use breakable, full, eager or debug")
        return name, ""

    def _build_prefill_graphs(self) -> tuple[PrefillGraphRunner | None, str]:
        """The prefill graph runner the config asks for, captured now; or None and why not."""
        name, reason = self._graph_backend_name("prefill")
        if name is None:
            return None, reason
        p, chunk = self.config.graphs.prefill, self.config.scheduler.chunked_prefill_size
        ladder = list(p.token_buckets) if p.token_buckets else default_prefill_ladder(self.prefill_ceiling)
        if name == "full":
            log.warning("graphs.prefill.backend=full is experimental: attention is recorded inside the graph "
                        "with fixed request slots; breakable is the production default")
        step = ModelPrefillStep(self.model, self.attention, breakable=name != "full")
        runner = PrefillGraphRunner(step, create_backend(name, self.device), ladder,
                                    p.resolved_num_request_slots(chunk), p.max_padding_ratio, self.graph_metrics,
                                    self.model.dtype)
        runner.capture_all(timeout_s=self.config.graphs.capture_timeout_s)
        return runner, "disabled"

    def _build_decode_graphs(self) -> tuple[DecodeGraphRunner | None, str]:
        """The decode graph runner the config asks for, captured now; or None and why not."""
        g = self.config.graphs
        name, reason = self._graph_backend_name("decode")
        if name is None:
            return None, reason
        max_bs = min(g.decode.max_batch_size, self.config.scheduler.max_running_requests)
        ladder = list(g.decode.batch_sizes) if g.decode.batch_sizes else default_decode_ladder(max_bs)
        step = ModelDecodeStep(self.model, self.attention, breakable=name == "breakable")
        runner = DecodeGraphRunner(step, create_backend(name, self.device), ladder, g.decode.padding,
                                   self.graph_metrics)
        runner.capture_all(timeout_s=g.capture_timeout_s)
        return runner, "disabled"

    def _num_pages(self, dtype: torch.dtype) -> int:
        cache = self.config.cache
        if cache.num_pages is not None:
            return cache.num_pages
        if self.device.type != "cuda":
            return cache.cpu_num_pages
        shape = KVCacheShape(self.arch.num_layers, 1, cache.page_size,
                             self.model.attention_shape.num_kv_heads, self.arch.head_dim)
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = total * (1 - cache.gpu_memory_fraction) + self._activation_bytes()
        pages = int((free - reserve) // shape.bytes_per_page(dtype))
        if pages < 2:
            raise RuntimeError(f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free); "
                               "lower scheduler.max_num_batched_tokens or raise cache.gpu_memory_fraction")
        return pages

    def _activation_bytes(self) -> int:
        """Activation and logits peak of the largest step, estimated from the shapes."""
        a, s = self.arch, self.config.scheduler
        elem = self.model.dtype.itemsize
        per_token = (4 * a.hidden_size + 2 * a.intermediate_size + a.q_size + 2 * a.kv_size) * elem
        logits = s.max_running_requests * a.vocab_size * 4 * 3
        return int(2 * s.max_num_batched_tokens * per_token + logits + 512 * 2**20)

    # ----- requests -----

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this checkpoint has no tokenizer.json: pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; raises :class:`RequestRejected` (naming the problem) and changes nothing."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        if not ids:
            raise RequestRejected("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise RequestRejected(f"prompt token id {bad[0]} outside the vocabulary [0, {self.arch.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise RequestRejected(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                "(prompt plus at least one generated token must fit)")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestRejected(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        req = Request(rid, ids, params, seed, next(self._arrivals))
        self.requests[rid] = req
        self._texts[rid] = OutputText(self.tokenizer.incremental_decoder() if self.tokenizer else _NoText(),
                                      params.stop)
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> bool:
        """Finish ``request_id`` with reason ``abort`` and free its pages; False if unknown/finished."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self.scheduler.finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ----- stepping -----

    def step(self) -> list[RequestEvent]:
        """Run one prefill or decode batch; returns the events of the requests it advanced."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        start = time.perf_counter()
        out = self.runner.execute(batch, [r.seed for r, s in zip(batch.requests, batch.sample) if s])
        for req, n in zip(batch.requests, batch.num_new):
            req.num_computed += n
        events: list[RequestEvent] = []
        if out is not None:
            tokens = out.token_ids.tolist()
            logprobs = out.logprobs.tolist() if out.logprobs is not None else [None] * len(tokens)
            sampled = [r for r, s in zip(batch.requests, batch.sample) if s]
            for req, tok, lp in zip(sampled, tokens, logprobs):
                events.append(self._append_token(req, tok, lp))
        self.step_stats.append(StepStats("prefill" if batch.is_prefill else "decode", batch.size,
                                         batch.num_tokens, time.perf_counter() - start))
        return events

    def _append_token(self, req: Request, token: int, logprob: float | None) -> RequestEvent:
        req.prefilling = False
        req.output_ids.append(token)
        if logprob is not None and req.params.logprobs:
            req.logprobs.append(logprob)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        text = self._texts[req.request_id]
        delta, stopped = text.append(token)
        p = req.params
        reason = None
        if stopped or (not p.ignore_eos and token in self.arch.eos_token_ids) or token in p.stop_token_ids:
            reason = "stop"
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(req, reason)
            delta += text.flush()
        return RequestEvent(req.request_id, [token], delta, reason is not None, reason,
                            [logprob] if p.logprobs else None)

    def output(self, request_id: str) -> RequestOutput:
        req = self.requests[request_id]
        return RequestOutput(req.request_id, list(req.prompt_ids), list(req.output_ids),
                             self._texts[request_id].text, req.finish_reason,
                             list(req.logprobs) if req.params.logprobs else None, req.num_preemptions)

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping."""
        req = self.requests.get(request_id)
        if req is not None and req.status is Status.FINISHED:
            del self.requests[request_id]
            del self._texts[request_id]

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion (batched) and return their outputs in order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while any(not self.requests[i].finished for i in ids):
            self.step()
        outputs = [self.output(i) for i in ids]
        for i in ids:
            self.release(i)
        return outputs

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestEvent]:
        """Yield this request's events as the engine steps; closing the iterator aborts it."""
        rid = self.add_request(prompt, params)
        try:
            while True:
                for ev in self.step():
                    if ev.request_id == rid:
                        yield ev
                        if ev.finished:
                            return
                if self.requests[rid].finished:
                    return
        finally:
            self.abort(rid)
            self.release(rid)


class _NoText:
    """Stands in for a tokenizer's incremental decoder when the checkpoint has none."""

    def add(self, token_id: int) -> str:
        return ""
