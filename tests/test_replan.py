"""The live graph re-plan through ``POST /admin/replan`` on a serving fleet (real local Ray Serve, CPU).

A tensor-parallel group of two ranks (gloo) serves 32 greedy streams with the ``debug`` graph
backend (the graph runners' whole path, each forward one eager break); mid-way the API re-plans
its ladders from the batches it has run. Every stream must end with the text the in-process engine
gives without any re-plan, the ladders must change on both ranks, the metric must move, and the
route must require the API key.
"""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch
from ray import serve

from deploy.config import load_config
from tests.serve_harness import OVERRIDES, scrape, start_local_serve, total
from tests.serve_harness import http as _http
from worker.engine import Engine
from worker.sampling.params import SamplingParams

openai = pytest.importorskip("openai")  # absent on the GPU machine; CI installs it (dev extra)

API_KEY = "sk-replan"
STREAMS = 32
MAX_TOKENS = 24
PROMPTS = [f"Stream {i} of the fleet: the graphs {'sail ' * (i % 5)}at dawn and" for i in range(STREAMS)]


@pytest.fixture(scope="module")
def path(checkpoint_dir):
    return checkpoint_dir("tiny-llama")


@pytest.fixture(scope="module")
def server(path):
    yield start_local_serve({"model": str(path), "overrides": [*OVERRIDES, "serve.stream_batching_interval_ms=0"],
                             "api_key": API_KEY, "model_name": "tiny",
                             "fleet": {"name": "rp", "prefill_tp_size": 2, "decode_tp_size": 2}}, "graphfleet")
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def expected(path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(load_config(None, [f"model.path={path}", *OVERRIDES]))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    texts = [o.text for o in engine.generate(PROMPTS, params)]
    engine.shutdown()
    torch.set_num_threads(threads)
    return texts


def test_replan_needs_the_api_key(server):
    status, body, headers = _http("POST", f"{server}/admin/replan")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body, _ = _http("POST", f"{server}/admin/replan", headers={"Authorization": "Bearer wrong"})
    assert status == 401 and body["error"]["message"] == "invalid API key"


def test_live_replan_under_32_streams_keeps_every_stream_token_for_token(server, expected):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    before = total(scrape(server), "cuda_graph_replans_total")
    texts: list[str | None] = [None] * STREAMS
    chunks = [0] * STREAMS
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            parts = []
            stream = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=MAX_TOKENS,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                parts.append(chunk.choices[0].text)
                chunks[i] += 1
            texts[i] = "".join(parts)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(f"stream {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    end = time.monotonic() + 120
    while sum(c > 2 for c in chunks) < 4 and time.monotonic() < end:  # decoding, with most streams still queued
        time.sleep(0.01)
    assert sum(c > 2 for c in chunks) >= 4, chunks

    status, body, _ = _http("POST", f"{server}/admin/replan", headers={"Authorization": f"Bearer {API_KEY}"})
    in_flight_at_replan = sum(t is None for t in texts)
    assert status == 200, body
    assert body["object"] == "graph_replan" and len(body["replanned"]) == 1
    (group,) = body["groups"].values()
    assert group["before"]["decode"] != group["after"]["decode"], group  # the ladder changed
    assert group["seconds"] > 0 and group["resident_bytes"] <= group["budget_bytes"]
    assert "graph budget" in group["line"] and "decode" in group["padding_after"]

    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert in_flight_at_replan > 8  # the re-plan happened with streams running and queued
    diff = [i for i in range(STREAMS) if texts[i] != expected[i]]
    assert not diff, [(i, texts[i], expected[i]) for i in diff[:3]]
    # both ranks of the group swapped their graphs (each counts its own re-plan)
    assert total(scrape(server), "cuda_graph_replans_total") - before == 2
    assert _http("GET", f"{server}/health")[0] == 200


def test_a_group_whose_batches_drift_replans_itself_once(server, path):
    """``graphs.replan_interval_s``: three requests decode as batches of 3, which the default decode
    ladder (1, 2, 4, 8) replays padded to 4 (25% padding, over the 10% share): the group re-plans
    on its own once, after which 3 is captured and nothing drifts; the tokens are the engine's."""
    from fleet.fleet import Fleet

    params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    prompts = [[11 + i] * (5 + 3 * i) for i in range(3)]
    overrides = [f"model.path={path}", *OVERRIDES]
    engine = Engine(load_config(None, overrides))
    expected = [o.token_ids for o in engine.generate(prompts, params)]
    engine.shutdown()
    cfg = load_config(None, [*overrides, "graphs.replan_interval_s=0.1"])
    with Fleet.start(cfg, name="auto") as fleet:
        outs = fleet.generate(prompts, params, timeout_s=120)
        text = b"".join(fleet.rank_metrics(10.0)).decode()
    assert [o.token_ids for o in outs] == expected
    replans = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("cuda_graph_replans_total")]
    assert replans == [1.0], text
