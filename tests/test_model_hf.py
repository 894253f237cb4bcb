"""Our decoder against HF transformers on the same checkpoint directory (fp32, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.reference import OwnModel, hf_logits, rel_err

TINY_PRESETS = ["tiny-llama", "tiny-llama2", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]
PROMPT_LENS = [5, 17, 33, 1, 48, 70]


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_models():
    transformers = pytest.importorskip("transformers")
    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager").eval()
        return cache[path]

    return get


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_logits_match_hf_prefill_and_16_decode_steps(preset, checkpoint_dir, hf_models):
    path = checkpoint_dir(preset)
    hf = hf_models(path)
    ours = OwnModel(path, page_size=16)
    prompts = _prompts(ours.arch.vocab_size, seed=len(preset))
    reqs = [ours.new_request(p, i) for i, p in enumerate(prompts)]

    logits = ours.step(reqs, [len(p) for p in prompts], is_prefill=True)
    offset, last = 0, []
    for p in prompts:
        ref = hf_logits(hf, p)
        got = logits[offset:offset + len(p)]
        assert rel_err(got, ref) <= 1e-4, f"{preset}: prompt logits differ (len {len(p)})"
        last.append(got[-1])
        offset += len(p)

    seqs = [list(p) for p in prompts]
    for step in range(16):
        for s, lg in zip(seqs, last):
            s.append(int(lg.argmax()))
        for r, s in zip(reqs, seqs):
            r.output_ids.append(s[-1])
        logits = ours.step(reqs, [1] * len(reqs), is_prefill=False)
        last = list(logits)
        for s, got in zip(seqs, last):
            ref = hf_logits(hf, s)[-1]
            assert rel_err(got, ref) <= 1e-4, f"{preset}: decode step {step} logits differ"


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out, past, inp = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = hf(inp, past_key_values=past, use_cache=True)
            past = res.past_key_values
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            inp = torch.tensor([[tok]])
    return out


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_generate_cli_greedy_matches_hf(preset, checkpoint_dir, hf_models):
    path = checkpoint_dir(preset)
    hf = hf_models(path)
    prompts = _prompts(1024, seed=100 + len(preset))
    cmd = [sys.executable, "-m", "deploy", "--log-level", "WARNING", "generate", "--model", str(path),
           "--max-tokens", "32", "--ignore-eos", "--output", "json"]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    outputs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(outputs) == len(prompts)
    for p, out in zip(prompts, outputs):
        assert out["prompt_token_ids"] == p
        assert out["finish_reason"] == "length"
        assert out["token_ids"] == _hf_greedy(hf, p, 32), f"{preset}: greedy continuation differs"
