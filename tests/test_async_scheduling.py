"""Async scheduling (scheduler.async_scheduling): step N+1 is sent before step N is read back.

In-process (the local worker launches a step when it is sent and reads it when asked; on a CPU the
launch computes it) the outputs, page accounting and dropped tokens are checked against the
synchronous engine, on the CPU and with decode graphs on the GPU, where steps really overlap; so
they do through a Ray worker group (tests/test_cluster.py covers a rank dying with steps in flight).
"""

from __future__ import annotations

import pytest

from deploy.config import load_config
from worker.engine import Engine
from worker.kv_cache import PageAllocator
from worker.request import RequestRejected
from worker.sampling.params import SamplingParams


def num_held(alloc: PageAllocator) -> int:
    """Pages the allocator holds back (freed while a step was in flight)."""
    return len(alloc._held or ())


def _config(path, async_scheduling: bool, pages: int = 12, *extra: str):
    return load_config(None, [*extra, f"model.path={path}", "model.device=cpu", f"cache.num_pages={pages}",
                              "scheduler.chunked_prefill_size=64", "scheduler.max_num_batched_tokens=64",
                              "graphs.debug=true", "graphs.prefill.max_tokens=64", "graphs.decode.max_batch_size=16",
                              f"scheduler.async_scheduling={str(async_scheduling).lower()}"])


def _workload():
    prompts = [list(range(10, 13 + 5 * k)) for k in range(1, 12)]  # 8..58 tokens: chunked prefill too
    params = [SamplingParams(max_tokens=18 + k, temperature=0.8 if k % 2 else 0.0, seed=k,
                             stop_token_ids=list(range(100, 160)) if k % 3 == 0 else [])
              for k in range(11)]
    return prompts, params


def test_async_outputs_equal_sync_under_preemption_and_stops(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    prompts, params = _workload()
    results = {}
    for mode in (False, True):  # the prompts share prefixes: cached pages would spare the preemptions
        engine = Engine(_config(path, mode, 12, "cache.prefix_caching=false"))
        free = engine.num_free_pages
        outs = engine.generate(prompts, params)
        results[mode] = outs
        assert not engine.in_flight and num_held(engine.allocator) == 0
        assert engine.num_free_pages == free  # every page back, none held
    sync, async_ = results[False], results[True]
    assert [o.token_ids for o in async_] == [o.token_ids for o in sync]
    assert [o.finish_reason for o in async_] == [o.finish_reason for o in sync]
    assert {"stop", "length"} <= {o.finish_reason for o in async_}
    assert sum(o.num_preemptions for o in async_) > 0  # 12 pages: the workload does preempt


def test_a_step_is_sent_before_the_last_is_read_back(checkpoint_dir):
    engine = Engine(_config(checkpoint_dir("tiny-llama"), True, pages=64))
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert engine.step() == [] and engine.in_flight  # the prefill is sent, nothing read back yet
    req = engine.requests[rid]
    assert req.num_pending == 1 and not req.prefilling
    events = engine.step()  # sends decode 1 (its input: the prefill's token, filled on the rank), reads the prefill
    assert [e.request_id for e in events] == [rid] and len(req.output_ids) == 1 and req.num_pending == 1
    seen = [e.token_ids[0] for e in events]
    while engine.has_unfinished():
        seen += [t for e in engine.step() for t in e.token_ids]
    assert seen == engine.output(rid).token_ids and len(seen) == 4
    ref = Engine(_config(checkpoint_dir("tiny-llama"), False, pages=64))
    again = ref.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert again.token_ids == seen


def test_abort_with_a_token_in_flight_drops_it_and_holds_its_pages_until_read_back(checkpoint_dir):
    engine = Engine(_config(checkpoint_dir("tiny-llama"), True, pages=64))
    free = engine.num_free_pages
    keep = engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    gone = engine.add_request(list(range(20, 60)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()  # a decode step with both is in flight
    pages = len(engine.requests[gone].pages)
    assert engine.abort(gone)
    assert num_held(engine.allocator) == pages  # a step in flight may still write them
    assert engine.num_free_pages == free - pages - len(engine.requests[keep].pages)
    tokens_before = list(engine.requests[gone].output_ids)
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[gone].output_ids == tokens_before  # its token in flight was dropped
    assert engine.output(keep).finish_reason == "length" and len(engine.output(keep).token_ids) == 6
    assert num_held(engine.allocator) == 0 and engine.num_free_pages == free


def test_hand_off_is_refused_with_async_scheduling(checkpoint_dir):
    engine = Engine(_config(checkpoint_dir("tiny-llama"), True, pages=64))
    with pytest.raises(RequestRejected, match="hand-off after the first token needs scheduler.async_scheduling=false"):
        engine.admit([5, 6, 7], SamplingParams(max_tokens=4), seed=1, request_id="h",
                     on_first_token=lambda req: None)
    assert "h" not in engine.requests


def test_held_pages_are_not_allocatable_until_released():
    alloc = PageAllocator(9)
    a = alloc.allocate(3)
    alloc.hold()
    alloc.free(a[:2])
    assert alloc.num_free == 5 and num_held(alloc) == 2
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a[:1])
    held = alloc.take_held()
    assert sorted(held) == sorted(a[:2]) and num_held(alloc) == 0 and alloc.num_free == 5
    alloc.free(a[2:])
    alloc.release(held)
    assert alloc.num_free == 7 and num_held(alloc) == 1
    alloc.stop_holding()
    assert alloc.num_free == 8 and num_held(alloc) == 0
    alloc.free(alloc.allocate(2))
    assert alloc.num_free == 8  # not holding: frees are allocatable at once


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_async_equals_sync_with_decode_graphs_on_the_gpu(checkpoint_dir):
    """On the GPU a launch only queues the step: step N+1's in-flight inputs are gathered on the
    device from step N's sampled tokens while the host reads step N back. Outputs, finish reasons and
    pages equal the synchronous engine's; the decode steps replayed graphs."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = checkpoint_dir("tiny-llama")

    def config(async_scheduling: bool):
        return load_config(None, [f"model.path={path}", "cache.num_pages=512", "scheduler.max_running_requests=16",
                                  "graphs.decode.max_batch_size=16", "graphs.capture=decode",
                                  f"scheduler.async_scheduling={str(async_scheduling).lower()}"])

    prompts, params = _workload()
    from prometheus_client import CollectorRegistry, generate_latest

    sync = Engine(config(False)).generate(prompts, params)
    registry = CollectorRegistry()
    engine = Engine(config(True), registry=registry)
    free = engine.num_free_pages
    got = engine.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in sync]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in sync]
    assert engine.num_free_pages == free and not engine.in_flight and num_held(engine.allocator) == 0
    decode = [s for s in engine.step_stats if s.phase == "decode"]
    assert decode and all(s.wait_s >= 0 for s in decode)
    assert 'mode="decode_cuda_graph"' in generate_latest(registry).decode()
