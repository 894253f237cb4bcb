"""One GPU: colocated and disaggregated fleets (both roles sharing the GPU; KV through the object
store and through CUDA IPC) with CUDA graphs on match the in-process engine token for token, and
every group's KV pages come back."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
import torch  # noqa: E402

from deploy.config import load_config  # noqa: E402
from fleet.fleet import Fleet  # noqa: E402
from tests.fleet_probes import fleet_group, group_ids  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _config(path, *extra):
    # Two groups share the GPU: each takes half of it (Ray) and a small slice of its memory.
    return load_config(None, [f"model.path={path}", "model.dtype=bfloat16", "cache.num_pages=1024",
                              "cache.gpu_memory_fraction=0.3", "scheduler.max_running_requests=16",
                              "scheduler.chunked_prefill_size=1024", "graphs.prefill.max_tokens=1024",
                              "graphs.decode.max_batch_size=16", "cluster.gpus_per_rank=0.5",
                              "cluster.step_timeout_s=120", "cluster.start_timeout_s=600", *extra])


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 300, (n,), generator=g).tolist()
    return [torch.randint(10, 1000, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(scope="module")
def setup(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    prompts = _prompts(12)
    # Per mode, the eager engine that schedules as the fleet does: a colocated group mixes decode rows
    # into prefill steps (scheduler.mixed_steps), a disaggregated decode group only decodes, so its
    # rows go through decode kernels, never prefill ones (in bf16 the two may part on a near-tie).
    expected = {mode: [o.token_ids for o in Engine(_config(path, "graphs.enabled=false",
                                                           f"scheduler.mixed_steps={mixed}")).generate(prompts, GREEDY)]
                for mode, mixed in (("colocated", "true"), ("disaggregated", "false"))}
    torch.cuda.empty_cache()
    return path, prompts, expected


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode,transport", [("colocated", "object_store"), ("disaggregated", "object_store"),
                                            ("disaggregated", "cuda_ipc")])
def test_fleet_with_graphs_matches_engine(ray_gpu, setup, mode, transport):
    path, prompts, expected = setup
    cfg = _config(path, f"cluster.kv_transport={transport}")
    with Fleet.start(cfg, mode=mode, name=f"gpu-{mode}-{transport.replace('_', '')}") as fleet:
        outs = fleet.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == expected[mode]
        groups = fleet.health()["groups"]
        assert all(g["free_pages"] == g["num_pages"] and g["requests"] == 0 for g in groups.values()), groups
        for gid in group_ids(fleet):
            group = fleet_group(fleet, gid)
            text = b"".join(ray.get([a.metrics_text.remote() for a in group.rank_actors()], timeout=60)).decode()
            replayed = [line for line in text.splitlines() if line.startswith("cuda_graph_passes_total")
                        and ('mode="decode_cuda_graph"' in line or 'mode="prefill_breakable"' in line)
                        and not line.endswith(" 0.0")]
            assert replayed, f"group {gid} ({group.role}) replayed no graph:\n{text[:2000]}"


@pytest.mark.timeout(900)
def test_live_replan_with_real_graphs_keeps_requests_and_the_budget(ray_gpu, setup):
    """``Fleet.replan`` while requests decode: real graphs captured beside the old ones and swapped;
    every request ends as without the re-plan, and the graphs after the swap fit the budget."""
    path, prompts, expected = setup
    with Fleet.start(_config(path), mode="colocated", name="gpu-replan") as fleet:
        handles = [fleet.submit(p, GREEDY) for p in prompts]
        first = handles[0].events(wait_s=120)
        next(first)  # decoding has begun
        (result,) = fleet.replan(timeout_s=600).values()
        outs = [h.result(wait_s=300) for h in handles]
        assert [o.token_ids for o in outs] == expected["colocated"]
        assert "error" not in result, result
        assert result["before"]["decode"] != result["after"]["decode"], result
        assert 0 < result["resident_bytes"] <= result["budget_bytes"], result
        print("live re-plan on the GPU:", {k: result.get(k) for k in ("seconds", "resident_bytes", "budget_bytes",
                                                                       "before", "after")})
