"""tc_piecewise on CPU: the split at attention, compiled pieces against eager through the runner,
fullgraph, and the worker wiring. No CUDA here: pieces run compiled, without graphs."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry

from deploy.config import load_config
from graphs.backends import CaptureError, create_backend
from graphs.metrics import GraphMetrics
from graphs.piecewise import PiecewiseCompiled
from graphs.prefill import PrefillGraphRunner
from tests.graph_harness import eager_hidden, fill_cache_randomly, random_prefill_batch
from tests.reference import OwnModel, rel_err
from worker.attention.splitting import SPLITTING_OPS
from worker.engine import Engine
from worker.model_steps import CompiledPrefillStep
from worker.sampling.params import SamplingParams

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # compiled code is process-wide
LADDER, SLOTS = [64, 128, 256, 512], 4


@pytest.fixture(scope="module")
def compiled(two_layers):
    own = OwnModel(two_layers, num_pages=2048)
    fill_cache_randomly(own)
    registry = CollectorRegistry()
    step = CompiledPrefillStep(own.model, own.attention)
    runner = PrefillGraphRunner(step, create_backend("tc_piecewise", CPU), LADDER, SLOTS, 2.0,
                                GraphMetrics(registry), own.model.dtype)
    runner.capture_all(progress=False)
    assert not runner.failed, runner.failed
    return own, step, runner, registry


@pytest.mark.slow  # one inductor compile (~15 s cold) shared by the module
def test_split_has_one_attention_op_per_layer_between_compiled_pieces(compiled):
    own, step, runner, _ = compiled
    layers = own.arch.num_layers
    assert layers == 2
    compiler = step.compiled.compiler
    split = compiler.split
    children = dict(split.named_children())
    ops = {name: [n for n in m.graph.nodes if compiler.is_split_node(n)] for name, m in children.items()}
    attention = {name for name, found in ops.items() if found}
    pieces = [name for name in children if name not in attention]
    assert len(attention) == layers and len(pieces) == layers + 1
    assert (compiler.splits, compiler.pieces) == (layers, layers + 1)
    order = [n.target for n in split.graph.nodes if n.op == "call_module"]
    assert [name in attention for name in order] == [False, True] * layers + [False]
    assert [ops[name][0].args[-1] for name in order if name in attention] == list(range(layers))
    for name in attention:  # the op alone: no compute leaks out of the compiled pieces
        assert [n.op for n in children[name].graph.nodes if n.op not in ("placeholder", "output")] == ["call_function"]
    for name in pieces:  # inductor-compiled callables stand in for the FX pieces
        compiled_piece = split.__dict__[name]
        assert not ops[name] and callable(compiled_piece) and not isinstance(compiled_piece, torch.nn.Module)
    for shape in runner.backend.shapes.values():
        assert (shape.num_segments, shape.num_breaks) == (layers + 1, layers)


@pytest.mark.slow
def test_one_compile_serves_every_bucket_and_compile_time_is_apart(compiled):
    _, step, runner, _ = compiled
    assert sorted(runner.backend.shapes) == LADDER
    assert step.compiled.compiles == 1
    stats = runner.backend.stats()
    assert stats["compiles"] == 1 and stats["compile_seconds"] > 0 and stats["capture_seconds"] >= 0
    assert stats["compile_seconds"] == pytest.approx(step.compiled.compile_seconds)


@pytest.mark.slow
def test_tc_piecewise_prefill_equals_eager_through_the_runner(compiled):
    own, step, runner, registry = compiled
    rng = random.Random(0)
    replayed = 0
    for i in range(16):
        batch = random_prefill_batch(own, rng, rng.randint(1, SLOTS), 110, max_prefix=40 if i % 2 else 0)
        choice = runner.decide(batch.live)
        if not choice.replays:
            assert choice.reason == "padding_waste"
            continue
        n, size = batch.live.num_tokens, choice.size
        ref = eager_hidden(own, batch.live).clone()
        got = runner.execute(batch.live, choice)
        replayed += 1
        assert rel_err(got, ref) <= 1e-5, f"batch {i}: {batch.live.num_requests} requests, {n} tokens in {size}"
        assert not runner.buffers.tokens.input_ids[n:size].any() and not runner.buffers.tokens.positions[n:size].any()
    assert replayed >= 8
    assert step.compiled.compiles == 1
    fallbacks = registry.get_sample_value("cuda_graph_fallbacks_total", {"phase": "prefill", "reason": "tc_piecewise"})
    assert fallbacks == replayed  # off CUDA a replay is a compiled pass without graphs


@pytest.mark.slow
def test_sentinels_and_padding_write_no_kv_outside_live_pages(compiled):
    own, _, runner, _ = compiled
    rng = random.Random(3)
    for requests in (1, 2, SLOTS):
        batch = random_prefill_batch(own, rng, requests, 60, max_prefix=30)
        before = own.cache.kv.clone()
        choice = runner.decide(batch.live)
        assert choice.replays, choice.reason
        runner.execute(batch.live, choice)
        untouched = [p for p in range(1, own.cache.num_pages) if p not in batch.pages]
        assert torch.equal(own.cache.kv[:, untouched], before[:, untouched])
        assert not torch.equal(own.cache.kv[:, sorted(batch.pages)], before[:, sorted(batch.pages)])


def _plain(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) * 2


def _with_graph_break(x: torch.Tensor) -> torch.Tensor:
    y = torch.relu(x)
    torch._dynamo.graph_break()
    return y * 2


def test_flashinfer_kernels_trace_as_torch_kernels_under_compile():
    # No flashinfer here: a traced call that reached the fused kernels would fail to import them.
    from worker.model.flashinfer_kernels import FlashInferKernels
    from worker.model.rotary import cos_sin_cache
    from worker.model.torch_kernels import TorchKernels as ref

    g = torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(*shape, generator=g) for shape in ((6, 128), (6, 128), (128,)))
    pos, cache = torch.arange(6), cos_sin_cache(64, 10000.0, None, 16, torch.device("cpu"))

    def body(kernels):
        h, res = kernels.fused_add_rms_norm(x, r, w, 1e-6)
        q, k = kernels.apply_rope(pos, h, kernels.rms_norm(res, w, 1e-6), 64, cache)
        return kernels.silu_and_mul(torch.cat([q, k], -1))

    fused = FlashInferKernels()
    traced = torch.compile(lambda: body(fused), fullgraph=True, backend="eager")
    assert torch.equal(traced(), body(ref))


def test_fullgraph_is_set_so_a_graph_break_raises_and_fails_the_capture():
    x = torch.randn(8, 4)
    plain = PiecewiseCompiled(_plain, SPLITTING_OPS, compiler="eager")
    assert torch.equal(plain(x), _plain(x)) and plain.compiles == 1
    broken = PiecewiseCompiled(_with_graph_break, SPLITTING_OPS, compiler="eager")
    with pytest.raises(torch._dynamo.exc.Unsupported):
        broken(x)
    assert broken.compiles == 0
    backend = create_backend("tc_piecewise", CPU)
    with pytest.raises(CaptureError, match="tc_piecewise backend failed.*failed earlier"):
        backend.capture(8, lambda: broken(x), phase="prefill")
    assert not backend.has(8)


@pytest.mark.slow
def test_worker_wires_tc_piecewise_and_generates_as_eager(two_layers):
    registry = CollectorRegistry()
    overrides = [f"model.path={two_layers}", "scheduler.chunked_prefill_size=256", "graphs.prefill.max_tokens=256",
                 "graphs.prefill.num_request_slots=2"]
    tc = Engine(load_config(None, [*overrides, "graphs.prefill.backend=tc_piecewise"]), registry=registry)
    runner = tc.worker.runner.prefill_runner
    assert runner.backend.name == "tc_piecewise" and sorted(runner.backend.shapes) == runner.ladder
    assert runner.step.compiled.compiles == 1
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(30, 120))] for _ in range(4)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ref = Engine(load_config(None, overrides)).generate(prompts, params)
    assert [o.token_ids for o in tc.generate(prompts[:1], params)] == [ref[0].token_ids]
    assert [o.token_ids for o in tc.generate(prompts, params)] == [o.token_ids for o in ref]

    def value(reason):
        return registry.get_sample_value("cuda_graph_fallbacks_total", {"phase": "prefill", "reason": reason}) or 0

    assert value("tc_piecewise") >= 1 and value("too_many_requests") >= 1
