"""bf16 on the GPU: our model (both attention backends) against HF transformers.

The comparisons run on the tiny checkpoints after a short training on the bundled corpus
(``tests/trained.py`` says why: random-weight models make greedy tokens coin flips in bf16),
with corpus windows of six lengths as prompts.
"""

from __future__ import annotations

import pytest
import torch

from deploy.config import load_config
from tests.reference import OwnModel, hf_logits, rel_l2
from tests.test_model_hf import PROMPT_LENS, TINY_PRESETS, _prompts
from tests.trained import corpus_prompts, train_checkpoint
from worker.attention.factory import flashinfer_importable
from worker.engine import Engine
from worker.model.kernels import select_kernels
from worker.model.torch_kernels import TorchKernels
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
    """Our bf16 model against HF's fp32 logits (the accurate reference): the relative L2 error of
    each step's logits (the whole prompt batch, then each of 16 decode steps on our KV cache) is
    <= 2e-2. Then the engine's first 8 greedy tokens equal HF bf16's for every prompt.

    The error is taken per step, not per position: HF's own bf16 model exceeds 2e-2 at single
    positions of tiny-qwen3 (up to 0.033 against fp32; ``bench/precision.py`` measures it), so a
    per-position bound would fail the reference implementation itself. Per-position errors and
    HF bf16's (the noise floor) are printed beside ours.
    """
    _skip_missing(backend)
    path = trained_dir(preset)
    hf32, hf16 = hf_models(path, torch.float32), hf_models(path, torch.bfloat16)
    kernels = select_kernels(torch.device("cuda"), prefer_fused=backend == "flashinfer")  # as Worker picks
    ours = OwnModel(path, dtype=torch.bfloat16, device="cuda", backend=backend, kernels=kernels)
    prompts = corpus_prompts(path, PROMPT_LENS, seed=len(preset))
    reqs = [ours.new_request(p, i) for i, p in enumerate(prompts)]
    logits = ours.step(reqs, [len(p) for p in prompts], is_prefill=True)
    steps, floors, positions = [], [], []

    def check(got: torch.Tensor, refs: list[torch.Tensor], floor_rows: list[torch.Tensor], what: str) -> None:
        ref = torch.cat(refs)
        steps.append(rel_l2(got, ref))
        floors.append(rel_l2(torch.cat(floor_rows), ref))
        positions.extend(rel_l2(g, r) for g, r in zip(got, ref))
        assert steps[-1] <= 2e-2, f"{preset}/{backend} {what}: {steps[-1]:.4f} (HF bf16 {floors[-1]:.4f})"

    seqs = [list(p) for p in prompts]
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0).tolist()
    check(logits, [hf_logits(hf32, p) for p in prompts], [hf_logits(hf16, p) for p in prompts], "prompt")
    last = [logits[e - 1] for e in ends]
    for step in range(16):
        for r, s, lg in zip(reqs, seqs, last):
            s.append(int(lg.argmax()))
            r.output_ids.append(s[-1])
        got = ours.step(reqs, [1] * len(reqs), is_prefill=False)
        check(got, [hf_logits(hf32, s)[-1:] for s in seqs], [hf_logits(hf16, s)[-1:] for s in seqs],
              f"decode step {step}")
        last = list(got)
    print(f"{preset}/{backend}: step rel L2 vs HF fp32 max {max(steps):.4f} (HF bf16 {max(floors):.4f}); "
          f"per position mean {sum(positions) / len(positions):.4f} max {max(positions):.4f}")

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
        ours = OwnModel(path, dtype=torch.bfloat16, device="cuda", backend=backend, kernels=kernels,
                        fused_rope_store=False)
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
