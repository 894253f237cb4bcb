"""One GPU: a TP=1 group in a Ray actor with full decode graphs and NCCL recorded in the graph.

NCCL runs an in-place sum all-reduce over a communicator of one rank as a no-op: it enqueues no
kernel (an out-of-place one is a device copy), so a profiler trace of a TP=1 replay cannot show
NCCL kernels. What one GPU can show: every all-reduce was issued on the capture stream while the
graph was being captured (counted per rank), a replay launches the graph and issues no
collective from the host, and the outputs equal the in-process engine. NCCL kernels inside a
replay need two ranks (the multi-GPU issue).
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from cluster.group import WorkerGroup  # noqa: E402
from deploy.config import load_config  # noqa: E402
from graphs.buckets import default_decode_ladder  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402
from worker.step_message import StepMessage  # noqa: E402

pytestmark = pytest.mark.gpu


def _config(path, *extra):
    return load_config(None, [f"model.path={path}", "cache.num_pages=512", "scheduler.max_running_requests=16",
                              "graphs.decode.max_batch_size=16", "graphs.capture=decode", *extra])


@pytest.mark.timeout(900)
def test_tp1_group_actor_captures_nccl_all_reduce_in_decode_graphs(ray_gpu, checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [100] * 21, [7, 3, 9]]
    expected = [o.token_ids for o in Engine(_config(path, "graphs.enabled=false")).generate(prompts, params)]
    group = WorkerGroup(_config(path, "cluster.collectives_at_tp1=true"))
    try:
        engine = Engine(_config(path, "cluster.collectives_at_tp1=true"), executor=group)
        assert [o.token_ids for o in engine.generate(prompts, params)] == expected
        greedy = SamplingParams(temperature=0)
        decode = StepMessage(False, [5, 6], [4, 4], [5, 5], [1, 1], [[1], [2]], [0, 1], [greedy] * 2, [0, 0],
                             [0, 0])
        actor = group.rank_actors()[0]
        counts = ray.get(actor.collective_counts.remote(), timeout=30)
        arch = ray.get(actor.arch.remote(), timeout=30)
        shapes = len(default_decode_ladder(16))  # graphs.decode.max_batch_size=16
        # two row-parallel all-reduces per layer (o_proj, down_proj) in every captured shape
        assert counts["captured"] >= 2 * arch.num_layers * shapes, counts
        seen = ray.get(actor.profile_step.remote(decode), timeout=300)
        after = ray.get(actor.collective_counts.remote(), timeout=30)
        print("CUDA activity in one TP=1 replay:", seen["cuda"])
        assert after == counts, f"the replayed step issued collectives from the host: {counts} -> {after}"
        assert any("cudaGraphLaunch" in op for op in seen["cpu"]), "the step did not replay a graph"
        eager_collectives = [op for op in seen["cpu"] if "allreduce" in op.lower() or "all_reduce" in op.lower()]
        assert not eager_collectives, f"all-reduce issued eagerly, not from the graph: {eager_collectives}"
        text = ray.get(group.rank_actors()[0].metrics_text.remote(), timeout=30).decode()
        assert 'mode="decode_cuda_graph"' in text
    finally:
        group.shutdown()


@pytest.mark.timeout(900)
def test_tp1_group_with_async_scheduling_matches_the_engine(ray_gpu, checkpoint_dir):
    """Full decode graphs replayed with steps in flight: ranks fill each step's in-flight input
    tokens from the tokens they sampled the step before; outputs equal the in-process engine."""
    path = checkpoint_dir("tiny-llama")
    prompts = [[5, 6, 7, 8], [100] * 21, [7, 3, 9], list(range(40, 90))]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0, stop_token_ids=list(range(200, 400))),
              SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True)]
    expected = Engine(_config(path)).generate(prompts, params)
    cfg = _config(path, "scheduler.async_scheduling=true")
    group = WorkerGroup(cfg)
    try:
        engine = Engine(cfg, executor=group)
        free = engine.num_free_pages
        got = engine.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
        assert engine.num_free_pages == free and not engine.in_flight
        assert any(s.phase == "decode" for s in engine.step_stats)
    finally:
        group.shutdown()
