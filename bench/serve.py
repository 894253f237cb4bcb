"""Online serving through the OpenAI API, in the manner of ``vllm bench serve``.

Starts a graphfleet Serve app on 127.0.0.1 (or attaches to one with ``--url``), then for each
request rate of ``--rates`` sends ``--num-prompts`` random-token prompts with Poisson arrivals
(``inf``: all at once), streamed, and reports TTFT, TPOT, ITL and e2e (p50, p99), request and
output-token throughput, goodput (requests within ``--slo-ttft-ms`` and ``--slo-tpot-ms``, per
second), and from ``/metrics`` before and after each rate the decode graph hit ratio: replayed
decode passes (``decode_cuda_graph``, ``decode_breakable``, ``decode_tc_full``) over all decode passes of every rank,
and the TTFT's mean by phase: preprocessing, the engine's queue, its prefill, and the rest (the
fleet, the hops between processes, delivery).
``--compare`` also times the in-process engine's decode step at ``--compare-batch`` requests (at the
Serve side's mean context, ``--input-len`` + its tokens / 2) and
the same batch through Serve (steady-state decode tokens/s of both, and their ratio). The Serve
side runs ``--compare-repeats`` times, fresh prompts each, and reports the median (min, max) with
each run's window diagnostics (:func:`bench.serve_load.window_diagnostics`).

GPU machine: ``PYTHONPATH=/tmp/site:. python3 bench/serve.py`` (``--mode disaggregated``: with fewer
GPUs than the two groups' ranks, each rank gets a share of one, ``cluster.gpus_per_rank=0.5`` and
``cache.gpu_memory_fraction=0.4`` on one GPU, unless ``--set`` says otherwise; a group of the started
app that waits more than ``--placement-timeout-s`` for resources ends the run with what it asked for).
Here, on CPU: ``python bench/serve.py --quick`` (tiny-llama, a few prompts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.common import decode_step_seconds, environment, print_table, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from bench.serve_load import (  # noqa: E402
    ClientCpu,
    random_prompts,
    run_load,
    steady_decode_rate,
    summarize,
    window_diagnostics,
)
from bench.serve_start import _get, gpu_sharing_overrides, start_app, wait_healthy  # noqa: E402

REPLAYED = ("decode_cuda_graph", "decode_breakable", "decode_tc_full")
#: Sizes that keep a CPU run (no GPU) quick: small cache, batch and prefill chunks.
CPU_OVERRIDES = ["model.device=cpu", "cache.num_pages=1024", "scheduler.chunked_prefill_size=512",
                 "graphs.prefill.max_tokens=512"]


def decode_passes(base: str) -> tuple[dict[str, float], dict[str, float]]:
    """(decode passes by mode, decode fallbacks by reason), summed over every rank of ``/metrics``."""
    _, text = _get(f"{base}/metrics")
    modes: dict[str, float] = {}
    reasons: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("phase") != "decode":
                continue
            if s.name == "cuda_graph_passes_total":
                modes[s.labels["mode"]] = modes.get(s.labels["mode"], 0.0) + s.value
            elif s.name == "cuda_graph_fallbacks_total":
                reasons[s.labels["reason"]] = reasons.get(s.labels["reason"], 0.0) + s.value
    return modes, reasons


#: The TTFT and its phases, as histograms of /metrics: ours, and vLLM's where it has the same one.
TTFT_PHASES = {"ttft": "time_to_first_token_seconds", "preprocess": "graphfleet_request_preprocess_time_seconds",
               "queue": "request_queue_time_seconds", "prefill": "request_prefill_time_seconds",
               "overhead": "graphfleet_request_first_token_overhead_seconds"}


def phase_sums(base: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of :data:`TTFT_PHASES` over ``/metrics`` (``vllm:``-prefixed names too)."""
    _, text = _get(f"{base}/metrics")
    names = {n: k for k, n in TTFT_PHASES.items()} | {f"vllm:{n}": k for k, n in TTFT_PHASES.items()}
    sums: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            for suffix, i in (("_sum", 0), ("_count", 1)):
                if s.name.endswith(suffix) and s.name[: -len(suffix)] in names:
                    sums.setdefault(names[s.name[: -len(suffix)]], [0.0, 0.0])[i] += s.value
    return {k: (v[0], v[1]) for k, v in sums.items()}


def phase_means_ms(after: dict[str, tuple[float, float]], before: dict[str, tuple[float, float]]) -> dict:
    """``<phase>_mean_ms`` of the requests between two :func:`phase_sums` (None: the server has no such
    histogram). Ours add up to the TTFT's mean: preprocess + queue + prefill + overhead."""
    out = {}
    for k in TTFT_PHASES:
        s, c = after.get(k, (0.0, 0.0))
        s0, c0 = before.get(k, (0.0, 0.0))
        out[f"{k}_mean_ms"] = 1e3 * (s - s0) / (c - c0) if c > c0 else None
    return out


def gc_pause_totals(text: str) -> dict[str, float]:
    """Garbage collections in a ``/metrics`` text (``graphfleet_gc_pause_seconds``, every process
    summed): ``gen<g>_count`` and ``gen<g>_s`` per generation (2 = full collections); and the
    replica process's CPU seconds (``replica_cpu_s``, when it reports them)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("graphfleet_gc_pause_seconds_count", "graphfleet_gc_pause_seconds_sum"):
                key = f"gen{s.labels['generation']}_{'count' if s.name.endswith('_count') else 's'}"
                out[key] = out.get(key, 0.0) + s.value
            elif s.name == "graphfleet_replica_process_cpu_seconds_total":
                out["replica_cpu_s"] = s.value
    return out


def step_wait_totals(text: str) -> dict[str, float]:
    """The step read-backs' waits in a ``/metrics`` text, every rank summed: ``wait_s`` (seconds
    the reading thread waited, ``graphfleet_step_wait_seconds_total``) and ``cpu_s`` (its CPU
    meanwhile, ``graphfleet_step_wait_cpu_seconds_total``)."""
    names = {"graphfleet_step_wait_seconds_total": "wait_s", "graphfleet_step_wait_cpu_seconds_total": "cpu_s"}
    out = {"wait_s": 0.0, "cpu_s": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                out[names[s.name]] += s.value
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def hit_ratio(modes: dict[str, float]) -> float | None:
    total = sum(modes.values())
    return sum(modes.get(m, 0.0) for m in REPLAYED) / total if total else None


def in_process_decode(path: Path, overrides: list[str], batch: int, context: int, repeats: int) -> dict:
    """Median decode step of the in-process engine with ``batch`` requests of ``context`` tokens."""
    from deploy.config import load_config
    from worker.engine import Engine

    engine = Engine(load_config(None, [f"model.path={path}", *overrides]))
    step = decode_step_seconds(engine, batch, context, repeats)
    assert all(s.phase == "decode" and s.batch_size == batch for s in list(engine.step_stats)[-repeats:])
    engine.shutdown()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"batch": batch, "step_ms": step * 1e3, "tokens_per_s": batch / step}


def model_max_len(card: dict, path: Path | None) -> tuple[int | None, str]:
    """The longest sequence the server takes, and where that came from: its ``/v1/models`` card's
    ``max_model_len`` (ours and vLLM's give it), else the checkpoint's ``max_position_embeddings``."""
    if card.get("max_model_len"):
        return int(card["max_model_len"]), "the server's max_model_len"
    if path is not None:
        positions = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
        if positions:
            return int(positions), "the checkpoint's max_position_embeddings"
    return None, "unknown"


def capped_compare_tokens(tokens: int, input_len: int, max_len: int | None) -> int:
    """``tokens``, or fewer so that ``input_len`` + tokens fits ``max_len`` (None: no cap)."""
    if max_len is None:
        return tokens
    if max_len - input_len < 1:
        raise SystemExit(f"--input-len {input_len} leaves no room for output in a context of {max_len}")
    return min(tokens, max_len - input_len)


def aggregate_compare(runs: list[dict], in_process_tokens_per_s: float) -> dict:
    """The Serve side of ``--compare`` over its runs: the median ``serve_tokens_per_s`` and
    ``serve_over_in_process``, each with ``_min`` and ``_max``, over the runs that have a rate
    (``serve_runs_measured`` of them; a run with no window has None and is left out)."""
    rates = sorted(r["serve_tokens_per_s"] for r in runs if r.get("serve_tokens_per_s") is not None)
    out: dict = {"serve_runs_measured": len(rates)}
    for key, scale in (("serve_tokens_per_s", 1.0), ("serve_over_in_process", 1.0 / in_process_tokens_per_s)):
        out[key] = statistics.median(rates) * scale if rates else None
        out[f"{key}_min"] = rates[0] * scale if rates else None
        out[f"{key}_max"] = rates[-1] * scale if rates else None
    return out


def serve_decode_run(base: str, model: str, prompts: list[list[int]], tokens: int, seed: int, headers: dict,
                     in_process_tokens_per_s: float) -> dict:
    """One Serve side run of ``--compare``: every prompt at once, its steady decode rate, the ratio to
    in-process, and :func:`window_diagnostics` of it."""
    cpu = ClientCpu()
    records, _ = asyncio.run(run_load(base, model, prompts, tokens, float("inf"), seed, headers, cpu=cpu))
    served = steady_decode_rate(records)
    failed = [r for r in records if not r.ok]
    return {"serve_tokens_per_s": served,
            "serve_over_in_process": served / in_process_tokens_per_s if served else None,
            "completed": len(records) - len(failed), "failed": len(failed),
            **(window_diagnostics(records, cpu) or {}),
            **({"errors": sorted({r.error for r in failed})[:3]} if failed else {})}


#: Columns of the per-run table of ``--compare``.
COMPARE_RUN_COLUMNS = ["run", "serve_tokens_per_s", "serve_over_in_process", "failed", "window_s", "fallback",
                       "first_token_spread_ms", "requests_in_window", "tokens_in_window", "max_chunk_gap_ms",
                       "client_cpu_share", "client_loop_cpu_share"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="attach to a running app (base URL) instead of starting one")
    ap.add_argument("--api-key", help="bearer token of an attached app")
    ap.add_argument("--preset", default="tinyllama-1.1b", help="checkpoint preset of a started app")
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    ap.add_argument("--mode", choices=("colocated", "disaggregated"), default="colocated",
                    help="cluster.mode of a started app")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--rates", default="1,4,16,inf", help="requests per second, comma separated; inf = all at once")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, help="prompt token ids below this (default: the checkpoint's, "
                                                    "or 1000 with --url)")
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--compare", action="store_true", help="also in-process decode vs through Serve")
    ap.add_argument("--compare-batch", type=int, default=64)
    ap.add_argument("--compare-tokens", type=int, default=1024,
                    help="output tokens per request of the Serve side (capped so --input-len + it fits the context)")
    ap.add_argument("--compare-repeats", type=int, default=3,
                    help="Serve side runs of --compare, back to back (fresh prompts each); the median is reported")
    ap.add_argument("--warmup", type=int, default=2, help="requests sent one by one before measuring")
    ap.add_argument("--start-timeout-s", type=float, default=1800.0)
    ap.add_argument("--placement-timeout-s", type=float, default=120.0,
                    help="give up when a group of a started app waits longer than this for resources")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--direct-ingress", action="store_true",
                    help="clients talk to the ingress replica's own HTTP server, not through Serve's proxy")
    ap.add_argument("--quick", action="store_true", help="tiny-llama, few short prompts, rates 4,inf, compare on")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.num_prompts, args.input_len, args.output_len = "tiny-llama", 8, 32, 16
        args.rates, args.compare, args.compare_batch, args.compare_tokens = "4,inf", True, 4, 32
        args.compare_repeats = 2
    if args.compare_repeats < 1:
        ap.error("--compare-repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    overrides = ([] if torch.cuda.is_available() else list(CPU_OVERRIDES)) + [f"cluster.mode={args.mode}", *args.set]
    sharing = [] if args.url else gpu_sharing_overrides(args.mode, torch.cuda.device_count(), overrides)
    if sharing:
        print(f"{torch.cuda.device_count()} GPU(s) for the {args.mode} fleet's ranks: adding {' '.join(sharing)}")
        overrides += sharing
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    path = None if args.url else ensure_checkpoint(args.preset, Path(args.checkpoints))
    vocab = args.vocab_size or (json.loads((path / "config.json").read_text())["vocab_size"] if path else 1000)
    compare = None
    if args.compare:  # before the fleet takes the GPU
        if path is None:
            path = ensure_checkpoint(args.preset, Path(args.checkpoints))
        # At the Serve side's mean context: its requests decode from input_len to input_len + tokens.
        planned = capped_compare_tokens(args.compare_tokens, args.input_len, model_max_len({}, path)[0])
        context = args.input_len + planned // 2
        compare = {**in_process_decode(path, overrides, args.compare_batch, context, repeats=20),
                   "in_process_context": context}
    base = args.url.rstrip("/") if args.url else start_app(path, overrides, args.preset,
                                                           direct_ingress=args.direct_ingress)
    health = wait_healthy(base, args.start_timeout_s, None if args.url else args.placement_timeout_s)
    card = json.loads(_get(f"{base}/v1/models", headers)[1])["data"][0]
    model = card["id"]
    warm = random_prompts(args.warmup, args.input_len, vocab, args.seed + 1)
    for ids in warm:  # first kernels (flashinfer JIT) and shapes
        asyncio.run(run_load(base, model, [ids], args.output_len, float("inf"), args.seed, headers))

    rows = []
    for i, rate in enumerate(rates):
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed + 100 + i)
        before, phases_before = decode_passes(base), phase_sums(base)
        gc_before = gc_pause_totals(_get(f"{base}/metrics")[1])
        records, duration = asyncio.run(run_load(base, model, prompts, args.output_len, rate, args.seed + i,
                                                 headers))
        after, phases = decode_passes(base), phase_means_ms(phase_sums(base), phases_before)
        gc_during = _delta(gc_pause_totals(_get(f"{base}/metrics")[1]), gc_before)
        modes, reasons = _delta(after[0], before[0]), _delta(after[1], before[1])
        rows.append({"rate": rate, **summarize(records, duration, args.slo_ttft_ms, args.slo_tpot_ms),
                     "decode_graph_hit_ratio": hit_ratio(modes), "decode_passes": modes,
                     "decode_fallbacks": reasons, **phases,
                     "gc_full_collections": gc_during.get("gen2_count", 0.0),
                     "gc_full_ms": 1e3 * gc_during.get("gen2_s", 0.0),
                     "gc_all_ms": 1e3 * sum(v for k, v in gc_during.items()
                                            if k.startswith("gen") and k.endswith("_s")),
                     "replica_cpu_s": gc_during.get("replica_cpu_s"),
                     "replica_cpu_ms_per_request": (1e3 * gc_during["replica_cpu_s"] / len(records)
                                                    if "replica_cpu_s" in gc_during and records else None)})
    if compare is not None:
        max_len, source = model_max_len(card, path)
        tokens = capped_compare_tokens(args.compare_tokens, args.input_len, max_len)
        if tokens < args.compare_tokens:
            print(f"--compare-tokens {args.compare_tokens} capped to {tokens}: --input-len {args.input_len} + "
                  f"tokens must fit {max_len} ({source})")
        runs = []
        for k in range(args.compare_repeats):  # fresh prompts each run (the first run's are the old single run's)
            prompts = random_prompts(args.compare_batch, args.input_len, vocab, args.seed + 7 + 1000 * k)
            runs.append({"run": k, **serve_decode_run(base, model, prompts, tokens, args.seed + k, headers,
                                                      compare["tokens_per_s"])})
        compare.update({"context": args.input_len, "tokens": tokens, "tokens_requested": args.compare_tokens,
                        "max_model_len": max_len, "repeats": args.compare_repeats,
                        **aggregate_compare(runs, compare["tokens_per_s"]), "runs": runs})

    print_table([{**r, "rate": f"{r['rate']:g}"} for r in rows],
                ["rate", "completed", "failed", "request_throughput", "output_throughput", "goodput",
                 "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms",
                 "e2e_p50_ms", "e2e_p99_ms", "decode_graph_hit_ratio"])
    print("TTFT by phase (means, ms; from /metrics): preprocess + queue + prefill + overhead = ttft")
    print_table([{**r, "rate": f"{r['rate']:g}"} for r in rows], ["rate", *(f"{k}_mean_ms" for k in TTFT_PHASES)])
    print("Garbage collection in the replica and the ranks during each rate (graphfleet_gc_pause_seconds), and "
          "the replica process's CPU (graphfleet_replica_process_cpu_seconds_total)")
    print_table([{**r, "rate": f"{r['rate']:g}"} for r in rows], ["rate", "gc_full_collections", "gc_full_ms",
                                                                     "gc_all_ms", "replica_cpu_s",
                                                                     "replica_cpu_ms_per_request"])
    if compare is not None:
        print(f"--compare, Serve side: {compare['repeats']} runs of {compare['batch']} requests x "
              f"{compare['tokens']} tokens (window_s, first token spread, chunk gap: see bench/README.md)")
        print_table(compare["runs"], COMPARE_RUN_COLUMNS)
        print_table([compare], ["batch", "context", "in_process_context", "tokens_per_s", "serve_tokens_per_s",
                                "serve_tokens_per_s_min", "serve_tokens_per_s_max", "serve_over_in_process",
                                "serve_over_in_process_min", "serve_over_in_process_max"])
    name = "serve-quick" if args.quick else f"serve-{args.mode}" + ("-direct" if args.direct_ingress else "")
    out = write_results(name, {"env": environment(), "args": vars(args), "url": args.url, "overrides": overrides,
                               "fleet": health, "rows": rows, "compare": compare})
    print(f"wrote {out}")
    if not args.url:
        from ray import serve

        serve.shutdown()


if __name__ == "__main__":
    main()
