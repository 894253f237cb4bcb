"""Capture cost and memory of prefill graphs (GPU).

1. Build time of the default ~40-shape prefill ladder up to the chunked-prefill size, per
   backend (breakable, full, tc_piecewise). tc_piecewise's build is two costs, reported apart:
   ``compile_s`` (torch.compile: dynamo trace, split, inductor; once for every shape) and
   ``capture_s`` (warm-up and piecewise capture of every shape).
2. Memory above the model, against the no-graph (eager) baseline, with prefill graphs captured
   up to 1/4, 1/2 and 1x the chunk, then one prefill of exactly the chunk size: below 1x the
   largest chunk still runs eagerly and keeps its activation peak; at 1x it replays inside graph
   memory. ``peak``: the most the allocator reserved from before capture to after the prefill
   (what the KV cache must leave room for); ``held``: what it still reserves after the prefill
   (what a serving process keeps); ``pool``: the graph pool's share of that; ``live_peak``: the
   most it had handed out at once (reserved above that is the caching allocator's slack).
   A configuration's fifth field says where the prefill's LM head runs: ``graph`` (the default
   with prefill graphs, as ``Worker`` builds them) inside the graphs, into the decode graphs' static
   logits when there are decode graphs; ``compute`` eagerly after a replay, on the current stream;
   ``capture`` eagerly on the capture stream: one cuBLAS workspace instead of two (torch keeps one
   per handle and stream, a handle per thread; here one thread does everything).
3. Warm-ups inside the graph pool (``graphs.warm_up_in_pool``, the default) beside warm-ups
   outside it, for breakable and full at the chunk size.
4. The serving process's view (``decode`` column): every server also decodes. ``eager``: after the
   prefill, one eager decode step at the largest decode batch; ``graphs``: full decode graphs
   (the default ladder up to ``--decode-batch``) captured after the prefill graphs into the same
   process pool, as ``Worker.capture`` does, and one replayed decode step. Rows with decode are
   compared with the no-prefill-graph row of the same decode mode (``vs_same_decode``).
   Each configuration runs in a fresh process (peaks are per process). ``outside_GiB`` is what
   stays held outside the graph pool; ``--explain`` adds the largest live allocations outside
   the pool, and those live inside it (graph outputs, boundary buffers, workspaces: what a replay
   keeps beside its scratch), by the line that made them (CUDA memory history: slower), and
   :mod:`bench.alloc_trace`'s reading of that history per pool: reserved and live peaks, the
   allocator's slack, each new segment with what was free when it was made, and the bytes a
   planned layout of the same allocations would need.
5. ``--served N``: after that, N more prefills of a serving history (random totals up to the chunk,
   each split into 1-16 requests of random lengths; the same seeded history in every
   configuration): ``served_peak_GiB`` and ``served_held_GiB`` are the peak and what is still
   reserved after it. Eager's caching allocator keeps blocks of every size it has seen, split and
   cached, where graph replays allocate nothing new: a serving process's memory, not one prefill's.
6. ``--mlp-chunk-tokens 0,2048``: every row once per value of ``graphs.prefill.mlp_chunk_tokens``
   (the none rows chunk their eager forward alike, to show what eager would save the same way;
   tc_piecewise runs whole), and ``chunk_ms``, the chunk-size step's time, for what the chunks cost.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.capture_report import report  # noqa: E402
from bench.common import environment, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402


def _site(frames: list[dict]) -> str:
    """The first frame of an allocation that is ours (graphs/, worker/, bench/), else the first."""
    for f in frames:
        name = f.get("filename", "")
        if any(f"/{d}/" in name for d in ("graphs", "worker", "bench")) and "site-packages" not in name:
            return f"{'/'.join(name.split('/')[-2:])}:{f.get('line')} {f.get('name')}"
    return f"{frames[0].get('filename', '?').split('/')[-1]}:{frames[0].get('line')} {frames[0].get('name')}" \
        if frames else "?"


def pool_sites(pool: tuple | None, inside: bool, top: int = 8) -> list[tuple[str, int]]:
    """Live allocations (bytes) outside ``pool`` (``inside``: in it), grouped by allocation site,
    largest first; a block of exactly 32 MiB is marked as a likely cuBLAS workspace (torch 2.11
    makes one per (thread, stream) at the stream's first GEMM, from the caching allocator)."""
    sites: dict[str, int] = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        in_pool = pool is not None and tuple(seg.get("segment_pool_id", ())) == tuple(pool)
        if in_pool != inside:
            continue
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                key = _site(block.get("frames", []))
                if block["size"] == 32 * 2**20:
                    key += " [32 MiB: cuBLAS workspace?]"
                sites[key] = sites.get(key, 0) + block["size"]
    return sorted(sites.items(), key=lambda kv: -kv[1])[:top]


def served_history(n: int, chunk: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """``n`` prefill steps of a serving history: each a list of request lengths (1-16 requests, each
    at most ``max_len`` tokens) whose total is random in [1, ``chunk``]."""
    rng = random.Random(seed)
    steps = []
    for _ in range(n):
        total = rng.randint(1, chunk)
        k = min(rng.randint(1, 16), total)
        k = max(k, -(-total // max_len))
        cuts = sorted(rng.sample(range(1, total), k - 1)) if k > 1 else []
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
        while max(lengths) > max_len:  # rare: even out a request past the model's positions
            i = lengths.index(max(lengths))
            j = lengths.index(min(lengths))
            move = min(lengths[i] - max_len, max_len - lengths[j])
            lengths[i] -= move
            lengths[j] += move
        steps.append(lengths)
    return steps


def one(path: Path, chunk: int, ceiling: int | None, backend: str, warm_up_in_pool: bool = True,
        decode: str = "-", decode_batch: int = 256, explain: bool = False, served: int = 0,
        lm_head: str = "graph", mlp_chunk: int = 0) -> dict:
    """In this process: load, capture (unless ceiling is None), run one chunk-sized prefill (and,
    with ``decode``, capture decode graphs and run one decode step at ``decode_batch``), then
    ``served`` prefills of :func:`served_history`. ``lm_head``: ``graph`` (the prefill graphs end in
    the LM head's logits, as the worker builds them), or the stream of an eager LM head after a
    replay: ``compute`` (the current one) or ``capture`` (the process's capture stream, ordered both
    ways: torch keys a cuBLAS workspace by handle and stream, so this row shows what one workspace
    instead of two saves). ``mlp_chunk``: the MLP's row chunk in tokens (0: whole), in the prefill
    graphs (``graphs.prefill.mlp_chunk_tokens``) or, in a row without them, in the eager forward.
    ``chunk_ms``: the median of 10 more chunk-size prefill steps (replays, or eager forwards)."""
    from bench.decode import timed
    from graphs.backends import create_backend
    from graphs.buckets import default_decode_ladder
    from graphs.decode import DecodeGraphRunner, LiveDecodeBatch
    from graphs.prefill import PrefillGraphRunner, default_prefill_ladder
    from graphs.process import capture_stream, graph_pool, pool_bytes
    from worker.attention.base import AttentionBatch
    from worker.attention.factory import create_attention_backend
    from worker.kv_cache import KVCacheShape, PagedKVCache
    from worker.model.kernels import select_kernels
    from worker.model.loader import load_model
    from worker.model_steps import CompiledPrefillStep, ModelDecodeStep, ModelPrefillStep

    cuda = torch.device("cuda")
    model, arch = load_model(path, torch.bfloat16, cuda, kernels=select_kernels(cuda))
    pages = chunk // 16 + 2 + 16 + 8  # + per-request page rounding (up to 16 requests a step)
    shape = model.attention_shape
    cache = PagedKVCache(KVCacheShape(arch.num_layers, pages, 16, shape.num_kv_heads, arch.head_dim),
                         torch.bfloat16, cuda)
    rows = max(1, chunk // 512, decode_batch if decode != "-" else 1)
    attention = create_attention_backend("flashinfer", shape, cache, rows, chunk, pages)
    pool = graph_pool(cuda)
    torch.cuda.synchronize()
    start_segments = None
    if explain:
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=400_000)
        start_segments = torch.cuda.memory._snapshot()["segments"]
    base, base_allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    build = compile_s = capture_s = None
    runner = decode_runner = None
    chunk_tokens = mlp_chunk or None
    if decode == "graphs":  # built first (its static logits may take the prefill graphs' logits), captured after
        decode_runner = DecodeGraphRunner(ModelDecodeStep(model, attention, breakable=False),
                                          create_backend("full", cuda, pool=pool, warm_up_in_pool=warm_up_in_pool),
                                          default_decode_ladder(decode_batch), True)
    if ceiling is not None:
        step = CompiledPrefillStep(model, attention) if backend == "tc_piecewise" else \
            ModelPrefillStep(model, attention, breakable=backend == "breakable", mlp_chunk_tokens=chunk_tokens)
        runner = PrefillGraphRunner(step, create_backend(backend, cuda, pool=pool, warm_up_in_pool=warm_up_in_pool),
                                    default_prefill_ladder(ceiling),
                                    max(1, chunk // 512), 2.0, None, torch.bfloat16, logits=lm_head == "graph",
                                    logits_out=decode_runner.buffers.logits
                                    if decode_runner is not None and lm_head == "graph" else None)
        start = time.perf_counter()
        runner.capture_all(progress=False)
        build = time.perf_counter() - start
        if backend == "tc_piecewise":
            stats = runner.backend.stats()
            compile_s, capture_s = stats["compile_seconds"], stats["capture_seconds"]
        else:
            compile_s, capture_s = 0.0, build
    if decode_runner is not None:  # after the prefill graphs, into the same pool (Worker.capture's order)
        decode_runner.capture_all(progress=False)
    torch.cuda.reset_peak_memory_stats()
    from graphs.prefill import LivePrefillBatch

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        if lm_head == "compute":
            return model.compute_logits(hidden)
        stream, current = capture_stream(cuda), torch.cuda.current_stream(cuda)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            out = model.compute_logits(hidden)
        current.wait_stream(stream)
        return out

    def prefill(lengths: list[int]) -> str:
        """One prefill step of requests of ``lengths`` tokens (pages from 1 on), as a server runs
        it: replayed when the runner covers it, else eager; the LM head on the sampled rows inside the
        graph (``lm_head=graph``) or eagerly after it."""
        tables, first = [], 1
        for n in lengths:
            tables.append(list(range(first, first + -(-n // 16))))
            first += -(-n // 16)
        total = sum(lengths)
        ids = torch.randint(10, arch.vocab_size, (total,), device="cuda")
        pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])
        last = torch.tensor(lengths, device="cuda").cumsum(0) - 1  # the rows a server samples
        live = LivePrefillBatch(ids, pos, AttentionBatch.prefill(lengths, lengths, tables), len(lengths), last)
        choice = runner.decide(live) if runner is not None else None
        if choice is not None and choice.replays:
            hidden, how = runner.execute(live, choice), "graph"
            if runner.logits:
                return how
        else:
            attention.plan(live.attention)
            hidden, how = model(ids, pos, attention, chunk_tokens).index_select(0, last), "eager"
        logits(hidden)
        return how

    # A chunk of exactly ``chunk`` tokens, split into requests no longer than the model's
    # positions (tinyllama-1.1b has 2048: one 8192-token request would index past its RoPE table).
    n_req = -(-chunk // arch.max_position_embeddings)
    chunk_lengths = [chunk // n_req + (i < chunk % n_req) for i in range(n_req)]
    mode = prefill(chunk_lengths)
    if decode != "-":  # one page a row, 16 tokens of context
        d_ids = torch.randint(10, arch.vocab_size, (decode_batch,), device="cuda")
        d_live = LiveDecodeBatch(d_ids, torch.full((decode_batch,), 15, device="cuda"),
                                 AttentionBatch.decode([16] * decode_batch, [[1 + i] for i in range(decode_batch)]))
        d_choice = decode_runner.decide(d_live) if decode_runner is not None else None
        if d_choice is not None and d_choice.replays:
            decode_runner.execute(d_live, d_choice)
        else:
            attention.plan(d_live.attention)
            model.compute_logits(model(d_ids, d_live.positions, attention))
    torch.cuda.synchronize()
    held = torch.cuda.memory_reserved() - base
    peak = torch.cuda.max_memory_reserved() - base
    live_peak = torch.cuda.max_memory_allocated() - base_allocated
    in_pool = pool_bytes(pool)
    chunk_ms = timed(lambda: prefill(chunk_lengths), 10, warmup=0) * 1e3  # the prefill above warmed it up
    served_peak = served_held = None
    served_modes: dict[str, int] = {}
    if served:
        for lengths in served_history(served, chunk, arch.max_position_embeddings):
            how = prefill(lengths)
            served_modes[how] = served_modes.get(how, 0) + 1
        torch.cuda.synchronize()
        served_peak = torch.cuda.max_memory_reserved() - base
        served_held = torch.cuda.memory_reserved() - base
    sites = [{"site": k, "MiB": v / 2**20} for k, v in pool_sites(pool, False)] if explain else None
    pool_live = [{"site": k, "MiB": v / 2**20} for k, v in pool_sites(pool, True)] if explain else None
    allocator = None
    if explain:
        from bench.alloc_trace import analyze

        snap = torch.cuda.memory._snapshot()
        allocator = analyze(start_segments, snap["device_traces"][torch.cuda.current_device()], snap["segments"],
                            site=_site)
    return {"backend": backend, "ceiling": ceiling, "mode": mode, "decode": decode, "lm_head": lm_head,
            "decode_shapes": len(decode_runner.ladder) if decode_runner else 0,
            "outside_bytes": held - in_pool, "outside_sites": sites, "pool_live_sites": pool_live,
            "allocator": allocator, "mlp_chunk": mlp_chunk, "chunk_ms": chunk_ms,
            "warm_up": ("pool" if warm_up_in_pool else "outside") if runner else None,
            "build_s": build, "compile_s": compile_s,
            "capture_s": capture_s, "failed": len(runner.failed) if runner else 0,
            "shapes": len(runner.ladder) if runner else 0,
            "above_baseline_bytes": peak, "live_peak_bytes": live_peak,
            "pool_growth_by_shape": {f"{phase}:{key}": shape.resident_bytes
                                     for phase, r in (("prefill", runner), ("decode", decode_runner)) if r
                                     for key, shape in r.backend.shapes.items() if shape.resident_bytes},
            "held_bytes": held, "pool_bytes": in_pool,
            "served": served, "served_modes": served_modes, "served_peak_bytes": served_peak,
            "served_held_bytes": served_held}


def parse_config(spec: str) -> tuple[str, str, str, str, str]:
    """``backend:ceiling:warm_up[:decode[:lm_head]]`` as a 5-tuple (decode ``-`` and lm_head ``graph``,
    or ``compute`` for ``none``, when left out); a spec with fewer than three or more than five
    fields, or an unknown decode or lm_head, is a ValueError naming it."""
    fields = spec.split(":")
    if not 3 <= len(fields) <= 5:
        raise ValueError(f"configuration {spec!r}: expected backend:ceiling:warm_up[:decode[:lm_head]]")
    default_head = "compute" if fields[0] == "none" else "graph"
    backend, ceiling, warm_up, decode, lm_head = (fields + ["-", default_head][len(fields) - 3:])[:5]
    if decode not in ("-", "eager", "graphs"):
        raise ValueError(f"configuration {spec!r}: decode must be -, eager or graphs, not {decode!r}")
    if lm_head not in ("graph", "compute", "capture") or (backend == "none" and lm_head == "graph"):
        raise ValueError(f"configuration {spec!r}: lm_head must be graph (with prefill graphs), compute or capture, "
                         f"not {lm_head!r}")
    return backend, ceiling, warm_up, decode, lm_head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinyllama-1.1b")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    ap.add_argument("--only", help="comma-separated configurations backend:ceiling:warm_up[:decode[:lm_head]] "
                    "(warm_up: pool or outside; decode: -, eager or graphs; lm_head: graph, the default, or "
                    "compute or capture, the stream of an eager LM head after a replay; e.g. "
                    "none:none:-,full:8192:pool:graphs,breakable:8192:pool:-:capture); default: all")
    ap.add_argument("--decode-batch", type=int, default=256, help="largest decode batch (decode rows)")
    ap.add_argument("--no-decode", action="store_true", help="leave out the rows with decode")
    ap.add_argument("--explain", action="store_true",
                    help="record CUDA memory history: the largest live allocations by site, the allocator's "
                         "slack and growths per pool, a planned layout's bytes (bench/alloc_trace.py)")
    ap.add_argument("--served", type=int, default=0,
                    help="then this many prefills of a seeded serving history (random sizes up to the chunk)")
    ap.add_argument("--mlp-chunk-tokens", default="0",
                    help="comma-separated, each row once per value: the MLP's row chunk in tokens inside the prefill "
                         "graphs (graphs.prefill.mlp_chunk_tokens), or in the eager forward of a row without them; "
                         "0 = whole (the no-graph baseline is the none row at 0); e.g. 0,2048")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    path = ensure_checkpoint(args.preset, Path(args.checkpoints))
    if args.one:
        backend, ceiling, warm_up, decode, lm_head = parse_config(args.one)
        print(json.dumps(one(path, args.chunk, None if ceiling == "none" else int(ceiling), backend,
                             warm_up == "pool", decode, args.decode_batch, args.explain, args.served, lm_head,
                             int(args.mlp_chunk_tokens))))
        return
    # One process per configuration also isolates tc_piecewise's torch.compile state (process-wide).
    chunk = str(args.chunk)
    runs = [("none", "none", "-", "-")] + [(b, chunk, "pool", "-") for b in ("breakable", "full", "tc_piecewise")] + \
        [(b, chunk, "outside", "-") for b in ("breakable", "full")] + \
        [("breakable", str(args.chunk * f // 4), "pool", "-") for f in (1, 2)]
    if not args.no_decode:
        runs += [("none", "none", "-", d) for d in ("eager", "graphs")] + \
            [(b, chunk, "pool", "graphs") for b in ("breakable", "full")]
    runs = [(*r, "compute" if r[0] == "none" else "graph") for r in runs]
    if args.only:
        try:
            runs = [parse_config(c) for c in args.only.split(",")]
        except ValueError as e:
            ap.error(str(e))
    try:
        chunks = [int(v) for v in args.mlp_chunk_tokens.split(",")]
    except ValueError:
        ap.error(f"--mlp-chunk-tokens: comma-separated token counts, got {args.mlp_chunk_tokens!r}")
    if any(v < 0 for v in chunks):
        ap.error(f"--mlp-chunk-tokens: 0 (whole) or a positive token count, got {args.mlp_chunk_tokens!r}")
    runs = [(*r, c) for r in runs for c in (chunks if r[0] != "tc_piecewise" else [0])]  # it compiles the MLP whole
    rows = []
    for backend, ceiling, warm_up, decode, lm_head, mlp_chunk in runs:
        cmd = [sys.executable, __file__, "--preset", args.preset, "--chunk", chunk, "--checkpoints",
               args.checkpoints, "--decode-batch", str(args.decode_batch), "--one",
               f"{backend}:{ceiling}:{warm_up}:{decode}:{lm_head}", "--served", str(args.served),
               "--mlp-chunk-tokens", str(mlp_chunk)] + \
            (["--explain"] if args.explain else [])
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
        rows.append(json.loads(lines[-1]) if lines else
                    {"backend": backend, "ceiling": ceiling, "warm_up": warm_up, "decode": decode, "lm_head": lm_head,
                     "mlp_chunk": mlp_chunk, "error": res.stderr[-2000:]})

    report(rows, args.served)
    print(f"wrote {write_results('capture', {'env': environment(), 'rows': rows, 'args': vars(args)})}")


if __name__ == "__main__":
    main()
