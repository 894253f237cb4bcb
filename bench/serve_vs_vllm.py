"""graphfleet's Serve app and vLLM's OpenAI server side by side: the same checkpoint, GPU and load.

One invocation serves the checkpoint with ``vllm serve`` (vLLM's OpenAI API server, run from its
own site directory in a process of its own: its pins differ from ours), sends it the load of
``bench/serve.py`` (``--num-prompts`` random-token prompts per rate of ``--rates``, Poisson
arrivals, streamed, ``--input-len`` in and ``--output-len`` out, the same seeds), stops it, then
starts graphfleet's app on the same checkpoint and sends it the same prompts (``--overlap-start``:
both start at once, saving the shorter start-up, and are loaded one after the other); our clients talk to
the ingress replica's own HTTP server as under ``graphfleet serve`` (``--proxy``: through Serve's
proxy, the Helm chart's path). Output tokens/s,
TTFT, TPOT and ITL per rate go side by side with graphfleet over vLLM. A peer that fails to start
or to serve is a row with its error, never a crashed bench.

``--shared-prefix N``: every prompt of a rate starts with the same N random tokens (a new prefix per
rate), then ``--input-len`` distinct ones, and each peer's prefix-cache hit rate over the rate is read
from its ``/metrics`` (``*prefix_cache_hits_total`` over ``*prefix_cache_queries_total``, tokens; vLLM
and graphfleet name them alike). Peers may be variants: ``vllm-no-prefix-cache`` (``vllm serve
--no-enable-prefix-caching``), ``graphfleet-no-prefix-cache`` (``cache.prefix_caching=false``) and
``graphfleet-least-loaded`` (``cluster.routing=least_loaded``, for ``cluster.num_colocated_groups`` >
1); every peer's TTFT and TPOT p50 are also given over the first peer's.

GPU machine: stage vLLM with ``../shared/device/stage-wheels --set vllm`` (it installs into
/tmp/vllm-site), then ``PYTHONPATH=/tmp/site:. python3 bench/serve_vs_vllm.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import environment, print_table, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from bench.serve import CPU_OVERRIDES, phase_means_ms, phase_sums  # noqa: E402
from bench.serve_load import random_prompts, run_load, shared_prefix_prompts, summarize  # noqa: E402
from bench.serve_start import _free_port, _get, start_app, wait_healthy  # noqa: E402

COLUMNS = ("output_throughput", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms",
           "completed", "failed", "prefix_cache_hit_rate", "ttft_mean_ms", "queue_mean_ms", "prefill_mean_ms",
           "preprocess_mean_ms", "overhead_mean_ms")
#: Peer variants: (server kind, extra graphfleet config overrides, extra vllm serve arguments).
PEERS = {"vllm": ("vllm", [], []), "vllm-no-prefix-cache": ("vllm", [], ["--no-enable-prefix-caching"]),
         "graphfleet": ("graphfleet", [], []),
         "graphfleet-no-prefix-cache": ("graphfleet", ["cache.prefix_caching=false"], []),
         "graphfleet-least-loaded": ("graphfleet", ["cluster.routing=least_loaded"], [])}


def early_starts(peers: list[str]) -> list[str]:
    """The peers ``--overlap-start`` starts together: every vLLM server (each its own process) and the first
    graphfleet peer only, since Ray and Serve run in this process, once at a time; a later graphfleet peer
    starts when the one before it has stopped."""
    first = next((p for p in peers if PEERS[p][0] == "graphfleet"), None)
    return [p for p in peers if PEERS[p][0] == "vllm" or p == first]


def prefix_cache_counts(base: str) -> tuple[float, float]:
    """(hit tokens, queried tokens) of the prefix cache, summed over every series of ``/metrics`` whose
    name ends in ``prefix_cache_hits_total`` / ``prefix_cache_queries_total`` (0, 0 without them)."""
    hits = queries = 0.0
    for line in _get(f"{base}/metrics")[1].splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        value = float(line.rsplit(" ", 1)[1])
        if name.endswith("prefix_cache_hits_total"):
            hits += value
        elif name.endswith("prefix_cache_queries_total"):
            queries += value
    return hits, queries
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def run_rates(base: str, args: argparse.Namespace, vocab: int) -> list[dict]:
    """``bench/serve.py``'s load against ``base``: warm-up requests, then every rate of ``--rates``."""
    model = json.loads(_get(f"{base}/v1/models")[1])["data"][0]["id"]
    for ids in random_prompts(args.warmup, args.input_len, vocab, args.seed + 1):
        asyncio.run(run_load(base, model, [ids], args.output_len, float("inf"), args.seed))
    rows = []
    for i, rate in enumerate(float(r) for r in args.rates.split(",")):
        seed = args.seed + 100 + i
        prompts = (shared_prefix_prompts(args.num_prompts, args.shared_prefix, args.input_len, vocab, seed)
                   if args.shared_prefix else random_prompts(args.num_prompts, args.input_len, vocab, seed))
        before, cache_before = phase_sums(base), prefix_cache_counts(base)
        records, duration = asyncio.run(run_load(base, model, prompts, args.output_len, rate, args.seed + i))
        hits, queries = (a - b for a, b in zip(prefix_cache_counts(base), cache_before))
        rows.append({"rate": rate, **summarize(records, duration, None, None),
                     **phase_means_ms(phase_sums(base), before),
                     "prefix_cache_hit_rate": hits / queries if queries else None,
                     "prefix_cache_hit_tokens": hits, "prefix_cache_query_tokens": queries})
    return rows


class VllmServer:
    """``vllm serve`` on ``path`` in a process (group) of its own, started at construction."""

    def __init__(self, path: Path, args: argparse.Namespace, extra: list[str] = ()) -> None:
        self.error: str | None = None
        self.proc = None
        self.t0 = time.monotonic()
        site = Path(args.vllm_site)
        if not (site / "vllm").is_dir():
            self.error = f"vLLM is not installed in {site} (stage it with stage-wheels --set vllm)"
            return
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | VLLM_ENV | {"PYTHONPATH": str(site)}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--host",
               "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", str(args.vllm_gpu_memory_utilization),
               "--max-model-len", str(args.max_model_len), *args.vllm_arg, *extra]
        self.log = open(Path(os.environ.get("OUT") or "/tmp") / "vllm-server.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{port}"
        self.timeout_s = args.start_timeout_s

    def wait_profiled(self) -> None:
        """Wait until vLLM has sized its KV cache (its log's "GPU KV cache size"), is healthy, has failed or
        has timed out: another server may allocate GPU memory after that without shrinking vLLM's share
        (vLLM counts memory others take while it profiles as its own)."""
        while self.error is None and self.proc.poll() is None and time.monotonic() - self.t0 < self.timeout_s:
            self.log.flush()
            if "GPU KV cache size" in Path(self.log.name).read_text(errors="replace"):
                return
            time.sleep(1.0)

    def wait_ready(self) -> float:
        """Seconds from start to a healthy server; sets :attr:`error` (and returns 0) if it never is."""
        while self.error is None:
            if self.proc.poll() is not None:
                self.error = f"vllm serve exited with {self.proc.returncode} before it was ready (see vllm-server.log)"
            elif time.monotonic() - self.t0 > self.timeout_s:
                self.error = f"vllm serve was not ready within {self.timeout_s} s"
            else:
                try:
                    if _get(f"{self.base}/health", timeout=2.0)[0] == 200:
                        return time.monotonic() - self.t0
                except OSError:
                    pass
                time.sleep(1.0)
        return 0.0

    def stop(self) -> None:
        """Stop it (its GPU memory share goes with it)."""
        if self.proc is None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        self.proc = None


class GraphfleetApp:
    """graphfleet's Serve app on ``path``, started at construction (Ray and Serve in this process)."""

    def __init__(self, path: Path, args: argparse.Namespace, extra: list[str] = ()) -> None:
        self.t0, self.error, self.base = time.monotonic(), None, None
        try:
            cpu = [] if torch.cuda.is_available() else list(CPU_OVERRIDES)
            self.base = start_app(path, [*cpu, f"cluster.mode={args.mode}", *args.set, *extra], args.preset,
                                  direct_ingress=not args.proxy)
        except Exception as e:  # noqa: BLE001 - reported as the row's error
            self.error = f"{type(e).__name__}: {e}"
        self.timeout_s = args.start_timeout_s

    def wait_ready(self) -> float:
        if self.error is None:
            try:
                wait_healthy(self.base, self.timeout_s)
            except Exception as e:  # noqa: BLE001 - reported as the row's error
                self.error = f"{type(e).__name__}: {e}"
        return time.monotonic() - self.t0

    def stop(self) -> None:
        import ray
        from ray import serve

        # Ray goes too: the next graphfleet peer starts its own (direct ingress's port is fixed at ray.init).
        serve.shutdown()
        ray.shutdown()


def peer_rows(server: VllmServer | GraphfleetApp, args: argparse.Namespace, vocab: int
              ) -> tuple[list[dict] | None, str | None, float]:
    """The rows of ``server`` (stopped afterwards), or why there are none; and its seconds to ready."""
    try:
        ready_s = server.wait_ready()
        if server.error:
            return None, server.error, ready_s
        try:
            return run_rates(server.base, args, vocab), None, ready_s
        except Exception as e:  # noqa: BLE001 - a failed peer is a row with its error
            return None, f"load against {type(server).__name__} failed: {type(e).__name__}: {e}", ready_s
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinyllama-1.1b")
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    ap.add_argument("--mode", choices=("colocated", "disaggregated"), default="colocated")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="graphfleet config override")
    ap.add_argument("--rates", default="16,inf")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048, help="vLLM's --max-model-len")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--vllm-site", default="/tmp/vllm-site", help="where vLLM and its pins are installed")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra vllm serve argument (repeatable)")
    ap.add_argument("--peers", default="vllm,graphfleet",
                    help=f"which servers to run, in order, among {', '.join(PEERS)}")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="common prompt tokens before each prompt's --input-len distinct ones (0: none)")
    ap.add_argument("--overlap-start", action="store_true",
                    help="start the servers together (graphfleet's once vLLM has sized its KV cache; give each a "
                         "memory share: --set cache.gpu_memory_fraction=0.4 --vllm-gpu-memory-utilization 0.45), "
                         "then load them one after the other")
    ap.add_argument("--proxy", action="store_true",
                    help="our clients go through Serve's proxy (the Helm chart's path) instead of talking to the "
                         "ingress replica's own HTTP server (direct ingress, what `graphfleet serve` does by default)")
    args = ap.parse_args()
    path = ensure_checkpoint(args.preset, Path(args.checkpoints))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    peers = args.peers.split(",")
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        ap.error(f"unknown peer {unknown[0]!r}; known: {', '.join(PEERS)}")
    kinds = {"vllm": VllmServer, "graphfleet": GraphfleetApp}

    def starters(peer: str):
        kind, sets, vllm_args = PEERS[peer]
        return kinds[kind](path, args, sets if kind == "graphfleet" else vllm_args)

    # --overlap-start: the servers of early_starts start now (the next once vLLM has sized its KV cache) and the
    # loads run one after the other, each while the other servers idle (holding GPU memory, not compute); else
    # each server starts after the last one stopped.
    started = {}
    for peer in early_starts(peers) if args.overlap_start else ():
        started[peer] = starters(peer)
        if isinstance(started[peer], VllmServer) and started[peer].proc is not None:
            started[peer].wait_profiled()
    results = {}
    for peer in peers:
        server = started.get(peer) or starters(peer)
        rows, error, ready_s = peer_rows(server, args, vocab)
        results[peer] = {"rows": rows, "error": error, "ready_s": ready_s}
        print(f"{peer}: ready in {ready_s:.0f} s" + (f"; error: {error}" if error else ""))
        if rows:
            print_table([{"rate": f"{r['rate']:g}", **{c: r[c] for c in COLUMNS}} for r in rows], ["rate", *COLUMNS])
        # What is done so far survives a later peer's crash or a timeout of the whole run.
        write_results(f"serve_vs_vllm-{args.preset}-partial", {"env": environment(), "args": vars(args),
                                                                "results": results})
    table = []
    for peer, r in results.items():
        if r["rows"] is None:
            table.append({"peer": peer, "rate": "-", "error": r["error"]})
            continue
        table.extend({"peer": peer, "rate": f"{row['rate']:g}", **{c: row[c] for c in COLUMNS}} for row in r["rows"])
    gf, vl = results.get("graphfleet", {}).get("rows"), results.get("vllm", {}).get("rows")
    ratios = []
    if gf and vl:
        for a, b in zip(gf, vl):
            ratios.append({"rate": f"{a['rate']:g}"} | {
                f"{c}_gf_over_vllm": (a[c] / b[c] if a[c] and b[c] else None)
                for c in ("output_throughput", "ttft_p50_ms", "tpot_p50_ms")})
    first = results[peers[0]]["rows"]
    over_first = [{"peer": peer, "rate": f"{a['rate']:g}"} | {
        f"{c}_over_{peers[0]}": (a[c] / b[c] if a[c] and b[c] else None) for c in ("ttft_p50_ms", "tpot_p50_ms")}
        for peer in peers[1:] if results[peer]["rows"] and first for a, b in zip(results[peer]["rows"], first)]
    print_table(table, ["peer", "rate", *COLUMNS, "error"])
    if ratios:
        print()
        print_table(ratios, list(ratios[0]))
    if over_first:
        print()
        print_table(over_first, list(over_first[0]))
    name = f"serve_vs_vllm-{args.preset}" + ("-shared-prefix" if args.shared_prefix else "")
    out = write_results(name, {"env": environment(), "args": vars(args), "results": results, "ratios": ratios,
                               "over_first": over_first})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
