"""bf16 on the GPU: our model (both attention backends) against HF transformers.

The comparisons run on the tiny checkpoints after a short training on the bundled corpus
(``tests/trained.py`` says why: random-weight models make greedy tokens coin flips in bf16),
with corpus windows of six lengths as prompts.
"""

from __future__ import annotations

import pytest
import torch

from deploy.config import load_config
from tests.reference import OwnModel, hf_logits, rel_err, rel_l2
from tests.test_model_hf import PROMPT_LENS, TINY_PRESETS, _prompts
from tests.trained import corpus_prompts, train_checkpoint
from worker.attention.factory import flashinfer_importable
from worker.engine import Engine
from worker.model.kernels import TorchKernels, select_kernels
from worker.sampling.params import SamplingParams

pytestmark = pytest.mark.gpu

BACKENDS = ["torch", "flashinfer"]


def _skip_missing(backend: str) -> None:
    if backend == "flashinfer" and not flashinfer_importable():
        pytest.skip("flashinfer not installed")


@pytest.fixture(scope="module")
def hf_models():
    transformers = pytest.importorskip("transformers")
    cache = {}

    def get(path, dtype):
        if (path, dtype) not in cache:
            cache[(path, dtype)] = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype).to("cuda").eval()
        return cache[(path, dtype)]

    return get


@pytest.fixture(scope="module")
def trained_dir(checkpoint_dir):
    made = {}

    def get(preset):
        if preset not in made:
            src = checkpoint_dir(preset)
            made[preset] = train_checkpoint(src, src.with_name(src.name + "-trained"))
        return made[preset]

    return get


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf_logits(hf, seq)[-1].argmax()))
    return seq[len(ids):]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_bf16_logits_and_greedy_match_hf(preset, backend, trained_dir, hf_models):
    """Our bf16 model against HF's fp32 logits (the accurate reference): relative L2 error <= 2e-2
    at the prompt and over 16 decode steps on our KV cache; HF's own bf16 model against the same
    reference is printed as the noise floor. Then the engine's first 8 greedy tokens equal HF
    bf16's for every prompt."""
    _skip_missing(backend)
    path = trained_dir(preset)
    hf32, hf16 = hf_models(path, torch.float32), hf_models(path, torch.bfloat16)
    kernels = select_kernels(torch.device("cuda"), prefer_fused=backend == "flashinfer")
    ours = OwnModel(path, dtype=torch.bfloat16, device="cuda", backend=backend, kernels=kernels)
    prompts = corpus_prompts(path, PROMPT_LENS, seed=len(preset))
    reqs = [ours.new_request(p, i) for i, p in enumerate(prompts)]
    logits = ours.step(reqs, [len(p) for p in prompts], is_prefill=True)
    errors, floors, worst_max = [], [], 0.0

    def check(got, seq, rows):
        nonlocal worst_max
        ref = hf_logits(hf32, seq)[rows]
        errors.append(rel_l2(got, ref))
        floors.append(rel_l2(hf_logits(hf16, seq)[rows], ref))
        worst_max = max(worst_max, rel_err(got, ref))
        assert errors[-1] <= 2e-2, f"{preset}/{backend}: {errors[-1]:.4f} (HF bf16 floor {floors[-1]:.4f})"

    offset, seqs, last = 0, [], []
    for p in prompts:
        got = logits[offset:offset + len(p)]
        check(got, p, slice(None))
        seqs.append(list(p))
        last.append(got[-1])
        offset += len(p)
    for _ in range(16):
        for r, s, lg in zip(reqs, seqs, last):
            s.append(int(lg.argmax()))
            r.output_ids.append(s[-1])
        last = list(ours.step(reqs, [1] * len(reqs), is_prefill=False))
        for s, got in zip(seqs, last):
            check(got, s, -1)
    print(f"{preset}/{backend}: rel L2 vs HF fp32 mean {sum(errors) / len(errors):.4f} max {max(errors):.4f}; "
          f"HF bf16 floor mean {sum(floors) / len(floors):.4f} max {max(floors):.4f}; worst max-abs {worst_max:.4f}")

    engine = Engine(load_config(None, [f"model.path={path}", "model.dtype=bfloat16",
                                       f"attention.backend={backend}", "cache.num_pages=512"]))
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.token_ids == _hf_greedy(hf16, p, 8), f"{preset}/{backend}: first 8 greedy tokens"


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_both_backends_agree_bf16(preset, checkpoint_dir):
    _skip_missing("flashinfer")
    path = checkpoint_dir(preset)
    prompts = _prompts(1024, seed=3)
    results = {}
    for backend in BACKENDS:
        kernels = TorchKernels  # the same element-wise kernels: only the attention backend differs
        ours = OwnModel(path, dtype=torch.bfloat16, device="cuda", backend=backend, kernels=kernels)
        reqs = [ours.new_request(p, i) for i, p in enumerate(prompts)]
        prefill = ours.step(reqs, [len(p) for p in prompts], is_prefill=True)
        for r in reqs:
            r.output_ids.append(7)
        decode = ours.step(reqs, [1] * len(reqs), is_prefill=False)
        results[backend] = (prefill, decode)
    assert rel_l2(results["flashinfer"][0], results["torch"][0]) <= 2e-2
    assert rel_l2(results["flashinfer"][1], results["torch"][1]) <= 2e-2
    print(f"{preset}: flashinfer vs torch rel L2 prefill {rel_l2(results['flashinfer'][0], results['torch'][0]):.4f} "
          f"decode {rel_l2(results['flashinfer'][1], results['torch'][1]):.4f}")
