"""graphs.prefill.mlp_chunk_tokens on the CPU: the MLP over row chunks equals the MLP whole (one rank,
and two tensor-parallel ranks over gloo with one all-reduce of the whole output), the setting
reaches the prefill step the worker builds and its debug runner path generates the same tokens as
the whole MLP, and a bad value is refused by name (the GPU side, the graph pool it saves:
tests/test_graph_memory_gpu.py)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from configkit import ConfigError
from deploy.config import load_config
from graphs.config import PrefillGraphConfig
from worker.engine import Engine
from worker.model.loader import load_model
from worker.model.parallel import TensorParallel
from worker.sampling.params import SamplingParams

TOKENS = 45  # chunks of 8: five whole ones and a tail of 5


def _hidden(hidden_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(TOKENS, hidden_size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk", [1, 8, 44, 45, 100])
def test_the_mlp_over_row_chunks_equals_it_whole(checkpoint_dir, chunk):
    model, arch = load_model(checkpoint_dir("tiny-llama"), torch.float32, torch.device("cpu"))
    x = _hidden(arch.hidden_size)
    with torch.inference_mode():
        for layer in model.layers[:2]:
            whole, chunked = layer.mlp(x), layer.mlp(x, chunk)
            assert chunked.shape == whole.shape and chunked.dtype == whole.dtype
            torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


def _rank(rank: int, port: int, path: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model, arch = load_model(path, torch.float32, torch.device("cpu"), tp=TensorParallel(rank, 2))
        x = _hidden(arch.hidden_size)
        with torch.inference_mode():
            out[rank] = (model.layers[1].mlp(x), model.layers[1].mlp(x, 8))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_tensor_parallel_ranks_reduce_the_chunked_output_once_to_the_single_rank_result(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    model, arch = load_model(path, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        single = model.layers[1].mlp(_hidden(arch.hidden_size))
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(_free_port(), str(path), out), nprocs=2, join=True)
        results = dict(out)
    for rank in (0, 1):
        whole, chunked = results[rank]
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(chunked, single, rtol=1e-4, atol=1e-5)


def test_a_chunk_below_one_token_is_refused_by_name():
    assert PrefillGraphConfig().mlp_chunk_tokens == 2048
    assert PrefillGraphConfig.from_dict({"mlp_chunk_tokens": None}).mlp_chunk_tokens is None
    with pytest.raises(ConfigError, match="mlp_chunk_tokens"):
        PrefillGraphConfig.from_dict({"mlp_chunk_tokens": 0})


def test_the_worker_prefill_step_chunks_its_mlp_and_generates_the_whole_mlps_tokens(checkpoint_dir):
    """The debug backend runs the prefill graphs' path (ModelPrefillStep) eagerly: with chunks of 16
    tokens its greedy tokens are those of the same fleet with the MLP whole."""
    overrides = [f"model.path={checkpoint_dir('tiny-llama')}", "graphs.debug=true", "cache.num_pages=256",
                 "scheduler.chunked_prefill_size=128", "graphs.prefill.max_tokens=128",
                 "graphs.prefill.num_request_slots=2", "cache.prefix_caching=false"]
    prompts = [[(7 * i + 3 * j) % 900 + 3 for j in range(40 + 17 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    tokens = {}
    for chunk in ("16", "null"):
        engine = Engine(load_config(None, [*overrides, f"graphs.prefill.mlp_chunk_tokens={chunk}"]))
        try:
            step = engine.worker.runner.prefill_runner.step
            assert step.mlp_chunk_tokens == (16 if chunk == "16" else None)
            tokens[chunk] = [o.token_ids for o in engine.generate(prompts, params)]
        finally:
            engine.shutdown()
    assert tokens["16"] == tokens["null"]
