"""bench/serve.py (its start-up in bench/serve_start.py) attaches to any OpenAI-compatible server
(``--url``): a peer whose ``/health`` answers
200 with an empty body (``vllm serve``) or plain text counts as healthy. ``--compare``'s Serve side:
its steady decode rate and window diagnostics on hand-built records, the median/min/max over its
runs, the cap on ``--compare-tokens``, and the client's CPU sampler through a stand-in SSE server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.serve import aggregate_compare, capped_compare_tokens, gc_pause_totals, model_max_len, parse_args
from bench.serve_load import ClientCpu, RequestRecord, run_load, steady_decode_rate, window_diagnostics
from bench.serve_start import gpu_sharing_overrides, placement_stuck, wait_healthy


def _server(answers: list[tuple[int, bytes]]):
    """A server on 127.0.0.1 whose ``/health`` gives ``answers`` in turn (the last one from then on)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            status, body = answers.pop(0) if len(answers) > 1 else answers[0]
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@pytest.mark.parametrize(("answers", "expected"), [
    ([(200, b"")], {}),  # vllm serve
    ([(200, b"OK")], {"body": "OK"}),
    ([(503, b'{"status": "starting"}'), (200, b'{"status": "ready"}')], {"status": "ready"}),  # ours
])
def test_wait_healthy_accepts_a_peer_servers_health(answers, expected):
    httpd, base = _server(list(answers))
    try:
        assert wait_healthy(base, timeout_s=10) == expected
    finally:
        httpd.shutdown()


def test_wait_healthy_gives_up_naming_the_last_answer():
    httpd, base = _server([(503, b'{"status": "starting"}')])
    try:
        with pytest.raises(SystemExit, match="not healthy after 1s: .*starting"):
            wait_healthy(base, timeout_s=1)
    finally:
        httpd.shutdown()


def _waiting_body(waited_s: float) -> bytes:
    return json.dumps({"status": "starting", "groups": {"bench-d0": "starting", "bench-p0": "ready"},
                       "waiting": {"bench-d0": {"state": "waiting for resources",
                                                "asked": {"bundle": {"GPU": 1.0}, "count": 1},
                                                "available": {"GPU": 0.0}, "waiting_s": waited_s}}}).encode()


def test_wait_healthy_gives_up_on_a_group_the_cluster_cannot_place():
    httpd, base = _server([(503, _waiting_body(3.0)), (503, _waiting_body(130.5))])
    try:
        start = time.monotonic()
        with pytest.raises(SystemExit, match=r"bench-d0 has waited 130.5s for resources \(1 x \{'GPU': 1.0\} "
                                             r"asked, \{'GPU': 0.0\} free\).*gpus_per_rank=0.5"):
            wait_healthy(base, timeout_s=60, placement_timeout_s=120)
        assert time.monotonic() - start < 30
    finally:
        httpd.shutdown()


def test_a_short_placement_wait_or_an_attached_server_keeps_waiting():
    assert placement_stuck(json.loads(_waiting_body(119.0)), 120) is None
    assert placement_stuck({"status": "starting"}, 120) is None
    httpd, base = _server([(503, _waiting_body(500.0))])
    try:  # no placement timeout (``--url``): the overall timeout decides
        with pytest.raises(SystemExit, match="not healthy after 1s"):
            wait_healthy(base, timeout_s=1)
    finally:
        httpd.shutdown()


@pytest.mark.parametrize("mode, gpus, overrides, expected", [
    ("disaggregated", 1, ["cluster.mode=disaggregated"],
     ["cluster.gpus_per_rank=0.5", "cache.gpu_memory_fraction=0.4"]),
    ("disaggregated", 2, ["cluster.tp_size=2"], ["cluster.gpus_per_rank=0.5", "cache.gpu_memory_fraction=0.4"]),
    ("disaggregated", 1, ["cache.gpu_memory_fraction=0.3"], ["cluster.gpus_per_rank=0.5"]),
    ("disaggregated", 1, ["cluster.gpus_per_rank=0.25"], []),  # the user's share stands
    ("disaggregated", 2, [], []),  # one GPU a rank
    ("disaggregated", 0, [], []),  # CPU ranks reserve CPUs
    ("colocated", 1, [], []),
])
def test_gpu_sharing_overrides_fit_a_disaggregated_fleet_on_fewer_gpus(mode, gpus, overrides, expected):
    assert gpu_sharing_overrides(mode, gpus, overrides) == expected


def _rec(times: list[float], counts: list[int] | None = None, sent: float = 0.0) -> RequestRecord:
    """A request that got a token chunk at each of ``times`` (running usage ``counts``, else one token each)."""
    counts = counts if counts is not None else list(range(1, len(times) + 1))
    return RequestRecord(sent=sent, token_times=list(times), token_counts=list(counts), done=times[-1] + 0.001,
                         output_tokens=counts[-1])


def _cpu(points: list[tuple[float, float, float]]) -> ClientCpu:
    return ClientCpu(samples=list(points))


def test_window_diagnostics_of_a_batch_decoding_together():
    # First tokens at 1.0, 1.1, 1.2 (spread 200 ms); last at 3.0, 2.9, 3.1: the window is 1.2 to 2.9.
    a = _rec([1.0, 1.5, 2.0, 2.5, 3.0])
    b = _rec([1.1, 1.6, 2.1, 2.9], counts=[1, 2, 4, 5])  # the chunk at 2.1 carries two tokens
    c = _rec([1.2, 1.3, 2.6, 3.1])  # nothing from 1.3 to 2.6
    failed = RequestRecord(sent=0.0, error="HTTP 500: boom")
    cpu = _cpu([(0.0, 10.0, 5.0), (2.0, 10.8, 5.4), (4.0, 11.6, 5.8)])  # 0.4 process / 0.2 loop CPU s per s
    d = window_diagnostics([a, b, c, failed], cpu)
    assert d["window_s"] == pytest.approx(1.7)
    assert d["fallback"] is False
    assert d["first_token_spread_ms"] == pytest.approx(200.0)
    # Counted (1.2, 2.9]: a 1.5, 2.0, 2.5 (3 tokens); b 1.6, 2.1 (two), 2.9 (4 tokens); c 1.3, 2.6 (2).
    assert d["requests"] == 3 and d["requests_in_window"] == 3
    assert d["tokens_in_window"] == 9
    assert steady_decode_rate([a, b, c, failed]) == pytest.approx(9 / 1.7)
    # Arrivals in [1.2, 2.9]: 1.2 1.3 1.5 1.6 2.0 2.1 2.5 2.6 2.9: the longest gap is 1.6 -> 2.0.
    assert d["max_chunk_gap_ms"] == pytest.approx(400.0)
    assert d["client_cpu_share"] == pytest.approx(0.4)
    assert d["client_loop_cpu_share"] == pytest.approx(0.2)


def test_window_diagnostics_falls_back_to_the_whole_span_when_the_window_is_empty():
    # b finishes (1.4) before c's first token (1.5): no moment where all three decode.
    a = _rec([1.0, 1.5, 2.0])
    b = _rec([1.1, 1.4])
    c = _rec([1.5, 1.9, 2.2])
    d = window_diagnostics([a, b, c])
    assert d["fallback"] is True
    assert d["window_s"] == pytest.approx(1.2)  # 1.0 to 2.2
    assert d["first_token_spread_ms"] == pytest.approx(500.0)
    # Counted (1.0, 2.2]: a 1.5, 2.0; b 1.1, 1.4; c all three.
    assert d["tokens_in_window"] == 7 and d["requests_in_window"] == 3
    assert steady_decode_rate([a, b, c]) == pytest.approx(7 / 1.2)
    assert d["max_chunk_gap_ms"] == pytest.approx(400.0)  # 1.5 -> 1.9 (and 1.1 -> 1.4 is 300)
    assert d["client_cpu_share"] is None and d["client_loop_cpu_share"] is None  # no sampler


def test_window_diagnostics_count_requests_with_no_chunk_inside_the_window():
    # a's chunks are at 0.9 and 2.0 only: it decodes through the window (1.0, 1.5] but sends nothing in it.
    a = _rec([0.9, 2.0], counts=[1, 8])
    b = _rec([1.0, 1.2, 1.5])
    d = window_diagnostics([a, b])
    assert d["fallback"] is False and d["window_s"] == pytest.approx(0.5)
    assert d["requests"] == 2 and d["requests_in_window"] == 1 and d["tokens_in_window"] == 2
    assert d["max_chunk_gap_ms"] == pytest.approx(300.0)


def test_window_diagnostics_without_a_window():
    assert window_diagnostics([]) is None
    assert window_diagnostics([_rec([1.0])]) is None  # one chunk: no decode to time
    assert window_diagnostics([RequestRecord(sent=0.0, error="x")]) is None
    assert steady_decode_rate([_rec([1.0])]) is None


def test_client_cpu_interpolates_and_needs_samples_around_the_window():
    cpu = _cpu([(1.0, 0.0, 0.0), (2.0, 1.0, 0.5), (3.0, 1.2, 0.6)])
    assert cpu.seconds(1.5, 2.5) == pytest.approx((0.6, 0.3))
    assert cpu.seconds(0.5, 2.5) is None and cpu.seconds(1.5, 3.5) is None
    assert ClientCpu().seconds(0.0, 1.0) is None


def test_aggregate_compare_reports_the_median_min_and_max_of_the_runs():
    runs = [{"serve_tokens_per_s": 300.0}, {"serve_tokens_per_s": 100.0}, {"serve_tokens_per_s": None},
            {"serve_tokens_per_s": 200.0}]
    out = aggregate_compare(runs, in_process_tokens_per_s=400.0)
    assert out["serve_runs_measured"] == 3
    assert (out["serve_tokens_per_s"], out["serve_tokens_per_s_min"], out["serve_tokens_per_s_max"]) == (200, 100, 300)
    assert out["serve_over_in_process"] == pytest.approx(0.5)
    assert out["serve_over_in_process_min"] == pytest.approx(0.25)
    assert out["serve_over_in_process_max"] == pytest.approx(0.75)
    assert aggregate_compare(runs[:2], 400.0)["serve_tokens_per_s"] == 200.0  # an even count: the mean of the middle
    none = aggregate_compare([{"serve_tokens_per_s": None}], 400.0)
    assert none["serve_runs_measured"] == 0 and none["serve_tokens_per_s"] is None
    assert none["serve_over_in_process_max"] is None


def test_compare_tokens_fit_the_context(tmp_path):
    assert capped_compare_tokens(1024, 512, 2048) == 1024  # tinyllama: no cap
    assert capped_compare_tokens(1024, 512, 1024) == 512
    assert capped_compare_tokens(1024, 512, None) == 1024
    with pytest.raises(SystemExit, match="no room"):
        capped_compare_tokens(1024, 2048, 2048)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert model_max_len({"id": "m", "max_model_len": 1500}, tmp_path) == (1500, "the server's max_model_len")
    assert model_max_len({"id": "m"}, tmp_path) == (2048, "the checkpoint's max_position_embeddings")
    assert model_max_len({"id": "m"}, None) == (None, "unknown")


def test_compare_defaults_and_the_quick_preset():
    args = parse_args([])
    assert (args.compare_repeats, args.compare_tokens) == (3, 1024)
    quick = parse_args(["--quick"])
    assert quick.compare and quick.compare_repeats == 2 and quick.compare_tokens == 32
    with pytest.raises(SystemExit):
        parse_args(["--compare-repeats", "0"])


def _sse_server(chunks: int, interval_s: float):
    """A stand-in ``/v1/completions`` streaming ``chunks`` one-token chunks with running usage, ``interval_s`` apart."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(1, chunks + 1):
                time.sleep(interval_s)
                chunk = {"choices": [{"text": "x"}], "usage": {"completion_tokens": i, "prompt_tokens": 3}}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def test_run_load_samples_the_clients_cpu_over_the_whole_load():
    httpd, base = _sse_server(chunks=10, interval_s=0.02)
    try:
        cpu = ClientCpu(interval_s=0.01)
        records, duration = asyncio.run(run_load(base, "m", [[11, 12, 13]] * 3, 10, float("inf"), 0, cpu=cpu))
    finally:
        httpd.shutdown()
    assert all(r.ok and r.output_tokens == 10 and r.token_counts == list(range(1, 11)) for r in records)
    assert len(cpu.samples) >= 5  # at least the start, the end and a few ticks over ~0.2 s
    assert cpu.samples[0][0] <= min(r.sent for r in records)
    assert cpu.samples[-1][0] >= max(r.token_times[-1] for r in records)
    d = window_diagnostics(records, cpu)
    assert d["requests_in_window"] == 3 and d["window_s"] > 0
    assert 0.0 <= d["client_loop_cpu_share"] <= d["client_cpu_share"] + 1e-6


def test_gc_pause_totals_sum_every_process_by_generation():
    text = """# HELP graphfleet_gc_pause_seconds Garbage collections
# TYPE graphfleet_gc_pause_seconds histogram
graphfleet_gc_pause_seconds_bucket{generation="2",process="replica",le="+Inf"} 2.0
graphfleet_gc_pause_seconds_count{generation="2",process="replica"} 2.0
graphfleet_gc_pause_seconds_sum{generation="2",process="replica"} 0.25
graphfleet_gc_pause_seconds_bucket{generation="2",group="d0",rank="0",role="decode",le="+Inf"} 1.0
graphfleet_gc_pause_seconds_count{generation="2",group="d0",rank="0",role="decode"} 1.0
graphfleet_gc_pause_seconds_sum{generation="2",group="d0",rank="0",role="decode"} 0.05
graphfleet_gc_pause_seconds_count{generation="0",process="replica"} 40.0
graphfleet_gc_pause_seconds_sum{generation="0",process="replica"} 0.004
# HELP graphfleet_replica_process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE graphfleet_replica_process_cpu_seconds_total counter
graphfleet_replica_process_cpu_seconds_total 12.5
"""
    totals = gc_pause_totals(text)
    assert totals["gen2_count"] == 3 and totals["gen2_s"] == pytest.approx(0.30)
    assert totals["gen0_count"] == 40 and totals["gen0_s"] == pytest.approx(0.004)
    assert totals["replica_cpu_s"] == 12.5
    assert gc_pause_totals("") == {}


def test_prefix_cache_counts_sum_ours_and_vllms_series_and_shared_prefix_prompts_share_it():
    from bench.serve_load import shared_prefix_prompts
    from bench.serve_vs_vllm import prefix_cache_counts

    text = (b"# HELP prefix_cache_hits_total Prompt tokens found in the prefix cache\n"
            b'graphfleet_prefix_cache_hits_total{group="c0"} 96.0\n'
            b'graphfleet_prefix_cache_hits_total{group="c1"} 32.0\n'
            b'graphfleet_prefix_cache_queries_total{group="c0"} 200.0\n'
            b'vllm:prefix_cache_queries_total{engine="0"} 56.0\n'
            b"graphfleet_prefix_cache_hits_created 1.7e9\n")
    httpd, base = _server([(200, text)])
    try:
        assert prefix_cache_counts(base) == (128.0, 256.0)
    finally:
        httpd.shutdown()
    prompts = shared_prefix_prompts(4, 16, 5, 1000, seed=3)
    assert all(len(p) == 21 and p[:16] == prompts[0][:16] for p in prompts)
    assert len({tuple(p[16:]) for p in prompts}) == 4
    assert shared_prefix_prompts(1, 16, 5, 1000, seed=4)[0][:16] != prompts[0][:16]


def test_overlap_start_starts_every_vllm_server_and_one_graphfleet_app():
    from bench.serve_vs_vllm import early_starts

    peers = ["vllm", "vllm-no-prefix-cache", "graphfleet", "graphfleet-no-prefix-cache"]
    assert early_starts(peers) == ["vllm", "vllm-no-prefix-cache", "graphfleet"]
    assert early_starts(["graphfleet-no-prefix-cache", "vllm", "graphfleet"]) == ["graphfleet-no-prefix-cache", "vllm"]
    assert early_starts(["vllm"]) == ["vllm"]
