"""``/metrics`` and ``/health`` of the Serve app on a real local Ray Serve (CPU).

The app serves a disaggregated fleet (one prefill and one decode group), so ``/metrics`` merges
the graph metrics of two ranks with the API's own. A second app's fleet cannot place its group
until the test frees the CPUs it holds, which keeps ``/health`` at 503 for as long as the test
needs, with no timing window to hit.
"""

from __future__ import annotations

import time

import pytest
import ray
from ray import serve
from ray.util.placement_group import placement_group, remove_placement_group

from deploy.serve_app import OpenAIIngress, app_builder, build_config
from tests.serve_harness import OVERRIDES, free_port, http, scrape, total, wait_healthy

openai = pytest.importorskip("openai")  # absent on the GPU machine; CI installs it (dev extra)

MAX_TOKENS = 6
GRAPH_FAMILIES = ["cuda_graph_passes_total", "cuda_graph_fallbacks_total", "cuda_graph_capture_seconds",
                  "cuda_graph_memory_bytes", "cuda_graph_shapes", "cuda_graph_budget_bytes", "cuda_graph_padding_ratio",
                  "cuda_graph_replans_total"]
GROUPS = {"met-p0": "prefill", "met-d0": "decode"}


@pytest.fixture(scope="module")
def serve_url():
    ray.init(_node_ip_address="127.0.0.1", num_cpus=6, include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def path(checkpoint_dir):
    return checkpoint_dir("tiny-llama")


@pytest.fixture(scope="module")
def server(serve_url, path):
    """Base URL of an open app over a disaggregated fleet ``met`` (groups ``met-p0``, ``met-d0``)."""
    app = app_builder({"model": str(path), "overrides": [*OVERRIDES, "serve.gil_switch_interval_ms=2"],
                       "model_name": "tiny", "fleet": {"name": "met", "mode": "disaggregated"}})
    serve.run(app, name="metrics", route_prefix="/", blocking=False)
    wait_healthy(serve_url)
    yield serve_url
    serve.delete("metrics")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _idle(base: str, timeout_s: float = 30.0) -> dict:
    """Samples of a scrape taken once no request is in flight and every group's KV usage is back to 0."""
    end = time.monotonic() + timeout_s
    while True:
        samples = scrape(base)
        usage = samples.get("kv_cache_usage_ratio", [])
        if len(usage) == len(GROUPS) and all(v == 0 for _, v in usage) and http("GET", f"{base}/health")[1][
                "in_flight"] == 0:
            return samples
        assert time.monotonic() < end, f"KV usage not back to 0: {usage}"
        time.sleep(0.05)


def test_metrics_count_the_requests_sent(server, client):
    before = _idle(server)
    usages = []
    for prompt in ["The fleet of graphs sails at dawn and", "Hello"]:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        usages.append(r.usage)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usages.append(chunks[-1].usage)
    n = len(usages)
    after = _idle(server)

    def delta(name: str, **match: str) -> float:
        return total(after, name, **match) - total(before, name, **match)

    assert delta("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("generation_tokens_total") == sum(u.completion_tokens for u in usages) == n * MAX_TOKENS
    assert delta("request_success_total", finish_reason="length") == n
    assert delta("request_success_total") == n
    assert delta("time_to_first_token_seconds_count") == n and delta("time_to_first_token_seconds_sum") > 0
    assert delta("e2e_request_latency_seconds_count") == n
    assert delta("e2e_request_latency_seconds_sum") > delta("time_to_first_token_seconds_sum")
    # The first token gives the TTFT, each later one a gap (0 for tokens delivered together), streamed or not.
    assert delta("inter_token_latency_seconds_count") == n * (MAX_TOKENS - 1)
    assert delta("inter_token_latency_seconds_sum") > 0
    # The TTFT by phase (the prefill group's engine gave the first tokens): they add up to it.
    phases = ("graphfleet_request_preprocess_time_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "graphfleet_request_first_token_overhead_seconds")
    assert [delta(f"{name}_count") for name in phases] == [n] * 4
    assert delta("request_prefill_time_seconds_sum") > 0
    assert sum(delta(f"{name}_sum") for name in phases) == pytest.approx(delta("time_to_first_token_seconds_sum"))
    assert total(after, "num_requests_running") == 0 and total(after, "num_requests_waiting") == 0

    # Graph metrics of both ranks, one family each, every sample naming its group, rank and role.
    status, text, _ = http("GET", f"{server}/metrics")
    for family in GRAPH_FAMILIES:
        assert text.count(f"# TYPE {family} ") == 1, family
    graph = [(name, labels) for name, series in after.items() if name.startswith("cuda_graph_")
             for labels, _ in series]
    assert graph
    for name, labels in graph:
        assert labels.get("rank") == "0" and GROUPS.get(labels.get("group")) == labels.get("role"), (name, labels)
    assert {labels["group"] for _, labels in graph} == set(GROUPS)
    for family in ("graphfleet_step_wait_seconds_total", "graphfleet_step_wait_cpu_seconds_total",
                   "prefix_cache_queries_total", "prefix_cache_hits_total"):
        # Every rank's read-back waits, merged like the graph families (0 on CPU: nothing waits);
        # each group leader's prefix cache counters.
        assert {labels["group"] for labels, _ in after[family]} == set(GROUPS), family
        assert all(GROUPS[labels["group"]] == labels["role"] and labels["rank"] == "0"
                   for labels, _ in after[family]), family
    # The prefill group admitted each request once and looked its prompt up; what it found is what the
    # usage reported as cached. The decode group imports KV: it looks nothing up.
    assert delta("prefix_cache_queries_total", group="met-p0") == sum(u.prompt_tokens for u in usages)
    assert delta("prefix_cache_hits_total", group="met-p0") == sum(u.prompt_tokens_details.cached_tokens
                                                                   for u in usages)
    assert delta("prefix_cache_queries_total", group="met-d0") == 0
    # Each request alone: one prefill pass on the prefill group, then MAX_TOKENS - 1 decode steps
    # on the decode group; with no GPU every one of them runs eagerly.
    assert delta("cuda_graph_passes_total", phase="decode") >= n * (MAX_TOKENS - 1)
    assert delta("cuda_graph_passes_total", phase="decode", mode="decode_none", group="met-d0") \
        == delta("cuda_graph_passes_total", phase="decode")
    assert delta("cuda_graph_passes_total", phase="prefill", role="prefill") >= n
    for labels, _ in after["kv_cache_usage_ratio"]:
        assert GROUPS[labels["group"]] == labels["role"] and labels["model_name"] == "tiny"


def test_the_replica_and_every_rank_froze_their_startup_heap(server):
    """The replica (once its fleet is up) and each group's rank (once it captured) froze what their
    start left alive (worker.gc_heap), so full collections no longer scan it."""
    samples = scrape(server)["graphfleet_gc_frozen_objects"]
    by_process = {labels.get("process") or labels["group"]: value for labels, value in samples}
    assert set(by_process) == {"replica", *GROUPS}
    assert all(value > 10_000 for value in by_process.values()), by_process
    pauses = scrape(server)["graphfleet_gc_pause_seconds_count"]  # every process times its collections
    assert {labels.get("process") or labels["group"] for labels, _ in pauses} == {"replica", *GROUPS}


def test_gil_switch_interval_is_set_in_the_replica(server):
    assert total(scrape(server), "graphfleet_gil_switch_interval_seconds") == pytest.approx(0.002)


def test_the_replica_reports_its_process_cpu_and_memory(server, client):
    """``graphfleet_replica_process_*`` (prometheus_client's process collector on the replica's registry):
    its CPU seconds grow with the requests it serves."""
    before = total(scrape(server), "graphfleet_replica_process_cpu_seconds_total")
    for _ in range(3):
        client.completions.create(model="tiny", prompt="Hello", max_tokens=8)
    after = scrape(server)
    assert total(after, "graphfleet_replica_process_cpu_seconds_total") > before > 0
    assert total(after, "graphfleet_replica_process_resident_memory_bytes") > 50 * 2**20


def test_kv_usage_while_a_request_runs(server, client):
    """A long stream holds pages on the decode group; once it is closed (aborted), usage is back to 0."""
    max_len = client.models.list().data[0].model_extra["max_model_len"]
    stream = client.completions.create(model="tiny", prompt="Hi", max_tokens=max_len - 8, stream=True,
                                       extra_body={"ignore_eos": True})
    events = iter(stream)
    for _ in range(3):  # the second token already comes from the decode group
        next(events)
    try:
        samples = scrape(server)
        usage = {labels["group"]: v for labels, v in samples["kv_cache_usage_ratio"]}
        assert 0 < usage["met-d0"] < 1, usage
        assert total(samples, "num_requests_running") == 1
    finally:
        stream.close()
    after = _idle(server)
    assert total(after, "request_success_total", finish_reason="abort") >= 1


def test_health_is_503_with_phases_until_the_fleet_is_up(server, path):
    """While its group waits for a CPU the new app answers 503 naming each group's phase and what it
    waits for; then 200."""
    free = ray.available_resources().get("CPU", 0)
    # Whole CPUs and the fraction left (ranks reserve cluster.cpus_per_rank, a fraction of one).
    bundles = [{"CPU": 1}] * int(free) + ([{"CPU": round(free - int(free), 4)}] if free - int(free) > 1e-4 else [])
    hold = placement_group(bundles) if bundles else None
    if hold is not None:
        ray.get(hold.ready(), timeout=30)
    config = build_config({"model": str(path), "overrides": OVERRIDES, "model_name": "tiny"})
    # The replica takes no CPU, so it starts; its fleet's group cannot be placed while `hold` lives.
    app = OpenAIIngress.options(ray_actor_options={"num_cpus": 0}).bind(config.to_dict(), {"name": "slow"})
    base = f"{server}/slow"
    try:
        serve.run(app, name="slow", route_prefix="/slow", blocking=False)
        end = time.monotonic() + 60
        while (got := http("GET", f"{base}/health"))[0] == 404:  # Serve has no route yet
            assert time.monotonic() < end
            time.sleep(0.05)
        for _ in range(2):  # the same a while later: the group waits for a CPU, not for a clock
            status, body, _ = got
            assert status == 503, body
            assert body["status"] == "starting" and body["groups"] == {"slow-c0": "starting"}, body
            time.sleep(0.5)
            got = http("GET", f"{base}/health")
        end = time.monotonic() + 10
        while not (body := http("GET", f"{base}/health")[1])["waiting"]:  # the wait is reported within seconds
            assert time.monotonic() < end and body["groups"] == {"slow-c0": "starting"}, body
            time.sleep(0.2)
        waiting = body["waiting"]["slow-c0"]
        assert waiting["state"] == "waiting for resources" and waiting["available"] == {"CPU": 0.0}, body
        assert waiting["asked"] == {"bundle": {"CPU": 0.25}, "count": 1}, body
        status, err, headers = http("POST", f"{base}/v1/completions", {"model": "tiny", "prompt": "Hi"})
        assert status == 503 and err["error"]["code"] == "not_ready" and headers["retry-after"] == "1", err
        status, text, _ = http("GET", f"{base}/metrics")
        assert status == 200 and "num_requests_running" in text and "cuda_graph_passes_total{" not in text

        if hold is not None:
            remove_placement_group(hold)
            hold = None
        end = time.monotonic() + 120
        while (got := http("GET", f"{base}/health"))[0] != 200:
            status, body, _ = got
            assert status == 503 and body["status"] == "starting", body
            assert body["groups"]["slow-c0"] in ("starting", "capturing", "ready"), body
            assert time.monotonic() < end, body
            time.sleep(0.05)
        assert got[1]["status"] == "ready" and got[1]["groups"] == {"slow-c0": "ready"}
        graph = [labels for name, series in scrape(base).items() if name.startswith("cuda_graph_")
                 for labels, _ in series]
        assert graph and all(labels["group"] == "slow-c0" and labels["role"] == "colocated" for labels in graph)

        # A dead rank is left out of the scrape (its group notices at its next step, none comes).
        [rank] = [a for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"] == "graphfleet-slow-c0-0-rank0"]
        ray.kill(ray.get_actor(rank["name"], namespace=rank["namespace"]), no_restart=True)
        t = time.monotonic()
        samples = scrape(base)
        assert time.monotonic() - t < 10 and "num_requests_running" in samples
        assert not any(name.startswith("cuda_graph_") for name in samples), samples.keys()
    finally:
        if hold is not None:
            remove_placement_group(hold)
        serve.delete("slow")
