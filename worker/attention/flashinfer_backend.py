"""Paged attention on flashinfer's batch prefill / decode wrappers (CUDA only).

Metadata lives in one preallocated int32 device buffer, cut into fixed regions::

    qo_indptr [R+1] | paged_kv_indptr [R+1] | paged_kv_last_page_len [R] | locations [T] | paged_kv_indices [N]

with a pinned host twin of the same layout. ``plan`` fills the host twin, issues one
non-blocking H2D copy of the used prefix, then calls the chosen wrapper's ``plan`` (flashinfer
runs its scheduler on the host and uploads the work split into the wrapper's own int workspace
with an async copy; it never synchronises the device, but it makes small H2D copies from pageable
memory, so it must never run inside a CUDA graph capture). ``run`` writes K/V with ``append_paged_kv_cache`` and
calls the wrapper's ``run``: device work only, so it can be captured.

CUDA graphs: a flashinfer wrapper created with ``use_cuda_graph=True`` keeps pointers to the
index buffers it was given and has a fixed batch size. :meth:`FlashInferBackend.graph_wrapper`
creates one per captured shape, bound to prefixes of the shared regions above. Once it exists,
every ``plan`` of a batch padded to exactly that shape routes to it, so a graph runner does::

    backend.graph_wrapper(is_prefill, num_rows, num_tokens)   # once per shape, before capture
    backend.plan(capture_batch, num_rows, ...); model(...)    # eager warm-up (JIT, caches)
    with torch.cuda.graph(g): model(...)                      # records run(): kernels read the buffers
    ...
    backend.plan(batch, num_rows, ...); g.replay()            # every step: re-plan (padded), then replay

``plan`` writes the padding rows (``AttentionBackend.plan``) into the host twin after the batch's
own rows; the batch's lists are read, never copied or extended.

Fast decode plan (``fast_decode_plan``, on by default in the engine config): a captured decode
shape's wrapper, once planned the ordinary way, is re-planned by calling its compiled scheduler
(``_cached_module.plan``) directly with the host arrays this backend already has, as vLLM's and
SGLang's ``fast_decode_plan`` do. flashinfer's Python ``plan`` around that call checks its
arguments, works the sequence lengths out again with torch CPU ops and copies indptr and
last_page_len into its buffers, which for a graph wrapper are the regions this backend has just
copied; none of that changes between steps of one shape. The call's arguments are those
``BatchDecodeWithPagedKVCacheWrapper.plan`` of flashinfer 0.7.2 passes for tensor-core (fa2)
decode; a wrapper that is not that case keeps the ordinary plan.

Workspaces: every wrapper of a backend, eager and per captured shape, shares one float workspace
and one 8 MiB device int workspace (flashinfer's default size; each wrapper keeps its own pinned
twin). The int workspace holds the work split ``plan`` uploads and ``run`` reads; sharing it is
the invariant the metadata regions above already rest on: the backend has one active plan, so a
``run`` or replay always reads the plan written last, for its own wrapper, and kernels are
stream-ordered. A wrapper of its own per captured shape held 8 MiB outside the graph pool per
shape (40 prefill shapes: 320 MiB). ``plan`` and ``run``/replay must be issued on the same stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from worker.attention.base import AttentionBackend, AttentionBatch, AttentionShape, Rope
from worker.attention.flashinfer_metadata import (
    build_metadata,
    check_kernels,
    fast_decode_plan,
    fast_plan_applies,
    graph_decode_split_rows,
)
from worker.attention.triton_paths import decode_attention_kernel, rope_store_launch
from worker.kv_cache import PagedKVCache

INT_WORKSPACE_BYTES = 8 << 20  # flashinfer's own default for a wrapper's int workspace
INSTALL_HINT = "flashinfer is not installed; install graphfleet[gpu] or set attention.backend=torch"


def _import_flashinfer() -> Any:
    try:
        import flashinfer
        import flashinfer.page  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken install is as unusable as a missing one
        raise ImportError(INSTALL_HINT) from exc
    return flashinfer


class FlashInferBackend(AttentionBackend):
    """flashinfer paged attention: batch prefill (causal, GQA) and batch decode.

    ``max_pages_per_row`` bounds one row's page table (default: every usable page); the
    indices region holds ``max_num_rows * max_pages_per_row`` entries. ``workspace_bytes`` is
    the shared float workspace (split-KV partial outputs; prefill graphs with many tokens need
    the most). ``decode_use_tensor_cores`` selects flashinfer's tensor-core decode (the FA2
    prefill kernel with one query row per request) instead of the CUDA-core decode kernel:
    vLLM always enables it (it is never slower, and much faster for GQA groups > 4) and SGLang
    enables it for groups >= 4, i.e. for every Llama-3 shape. ``q_dtype`` is the query/output
    dtype (default: the cache dtype). ``fast_decode_plan``: see the module docstring.
    ``decode_graph_split_kv`` (tensor-core decode): a captured decode shape splits the KV of
    every row into chunks and merges their partial results (flashinfer always splits in its
    CUDA-graph mode, so that the recorded merge kernel is right for any later context); off, each
    row's KV is read by one CTA per head group with no merge kernel: fewer kernels and no partial
    outputs at short contexts, far less parallelism at long ones and small batches. ``"auto"``
    decides per captured shape (:meth:`graph_splits_kv`). ``prefill_kernel`` and ``decode_kernel``:
    flashinfer's kernel family for each, ``"fa2"``, or ``"fa3"`` on Hopper (``check_kernels``); the
    KV-split setting and the fast plan are fa2's: fa3's scheduler splits as it sees fit and its
    wrappers re-plan through flashinfer's own plan.
    """

    name = "flashinfer"

    def __init__(self, shape: AttentionShape, kv_cache: PagedKVCache, max_num_rows: int, max_num_tokens: int,
                 max_pages_per_row: int | None = None, *, workspace_bytes: int = 256 << 20,
                 decode_use_tensor_cores: bool = True, q_dtype: torch.dtype | None = None,
                 fast_decode_plan: bool = False, fused_rope_store: bool = False,
                 decode_graph_split_kv: bool | str = True, prefill_kernel: str = "fa2",
                 decode_kernel: str = "fa2", fused_decode: bool = False) -> None:
        super().__init__(shape, kv_cache, max_num_rows, max_num_tokens)
        self._fi = _import_flashinfer()
        dev = kv_cache.device
        if dev.type != "cuda":
            raise ValueError("FlashInferBackend needs the KV cache on a CUDA device; use attention.backend=torch")
        check_kernels(prefill_kernel, decode_kernel, decode_use_tensor_cores, torch.cuda.get_device_capability(dev))
        self.prefill_kernel, self.decode_kernel = prefill_kernel, decode_kernel
        if shape.num_q_heads % shape.num_kv_heads:
            raise ValueError(f"num_q_heads={shape.num_q_heads} is not a multiple of num_kv_heads={shape.num_kv_heads}")
        if (kv_cache.shape.num_kv_heads, kv_cache.shape.head_dim) != (shape.num_kv_heads, shape.head_dim):
            raise ValueError("KV cache geometry does not match the attention shape")
        ps = kv_cache.page_size
        if kv_cache.num_pages * ps >= 2**31:
            raise ValueError("KV cache has >= 2**31 token locations; flashinfer's int32 indices cannot address it")
        self.page_size = ps
        self.q_dtype = q_dtype or kv_cache.dtype
        self.decode_use_tensor_cores = decode_use_tensor_cores
        self.fast_decode_plan = fast_decode_plan
        self.decode_graph_split_kv = decode_graph_split_kv
        # Decided once: captured decode shapes of fewer rows split the KV (checks the setting too).
        self._split_rows = graph_decode_split_rows(decode_graph_split_kv, shape.num_kv_heads,
                                                   torch.cuda.get_device_properties(dev).multi_processor_count)
        self._rope_store = rope_store_launch(shape.head_dim) if fused_rope_store else None
        self._fused_decode = decode_attention_kernel(shape, max_num_rows, dev) if fused_decode else None
        self.max_pages_per_row = max_pages_per_row or kv_cache.num_pages - 1
        rows, toks = max_num_rows, max_num_tokens
        # The prefill capacity plan (see graph_wrapper) puts all tokens of a shape in one row.
        self.max_num_indices = max(rows * self.max_pages_per_row, -(-toks // ps))

        sizes = {"qo_indptr": rows + 1, "kv_indptr": rows + 1, "last_page_len": rows, "locations": toks,
                 "indices": self.max_num_indices}
        self._offsets: dict[str, int] = {}
        total = 0
        for key, size in sizes.items():
            self._offsets[key] = total
            total += size
        self._host = torch.zeros(total, dtype=torch.int32, pin_memory=True)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(total, dtype=torch.int32, device=dev)
        region = {k: (self._offsets[k], self._offsets[k] + n) for k, n in sizes.items()}
        self.qo_indptr = self._dev[slice(*region["qo_indptr"])]
        self.paged_kv_indptr = self._dev[slice(*region["kv_indptr"])]
        self.paged_kv_last_page_len = self._dev[slice(*region["last_page_len"])]
        self.locations = self._dev[slice(*region["locations"])]
        self.paged_kv_indices = self._dev[slice(*region["indices"])]
        self._host_views = {k: self._host[slice(*r)] for k, r in region.items()}
        # Host-only inputs of the fast decode plan: query indptr (one token a row) and KV lengths.
        self._decode_qo_host = torch.arange(rows + 1, dtype=torch.int32)
        self._kv_lens_host = torch.zeros(rows, dtype=torch.int32)
        self._kv_lens_np = self._kv_lens_host.numpy()
        self._fast_wrappers: set[int] = set()  # ids of graph wrappers the fast plan may re-plan

        # append_paged_kv_cache addresses page indices[indptr[b] + pos // ps]: a single request
        # owning every page in order turns a flat location into (page, offset), i.e. a scatter.
        self._append_pages = torch.arange(kv_cache.num_pages, dtype=torch.int32, device=dev)
        self._append_indptr = torch.tensor([0, kv_cache.num_pages], dtype=torch.int32, device=dev)
        self._append_last = torch.tensor([ps], dtype=torch.int32, device=dev)
        self._append_batch = torch.zeros(toks, dtype=torch.int32, device=dev)

        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=dev)
        self.int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self._staged = torch.cuda.Event()
        self._eager_prefill = self._new_wrapper(True, None)
        self._eager_decode = self._new_wrapper(False, None)
        self._graph_wrappers: dict[tuple[bool, int, int], Any] = {}
        self._active: Any = None
        self._num_q = 0
        self._num_tokens = -1
        self._decode_planned = False
        warm = getattr(getattr(self._fi, "utils", None), "_get_cache_alibi_slopes_buf", None)
        if warm is not None:  # run() fetches this cached tensor; create it outside any capture
            warm(shape.num_q_heads, dev)

    def _new_wrapper(self, is_prefill: bool, rows: int | None) -> Any:
        fi, graph = self._fi, rows is not None
        if is_prefill:
            bufs = {} if not graph else dict(
                qo_indptr_buf=self.qo_indptr[: rows + 1], paged_kv_indptr_buf=self.paged_kv_indptr[: rows + 1],
                paged_kv_indices_buf=self.paged_kv_indices,
                paged_kv_last_page_len_buf=self.paged_kv_last_page_len[:rows])
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", use_cuda_graph=graph,
                                                             backend=self.prefill_kernel, **bufs)
        else:
            bufs = {} if not graph else dict(
                paged_kv_indptr_buffer=self.paged_kv_indptr[: rows + 1], paged_kv_indices_buffer=self.paged_kv_indices,
                paged_kv_last_page_len_buffer=self.paged_kv_last_page_len[:rows])
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_cuda_graph=graph,
                                                            backend=self.decode_kernel,
                                                            use_tensor_cores=self.decode_use_tensor_cores, **bufs)
        # The shared int workspace (module docstring); the wrapper's own 8 MiB goes back to the
        # allocator's cache, where the next wrapper's constructor finds it.
        wrapper.reset_workspace_buffer(self.workspace, self.int_workspace)
        return wrapper

    @staticmethod
    def _key(is_prefill: bool, num_rows: int, num_tokens: int) -> tuple[bool, int, int]:
        return (is_prefill, num_rows, num_tokens if is_prefill else num_rows)

    def graph_wrapper(self, is_prefill: bool, num_rows: int, num_tokens: int | None = None) -> Any:
        """The fixed-shape (``use_cuda_graph=True``) wrapper for one captured shape, created once.

        Decode shapes are keyed by ``num_rows`` (``num_tokens`` must equal it if given); prefill
        shapes by ``(num_rows, num_tokens)``. From now on ``plan`` routes batches of exactly this
        shape (padding included) to this wrapper, in eager steps too.

        Call outside any capture. Creating a prefill wrapper plans it once with all
        ``num_tokens`` in one row over the dummy page: flashinfer sizes a graph prefill plan
        (query tiling, partial-output scratch) from the token count of the wrapper's *first*
        plan and rejects later plans with more tokens. Either way the backend's current plan is
        clobbered: call ``plan`` for the real batch afterwards.

        What may happen where: ``plan`` (host scheduling, H2D copies) runs before capture and
        before every replay, never during capture. ``run`` is captured once per shape; the
        recorded kernels read the shared metadata buffers, this wrapper's int workspace and
        the float workspace, all of which ``plan`` rewrites in place. A replay therefore
        computes the batch of the latest ``plan``, which must have been of this shape.
        """
        num_tokens = num_rows if num_tokens is None else num_tokens
        if not is_prefill and num_tokens != num_rows:
            raise ValueError("a decode graph shape has one token per row")
        if not 0 < num_rows <= self.max_num_rows or not 0 < num_tokens <= self.max_num_tokens:
            raise ValueError(f"graph shape {num_rows} rows / {num_tokens} tokens exceeds the backend maximum")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("graph_wrapper() must be called before CUDA graph capture")
        key = self._key(is_prefill, num_rows, num_tokens)
        wrapper = self._graph_wrappers.get(key)
        if wrapper is None:
            wrapper = self._graph_wrappers[key] = self._new_wrapper(is_prefill, num_rows)
            if is_prefill:
                self.plan(AttentionBatch.dummy_prefill(num_tokens, self.page_size), num_rows, num_tokens)
        return wrapper

    def graph_safe(self, is_prefill: bool) -> bool:
        """Both phases can be captured once :meth:`graph_wrapper` exists for the shape."""
        return True

    def _plan(self, batch: AttentionBatch, num_rows: int, num_tokens: int) -> None:
        """Write ``batch``'s metadata and its padding, and plan the wrapper for the padded shape (host
        side, outside capture).

        Blocks only until the previous ``plan``'s H2D copies have been consumed (their pinned
        sources are reused), which in a serving loop has normally long happened.
        """
        rows, toks = num_rows, num_tokens
        if not 0 < rows <= self.max_num_rows or toks > self.max_num_tokens:
            raise ValueError(f"batch of {rows} rows / {toks} tokens exceeds the planned maximum "
                             f"{self.max_num_rows} / {self.max_num_tokens}")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("plan() cannot run during CUDA graph capture: plan before capture and before replay")
        if not batch.is_prefill and (any(q != 1 for q in batch.query_lens) or min(batch.seq_lens, default=1) < 1):
            raise ValueError("decode rows must have query_len=1 and seq_len>=1 (padding: dummy page, seq_len=1)")
        qo, kv, last, indices, locations = build_metadata(batch, self.page_size)
        q_total, kv_total = int(qo[-1]), int(kv[-1])
        live, pad = batch.num_rows, rows - batch.num_rows
        num_indices = len(indices) + (0 if batch.is_prefill else pad)  # a decode padding row has one page
        if num_indices > self.max_num_indices:
            raise ValueError(f"batch uses {num_indices} page-table entries; capacity is {self.max_num_indices} "
                             f"(max_num_rows * max_pages_per_row)")
        wrapper = self._graph_wrappers.get(self._key(batch.is_prefill, rows, toks))
        if wrapper is None:
            wrapper = self._eager_prefill if batch.is_prefill else self._eager_decode

        self._staged.synchronize()
        self._active, self._decode_planned = None, False  # a plan that fails half-way must not leave run() usable
        off, h = self._offsets, self._host_np
        for key, values in (("qo_indptr", qo), ("kv_indptr", kv), ("last_page_len", last), ("locations", locations),
                            ("indices", indices)):
            h[off[key]: off[key] + len(values)] = values
        # Padding rows after the batch's (see AttentionBackend.plan), written straight into the host twin.
        qo_pad, kv_pad = off["qo_indptr"] + live + 1, off["kv_indptr"] + live + 1
        last_pad = off["last_page_len"] + live
        if batch.is_prefill:  # sentinels: no query tokens, no pages, last_page_len 0
            h[qo_pad: qo_pad + pad] = q_total
            h[kv_pad: kv_pad + pad] = kv_total
            h[last_pad: last_pad + pad] = 0
        else:  # one query token each, on one dummy page holding one token
            h[qo_pad: qo_pad + pad] = np.arange(q_total + 1, q_total + pad + 1)
            h[kv_pad: kv_pad + pad] = np.arange(kv_total + 1, kv_total + pad + 1)
            h[last_pad: last_pad + pad] = 1
            indices_pad = off["indices"] + len(indices)
            h[indices_pad: indices_pad + pad] = PagedKVCache.DUMMY_PAGE
        h[off["locations"] + len(locations): off["locations"] + toks] = PagedKVCache.DUMMY_PAGE * self.page_size
        end = off["indices"] + num_indices
        self._dev[:end].copy_(self._host[:end], non_blocking=True)

        hv, s = self._host_views, self.shape
        # indptr / last_page_len go in as pinned host tensors: flashinfer needs them on the host for
        # its scheduler (a device tensor would force a D2H sync) and copies them to its own buffers.
        # indices go in as our device view: a host tensor would make graph-mode plan copy it blocking.
        common = dict(sm_scale=s.scale, q_data_type=self.q_dtype, kv_data_type=self.kv_cache.dtype,
                      non_blocking=True)
        if batch.is_prefill:
            wrapper.plan(hv["qo_indptr"][: rows + 1], hv["kv_indptr"][: rows + 1],
                         self.paged_kv_indices[:num_indices], hv["last_page_len"][:rows],
                         s.num_q_heads, s.num_kv_heads, s.head_dim, self.page_size, causal=True, **common)
            self._num_q = q_total
        elif id(wrapper) in self._fast_wrappers:
            self._fast_plan(wrapper, rows, batch.seq_lens)
            self._num_q = rows
        else:
            if wrapper.is_cuda_graph_enabled and self.decode_use_tensor_cores and not self.graph_splits_kv(rows):
                common["disable_split_kv"] = True
            wrapper.plan(hv["kv_indptr"][: rows + 1], self.paged_kv_indices[:num_indices], hv["last_page_len"][:rows],
                         s.num_q_heads, s.num_kv_heads, s.head_dim, self.page_size, **common)
            self._num_q = rows
            if self.fast_decode_plan and fast_plan_applies(wrapper):
                self._fast_wrappers.add(id(wrapper))
        self._staged.record()
        self._active = wrapper
        self._num_tokens = toks
        self._decode_planned = not batch.is_prefill

    def _fast_plan(self, wrapper: Any, rows: int, seq: Sequence[int]) -> None:
        """Re-plan a graph decode wrapper from the host twin just written (:func:`fast_decode_plan`)."""
        self._kv_lens_np[: len(seq)] = seq
        self._kv_lens_np[len(seq): rows] = 1
        fast_decode_plan(wrapper, self.shape, self.page_size, rows, self._decode_qo_host,
                         self._host_views["kv_indptr"], self._kv_lens_host, split_kv=self.graph_splits_kv(rows))

    def graph_splits_kv(self, rows: int) -> bool:
        """Whether the captured decode shape of ``rows`` rows splits each row's KV
        (``decode_graph_split_kv``; "auto": :func:`graph_decode_split_rows`)."""
        return rows < self._split_rows

    @property
    def fused_rope_store(self) -> bool:
        """Whether RoPE and the KV write run as one kernel (asked for, Triton present, head_dim served)."""
        return self._rope_store is not None

    def store_rotated(self, layer: int, rope: Rope, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """With ``fused_rope_store``: one Triton kernel rotates ``q`` in place and writes rotated ``k``
        and ``v`` at the planned locations (graph-safe). Under ``torch.compile`` tracing, or without
        it, RoPE and the append run as two kernels (:meth:`AttentionBackend.store_rotated`).

        The launch is unchecked: the cache's geometry was checked at construction, and the model
        hands row views of its fused QKV output with a contiguous last dim and its float32 cos/sin
        table (``rope_store.rope_and_store`` checks all of it, for callers that are not the model).
        """
        if self._rope_store is None or torch.compiler.is_compiling():
            return super().store_rotated(layer, rope, q, k, v)
        tokens = q.shape[0]
        if tokens != self._num_tokens:
            raise RuntimeError(f"store_rotated() with {tokens} tokens, but the last plan() was for {self._num_tokens}")
        self._rope_store(q, k, v, rope.positions, rope.cos_sin_cache, self.kv_cache.layer(layer), self.locations)
        return q.view(tokens, self.shape.num_q_heads, self.shape.head_dim)

    @property
    def fused_decode(self) -> bool:
        """Whether decode plans attend through the fused decode kernel (asked for, Triton present, shape served)."""
        return self._fused_decode is not None

    def run_with_rope(self, layer: int, rope: Rope, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """With ``fused_decode`` and a decode plan: RoPE, the KV write and attention in one Triton
        launch (:mod:`worker.attention.fused_decode`, graph-safe) over the planned metadata; else
        :meth:`store_rotated`, then flashinfer's attention. ``q`` and ``k`` are only read there."""
        if not self._decode_planned or self._fused_decode is None or torch.compiler.is_compiling():
            return super().run_with_rope(layer, rope, q, k, v)
        if q.shape[0] != self._num_tokens:
            raise RuntimeError(f"run_with_rope() with {q.shape[0]} tokens, but the last plan() was for "
                               f"{self._num_tokens}")
        return self._fused_decode.launch(q, k, v, rope.positions, rope.cos_sin_cache, self.kv_cache.layer(layer),
                                         self.locations, self.paged_kv_indptr, self.paged_kv_indices,
                                         self.paged_kv_last_page_len, self.shape.scale)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k, v`` at the planned locations (one fused kernel; graph-safe)."""
        tokens = k.shape[0]
        if tokens != self._num_tokens:
            raise RuntimeError(f"store() with {tokens} tokens, but the last plan() was for {self._num_tokens}")
        cache = self.kv_cache.layer(layer)
        self._fi.page.append_paged_kv_cache(
            k.to(cache.dtype), v.to(cache.dtype), self._append_batch[:tokens], self.locations[:tokens], cache,
            self._append_pages, self._append_indptr, self._append_last, "NHD")

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """Attend with the planned wrapper into ``out``; rows past the planned query tokens (tail
        padding) are left unspecified. Inside a capture the planned wrapper must be a
        :meth:`graph_wrapper` one (eager wrappers reallocate their metadata on every ``plan``, so a
        graph would keep reading freed memory)."""
        tokens = q.shape[0]
        if self._active is None or tokens != self._num_tokens:
            raise RuntimeError(f"attend() with {tokens} tokens, but the last plan() was for {self._num_tokens}")
        if not self._active.is_cuda_graph_enabled and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("capturing flashinfer attention for a shape without graph_wrapper(); "
                               "create it and re-plan before capture")
        if self._num_q > 0:
            self._active.run(q[: self._num_q], self.kv_cache.layer(layer), out=out[: self._num_q])
        elif torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the capture batch has no query tokens, so no attention kernel would be recorded")
