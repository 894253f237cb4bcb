"""bf16 logits error against HF transformers' fp32 logits, per kernel set and attention backend.

The GPU acceptance of the model and engine issues compares bf16 logits with a 2e-2 relative
error. This script says where our bf16 error comes from: for each tiny preset (trained briefly
on the corpus, as the GPU tests do) it runs the prompt batch and 16 greedy decode steps with
every combination of element-wise kernels (``torch`` = HF's arithmetic order, ``fused`` =
flashinfer's fp32-internal kernels) and attention backend (``torch``, ``flashinfer``), and HF's
own bf16 model as the floor. Errors are relative L2 against HF fp32: per position (mean, max)
and per step over the whole batch's logits (max over steps).

Usage (GPU machine): ``python bench/precision.py [--presets tiny-qwen2,tiny-qwen3]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import environment, print_table, write_results  # noqa: E402
from tests.reference import OwnModel, hf_logits, rel_l2  # noqa: E402
from tests.trained import corpus_prompts, train_checkpoint  # noqa: E402
from worker.checkpoint import write_checkpoint  # noqa: E402
from worker.model.flashinfer_kernels import FlashInferKernels  # noqa: E402
from worker.model.torch_kernels import TorchKernels  # noqa: E402

PROMPT_LENS = [5, 17, 33, 1, 48, 70]
DECODE_STEPS = 16


class _HFBf16:
    """HF's bf16 model behind the ``OwnModel.step`` interface (recomputes each sequence)."""

    def __init__(self, hf16) -> None:
        self.hf16 = hf16

    def new_request(self, ids, rid):
        return list(ids)

    def step(self, seqs, num_new, is_prefill):
        rows = [hf_logits(self.hf16, s)[-n:] for s, n in zip(seqs, num_new)]
        return torch.cat(rows)


def _run(model, prompts: list[list[int]], hf32) -> dict:
    """Prompt batch then greedy decode steps; rel L2 against HF fp32 on the same sequences."""
    reqs = [model.new_request(p, i) for i, p in enumerate(prompts)]
    seqs = [list(p) for p in prompts]
    logits = model.step(reqs, [len(p) for p in prompts], is_prefill=True)
    positions, steps = [], []
    ref_rows, got_rows, offset, last = [], [], 0, []
    for s in seqs:
        got, ref = logits[offset:offset + len(s)], hf_logits(hf32, s)
        positions += [rel_l2(got[i], ref[i]) for i in range(len(s))]
        got_rows.append(got)
        ref_rows.append(ref)
        last.append(got[-1])
        offset += len(s)
    steps.append(rel_l2(torch.cat(got_rows), torch.cat(ref_rows)))
    prefill_pos = list(positions)
    for _ in range(DECODE_STEPS):
        for r, s, lg in zip(reqs, seqs, last):
            s.append(int(lg.argmax()))
            if isinstance(r, list):
                r.append(s[-1])
            else:
                r.output_ids.append(s[-1])
        step_in = reqs if not isinstance(reqs[0], list) else seqs
        got = model.step(step_in, [1] * len(seqs), is_prefill=False)
        ref = torch.stack([hf_logits(hf32, s)[-1] for s in seqs])
        positions += [rel_l2(got[i], ref[i]) for i in range(len(seqs))]
        steps.append(rel_l2(got, ref))
        last = list(got)
    decode_pos = positions[len(prefill_pos):]
    return {
        "prefill_pos_mean": sum(prefill_pos) / len(prefill_pos), "prefill_pos_max": max(prefill_pos),
        "decode_pos_mean": sum(decode_pos) / len(decode_pos), "decode_pos_max": max(decode_pos),
        "step_max": max(steps), "step_mean": sum(steps) / len(steps),
        "positions_over_2e-2": sum(p > 2e-2 for p in positions), "positions": len(positions),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny-llama,tiny-llama2,tiny-qwen2,tiny-qwen3,tiny-mistral")
    ap.add_argument("--checkpoints", default=None)
    ap.add_argument("--device", default="cuda", help="cpu runs a smoke test (torch kernels and attention)")
    ap.add_argument("--train-steps", type=int, default=400)
    args = ap.parse_args()
    import transformers

    root = Path(args.checkpoints or tempfile.mkdtemp(prefix="precision-"))
    dev = args.device
    fused = FlashInferKernels() if dev == "cuda" and FlashInferKernels.available() else None
    rows = []
    for preset in args.presets.split(","):
        src = root / preset
        if not (src / "config.json").is_file():
            write_checkpoint(preset, src, seed=0, dtype="float32")
        path = train_checkpoint(src, root / f"{preset}-trained", steps=args.train_steps, device=dev)
        hf32 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
        hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev).eval()
        prompts = corpus_prompts(path, PROMPT_LENS, seed=len(preset))
        rows.append({"preset": preset, "variant": "hf-bf16", **_run(_HFBf16(hf16), prompts, hf32)})
        for kname, kernels in [("torch", TorchKernels), ("fused", fused)]:
            for backend in ["torch", "flashinfer"]:
                if kernels is None or (backend == "flashinfer" and fused is None):
                    continue
                ours = OwnModel(path, dtype=torch.bfloat16, device=dev, backend=backend, kernels=kernels)
                rows.append({"preset": preset, "variant": f"ours {kname}-kernels/{backend}-attn",
                             **_run(ours, prompts, hf32)})
                del ours
        del hf32, hf16
        if dev == "cuda":
            torch.cuda.empty_cache()
    print_table(rows, ["preset", "variant", "prefill_pos_mean", "prefill_pos_max", "decode_pos_mean",
                       "decode_pos_max", "step_mean", "step_max", "positions_over_2e-2"])
    write_results("precision", {"env": environment(), "decode_steps": DECODE_STEPS,
                                "prompt_lens": PROMPT_LENS, "rows": rows})


if __name__ == "__main__":
    main()
