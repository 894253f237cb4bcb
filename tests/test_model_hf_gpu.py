"""bf16 on the GPU: our model (both attention backends) against HF transformers."""

from __future__ import annotations

import pytest
import torch

from deploy.config import load_config
from tests.reference import OwnModel, hf_logits, rel_err, rel_l2
from tests.test_model_hf import TINY_PRESETS, _prompts
from worker.attention.factory import flashinfer_importable
from worker.engine import Engine
from worker.model.kernels import select_kernels
from worker.sampling.params import SamplingParams

pytestmark = pytest.mark.gpu

BACKENDS = ["torch", "flashinfer"]


def _skip_missing(backend: str) -> None:
    if backend == "flashinfer" and not flashinfer_importable():
        pytest.skip("flashinfer not installed")


@pytest.fixture(scope="module")
def hf_bf16():
    transformers = pytest.importorskip("transformers")
    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.bfloat16).to("cuda").eval()
        return cache[path]

    return get


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf_logits(hf, seq)[-1].argmax()))
    return seq[len(ids):]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_bf16_logits_and_greedy_match_hf(preset, backend, checkpoint_dir, hf_bf16):
    _skip_missing(backend)
    path = checkpoint_dir(preset)
    hf = hf_bf16(path)
    kernels = select_kernels(torch.device("cuda"), prefer_fused=backend == "flashinfer")
    ours = OwnModel(path, dtype=torch.bfloat16, device="cuda", backend=backend, kernels=kernels)
    prompts = _prompts(ours.arch.vocab_size, seed=len(preset))
    reqs = [ours.new_request(p, i) for i, p in enumerate(prompts)]
    logits = ours.step(reqs, [len(p) for p in prompts], is_prefill=True)
    offset, seqs, last, worst_max = 0, [], [], 0.0
    for p in prompts:
        got, ref = logits[offset:offset + len(p)], hf_logits(hf, p)
        worst_max = max(worst_max, rel_err(got, ref))
        assert rel_l2(got, ref) <= 2e-2, f"{preset}/{backend}: prompt logits"
        seqs.append(list(p))
        last.append(got[-1])
        offset += len(p)
    for step in range(16):
        for r, s, lg in zip(reqs, seqs, last):
            s.append(int(lg.argmax()))
            r.output_ids.append(s[-1])
        last = list(ours.step(reqs, [1] * len(reqs), is_prefill=False))
        for s, got in zip(seqs, last):
            ref = hf_logits(hf, s)[-1]
            worst_max = max(worst_max, rel_err(got, ref))
            assert rel_l2(got, ref) <= 2e-2, f"{preset}/{backend}: decode step {step}"
    print(f"{preset}/{backend}: worst max-abs relative error {worst_max:.4f}")

    engine = Engine(load_config(None, [f"model.path={path}", "model.dtype=bfloat16",
                                       f"attention.backend={backend}", "cache.num_pages=512"]))
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.token_ids == _hf_greedy(hf, p, 8), f"{preset}/{backend}: first 8 greedy tokens"


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_both_backends_agree_bf16(preset, checkpoint_dir):
    _skip_missing("flashinfer")
    path = checkpoint_dir(preset)
    prompts = _prompts(1024, seed=3)
    results = {}
    for backend in BACKENDS:
        kernels = select_kernels(torch.device("cuda"), prefer_fused=backend == "flashinfer")
        ours = OwnModel(path, dtype=torch.bfloat16, device="cuda", backend=backend, kernels=kernels)
        reqs = [ours.new_request(p, i) for i, p in enumerate(prompts)]
        prefill = ours.step(reqs, [len(p) for p in prompts], is_prefill=True)
        for r in reqs:
            r.output_ids.append(7)
        decode = ours.step(reqs, [1] * len(reqs), is_prefill=False)
        results[backend] = (prefill, decode)
    assert rel_l2(results["flashinfer"][0], results["torch"][0]) <= 2e-2
    assert rel_l2(results["flashinfer"][1], results["torch"][1]) <= 2e-2
